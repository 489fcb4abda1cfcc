// CPU kernels of the block-scaled tile ops (see tiles.h and [Note: block-scaled rules] in
// rules.h). Each thread takes a range of tiles (split by elements, TileWeights) and works through
// it in runs of adjacent tiles of one tile-row: pass 1 reads the run row by row (contiguous
// memory) into per-tile amaxes, then the scales, then pass 2 quantises row by row; the
// per-element work is the vectorised row kernels of cpu_rows.h. Every tile reads its own
// elements only, so the result does not depend on the thread count or on which rank quantises
// the tile.

#include "quant/tiles.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "quant/cpu_rows.h"
#include "quant/rules.h"

namespace veragged {
namespace quant {
namespace {

int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

bool float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// Checks every row of `table` against a flat tensor of `numel` elements and a packed buffer of
// `bytes`, and that the rows' tiles sum to `tiles`.
void check_table(const at::Tensor& table, int64_t numel, int64_t bytes, int64_t tiles,
                 int64_t raw_itemsize, const char* op) {
  TORCH_CHECK_VALUE(table.scalar_type() == at::kLong && table.dim() == 2 &&
                        table.size(1) == kTableCols && table.is_contiguous(),
                    op, ": table must be a contiguous int64 tensor of [n, ", kTableCols,
                    "], got ", table.scalar_type(), " ", table.sizes());
  // A device table's rows are not read here (that would synchronise the host with the stream):
  // see "Checks" in tiles.h.
  if (!table.device().is_cpu()) return;
  const at::Tensor& h = table;
  const int64_t* t = h.data_ptr<int64_t>();
  int64_t expect = 0;
  for (int64_t i = 0; i < h.size(0); ++i, t += kTableCols) {
    const int64_t f = t[kFormat], rows = t[kRows], cols = t[kCols];
    TORCH_CHECK_VALUE(f >= 0 && f < kNumFormats, op, ": row ", i, " has format ", f);
    TORCH_CHECK_VALUE(rows >= 0 && cols >= 0 && t[kTileRows] >= 1 && t[kTileCols] >= 1, op,
                      ": row ", i, " has a negative size or a tile dim < 1");
    TORCH_CHECK_VALUE(t[kElemOff] >= 0 && t[kElemOff] + rows * cols <= numel, op, ": row ", i,
                      " covers elements [", t[kElemOff], ", ", t[kElemOff] + rows * cols,
                      ") of a tensor of ", numel);
    const int64_t data = rows * cols * (f == kRaw ? raw_itemsize : 1);
    const int64_t n_tiles = ceil_div(rows, t[kTileRows]) * ceil_div(cols, t[kTileCols]);
    TORCH_CHECK_VALUE(t[kDataOff] >= 0 && t[kDataOff] + data <= bytes, op, ": row ", i,
                      " data bytes [", t[kDataOff], ", ", t[kDataOff] + data,
                      ") outside the packed buffer of ", bytes);
    const int64_t sb = n_tiles * scale_bytes(f);
    TORCH_CHECK_VALUE(t[kScaleOff] >= 0 && t[kScaleOff] + sb <= bytes, op, ": row ", i,
                      " scale bytes outside the packed buffer of ", bytes);
    TORCH_CHECK_VALUE(f != kRaw || t[kDataOff] % raw_itemsize == 0, op, ": row ", i,
                      " raw data offset ", t[kDataOff], " is not a multiple of ", raw_itemsize);
    TORCH_CHECK_VALUE(t[kFirstTile] == expect, op, ": row ", i, " first_tile ", t[kFirstTile],
                      " but the rows before it have ", expect, " tiles");
    expect += n_tiles;
  }
  TORCH_CHECK_VALUE(expect == tiles, op, ": the table has ", expect, " tiles, not ", tiles);
}

// Work is split by elements, not by tiles (a group mixes 16384-element 128x128 tiles with
// 32-element MXFP8 ones): every tile gets a weight (its full size) and a start, the sum of the
// weights of the tiles before it; a parallel_for over [0, total weight) gives each thread the
// tiles whose start falls in its range. Each tile is then written from its own elements only, so
// neither the split nor the thread count changes any byte.
class TileWeights {
 public:
  TileWeights(const int64_t* table, int64_t n_rows) : table_(table), starts_(n_rows + 1, 0) {
    for (int64_t i = 0; i < n_rows; ++i) {
      const int64_t* t = table + i * kTableCols;
      starts_[i + 1] = starts_[i] + tiles_of(t) * weight_of(t);
    }
  }
  int64_t total() const { return starts_.back(); }
  // The first tile whose start is >= w (the number of tiles if none).
  int64_t tile_at(int64_t w) const {
    // The last row whose start is <= w (rows of no tiles share the next row's start).
    const int64_t row =
        std::upper_bound(starts_.begin(), starts_.end() - 1, w) - starts_.begin() - 1;
    const int64_t* t = table_ + row * kTableCols;
    const int64_t j = ceil_div(w - starts_[row], weight_of(t));
    return t[kFirstTile] + std::min(j, tiles_of(t));
  }
  static int64_t tiles_of(const int64_t* t) {
    return ceil_div(t[kRows], t[kTileRows]) * ceil_div(t[kCols], t[kTileCols]);
  }
  static int64_t weight_of(const int64_t* t) {
    return std::max<int64_t>(
        1, std::min(t[kTileRows], t[kRows]) * std::min(t[kTileCols], t[kCols]));
  }

 private:
  const int64_t* table_;
  std::vector<int64_t> starts_;
};

constexpr int64_t kGrainElems = 1 << 15;  // the least work a thread gets
constexpr int64_t kGroupElems = 1 << 15;  // elements of the tiles processed together (L2-sized)

// Calls group(row pointer, tile-row, first tile-col, end tile-col) for tiles [begin, end) of the
// table, in runs of consecutive tiles of one tile-row of at most kGroupElems elements.
template <typename Group>
void for_tile_groups(const int64_t* table, int64_t n_rows, int64_t begin, int64_t end,
                     Group group) {
  if (begin >= end) return;
  for (int64_t row = table_row(table, n_rows, begin), k = begin; k < end; ++row) {
    const int64_t* t = table + row * kTableCols;
    const int64_t per_row = ceil_div(t[kCols], t[kTileCols]);
    const int64_t n = TileWeights::tiles_of(t);
    const int64_t most = std::max<int64_t>(1, kGroupElems / TileWeights::weight_of(t));
    const int64_t stop = std::min(n, end - t[kFirstTile]);
    for (int64_t j = k - t[kFirstTile]; j < stop;) {
      const int64_t tr = j / per_row, tc0 = j % per_row;
      const int64_t tc1 = std::min({per_row, tc0 + most, tc0 + (stop - j)});
      group(t, tr, tc0, tc1);
      j += tc1 - tc0;
    }
    k = t[kFirstTile] + std::max<int64_t>(stop, k - t[kFirstTile]);
  }
}

template <typename Work>
void parallel_tiles(const int64_t* table, int64_t n_rows, Work work) {
  const TileWeights weights(table, n_rows);
  at::parallel_for(0, weights.total(), kGrainElems, [&](int64_t w0, int64_t w1) {
    work(weights.tile_at(w0), weights.tile_at(w1));
  });
}

// One tile-row's run [c0, c1) of a table row, as rows of fp32 values.
struct Run {
  int64_t r0, r1, c0, c1;
  int64_t width() const { return c1 - c0; }
};

Run run_of(const int64_t* t, int64_t tr, int64_t tc0, int64_t tc1) {
  return {tr * t[kTileRows], std::min(t[kRows], (tr + 1) * t[kTileRows]), tc0 * t[kTileCols],
          std::min(t[kCols], tc1 * t[kTileCols])};
}

// fp32 of param_t(x) for n values of src_t (what rules.h calls x).
template <typename src_t, typename param_t>
void load_values(const cpu::RowKernels& k, float* out, const src_t* in, int64_t n) {
  const uint16_t* in16 = reinterpret_cast<const uint16_t*>(in);
  if constexpr (std::is_same_v<src_t, float>) {
    if constexpr (std::is_same_v<param_t, float>) std::memcpy(out, in, n * sizeof(float));
    if constexpr (std::is_same_v<param_t, at::BFloat16>) k.round_bf16(out, in, n);
    if constexpr (std::is_same_v<param_t, at::Half>) k.round_f16(out, in, n);
  } else {
    if constexpr (std::is_same_v<src_t, at::BFloat16>) k.bf16_to_f32(out, in16, n);
    if constexpr (std::is_same_v<src_t, at::Half>) k.f16_to_f32(out, in16, n);
    if constexpr (std::is_same_v<param_t, at::BFloat16> && !std::is_same_v<src_t, param_t>)
      k.round_bf16(out, out, n);
    if constexpr (std::is_same_v<param_t, at::Half> && !std::is_same_v<src_t, param_t>)
      k.round_f16(out, out, n);
  }
}

// param_t(x) for n values of src_t (a kRaw row), through `tmp` (n floats) when needed.
template <typename src_t, typename param_t>
void copy_raw(const cpu::RowKernels& k, param_t* out, const src_t* in, int64_t n, float* tmp) {
  if constexpr (std::is_same_v<src_t, param_t>) {
    std::memcpy(out, in, n * sizeof(param_t));
  } else if constexpr (std::is_same_v<param_t, float>) {
    load_values<src_t, float>(k, out, in, n);
  } else {
    const float* f = reinterpret_cast<const float*>(in);
    if constexpr (!std::is_same_v<src_t, float>) {
      load_values<src_t, float>(k, tmp, in, n);
      f = tmp;
    }
    uint16_t* out16 = reinterpret_cast<uint16_t*>(out);
    if constexpr (std::is_same_v<param_t, at::BFloat16>) k.f32_to_bf16(out16, f, n);
    if constexpr (std::is_same_v<param_t, at::Half>) k.f32_to_f16(out16, f, n);
  }
}

// Per-thread scratch: the run's values and its tiles' amax bits and multipliers / scale_invs.
struct Scratch {
  std::vector<float> values;
  std::vector<uint32_t> amax;
  std::vector<float> factor;
};

template <typename src_t, typename param_t>
void quantize_run(const cpu::RowKernels& k, uint8_t* packed, const src_t* src, const int64_t* t,
                  int64_t tr, int64_t tc0, int64_t tc1, Scratch& s) {
  const Run b = run_of(t, tr, tc0, tc1);
  const int64_t f = t[kFormat], cols = t[kCols], w = b.width(), tiles = tc1 - tc0;
  const src_t* in = src + t[kElemOff];
  if (f == kRaw) {
    s.values.resize(w);
    copy_raw<src_t, param_t>(k, reinterpret_cast<param_t*>(packed + t[kDataOff]) + b.c0,
                             in + b.c0, w, s.values.data());
    return;
  }
  // The run's values, rows of w: src itself for fp32 to fp32, else converted once.
  constexpr bool direct = std::is_same_v<src_t, float> && std::is_same_v<param_t, float>;
  const float* values;
  int64_t stride;
  if constexpr (direct) {
    values = in + b.r0 * cols + b.c0;
    stride = cols;
  } else {
    s.values.resize((b.r1 - b.r0) * w);
    for (int64_t r = b.r0; r < b.r1; ++r)
      load_values<src_t, param_t>(k, s.values.data() + (r - b.r0) * w, in + r * cols + b.c0, w);
    values = s.values.data();
    stride = w;
  }
  s.amax.assign(tiles, 0u);
  for (int64_t r = 0; r < b.r1 - b.r0; ++r)
    k.amax_bits(s.amax.data(), values + r * stride, w, t[kTileCols]);
  s.factor.resize(tiles);
  const int64_t per_row = ceil_div(cols, t[kTileCols]), sb = tile_scale_bytes(f);
  for (int64_t j = 0; j < tiles; ++j) {
    float amax = c10::detail::fp32_from_bits(s.amax[j]);
    if (s.amax[j] > 0x7F800000u) {  // a NaN: rules.h's abs_max keeps the first one, sign and all
      amax = 0.0f;
      const int64_t lo = j * t[kTileCols], hi = std::min(w, lo + t[kTileCols]);
      for (int64_t r = 0; r < b.r1 - b.r0; ++r)
        for (int64_t c = lo; c < hi; ++c) amax = abs_max(amax, values[r * stride + c]);
    }
    const TileScale scale = tile_scale(f, amax);
    store_scale(f, packed + t[kScaleOff] + (tr * per_row + tc0 + j) * sb, scale.stored);
    s.factor[j] = scale.mul;
  }
  uint8_t* data = packed + t[kDataOff];
  for (int64_t r = b.r0; r < b.r1; ++r)
    k.quantize(data + r * cols + b.c0, values + (r - b.r0) * stride, w, t[kTileCols],
               s.factor.data());
}

// Runs `run(t, tr, tc0, tc1, scratch)` on every run of adjacent tiles of the table, the runs
// split between threads by element count, one Scratch per thread.
template <typename RunFn>
void for_each_run(const int64_t* table, int64_t n_rows, RunFn run) {
  parallel_tiles(table, n_rows, [&](int64_t begin, int64_t end) {
    Scratch s;
    for_tile_groups(table, n_rows, begin, end,
                    [&](const int64_t* t, int64_t tr, int64_t tc0, int64_t tc1) {
                      run(t, tr, tc0, tc1, s);
                    });
  });
}

template <typename src_t, typename param_t>
void quantize_cpu(uint8_t* packed, const src_t* src, const int64_t* table, int64_t n_rows) {
  const cpu::RowKernels& k = cpu::row_kernels();
  for_each_run(table, n_rows, [&](const int64_t* t, int64_t tr, int64_t tc0, int64_t tc1,
                                  Scratch& s) {
    quantize_run<src_t, param_t>(k, packed, src, t, tr, tc0, tc1, s);
  });
}

template <typename param_t>
void dequantize_run(const cpu::RowKernels& k, param_t* dst, const uint8_t* packed,
                    const int64_t* t, int64_t tr, int64_t tc0, int64_t tc1, Scratch& s) {
  const Run b = run_of(t, tr, tc0, tc1);
  const int64_t f = t[kFormat], cols = t[kCols], w = b.width(), tiles = tc1 - tc0;
  param_t* out = dst + t[kElemOff];
  if (f == kRaw) {
    std::memcpy(out + b.c0, packed + t[kDataOff] + b.c0 * sizeof(param_t), w * sizeof(param_t));
    return;
  }
  const int64_t per_row = ceil_div(cols, t[kTileCols]), sb = tile_scale_bytes(f);
  s.factor.resize(tiles);
  for (int64_t j = 0; j < tiles; ++j)
    s.factor[j] = stored_scale_inv(f, packed + t[kScaleOff] + (tr * per_row + tc0 + j) * sb);
  const uint8_t* data = packed + t[kDataOff];
  for (int64_t r = b.r0; r < b.r1; ++r) {
    const uint8_t* q = data + r * cols + b.c0;
    param_t* y = out + r * cols + b.c0;
    uint16_t* y16 = reinterpret_cast<uint16_t*>(y);
    const float* inv = s.factor.data();
    if constexpr (std::is_same_v<param_t, float>) k.dequantize_f32(y, q, w, t[kTileCols], inv);
    if constexpr (std::is_same_v<param_t, at::BFloat16>)
      k.dequantize_bf16(y16, q, w, t[kTileCols], inv);
    if constexpr (std::is_same_v<param_t, at::Half>) k.dequantize_f16(y16, q, w, t[kTileCols], inv);
  }
}

template <typename param_t>
void dequantize_cpu(param_t* dst, const uint8_t* packed, const int64_t* table, int64_t n_rows) {
  const cpu::RowKernels& k = cpu::row_kernels();
  for_each_run(table, n_rows, [&](const int64_t* t, int64_t tr, int64_t tc0, int64_t tc1,
                                  Scratch& s) {
    dequantize_run<param_t>(k, dst, packed, t, tr, tc0, tc1, s);
  });
}

void quantize_op(at::Tensor packed, const at::Tensor& src, const at::Tensor& table, int64_t tiles,
                 at::ScalarType param_dtype) {
  check_quantize(packed, src, table, tiles, param_dtype);
  VERAGGED_DISPATCH_QUANT(src.scalar_type(), "quantize_tiles_", [&] {
    using src_t = scalar_t;
    VERAGGED_DISPATCH_QUANT(param_dtype, "quantize_tiles_", [&] {
      quantize_cpu<src_t, scalar_t>(packed.data_ptr<uint8_t>(), src.data_ptr<src_t>(),
                                    table.data_ptr<int64_t>(), table.size(0));
    });
  });
}

void dequantize_op(at::Tensor dst, const at::Tensor& packed, const at::Tensor& table, int64_t tiles) {
  check_dequantize(dst, packed, table, tiles);
  VERAGGED_DISPATCH_QUANT(dst.scalar_type(), "dequantize_tiles_", [&] {
    dequantize_cpu<scalar_t>(dst.data_ptr<scalar_t>(), packed.data_ptr<uint8_t>(),
                             table.data_ptr<int64_t>(), table.size(0));
  });
}

#ifdef VERAGGED_WITH_CUDA
void quantize_op_cuda(at::Tensor packed, const at::Tensor& src, const at::Tensor& table,
                      int64_t tiles, at::ScalarType param_dtype) {
  check_quantize(packed, src, table, tiles, param_dtype);
  quantize_tiles_cuda(packed, src, table, tiles, param_dtype);
}

void dequantize_op_cuda(at::Tensor dst, const at::Tensor& packed, const at::Tensor& table,
                        int64_t tiles) {
  check_dequantize(dst, packed, table, tiles);
  dequantize_tiles_cuda(dst, packed, table, tiles);
}
#endif

}  // namespace

namespace {

// The checks both ops make of their flat tensor (`name`) and packed buffer, then of the table.
void check_operands(const char* op, const char* name, const at::Tensor& flat,
                    const at::Tensor& packed, const at::Tensor& table, int64_t tiles,
                    int64_t raw_itemsize) {
  TORCH_CHECK_VALUE(packed.scalar_type() == at::kByte && packed.is_contiguous(), op,
                    ": packed must be a contiguous uint8 tensor, got ", packed.scalar_type());
  TORCH_CHECK_VALUE(float_dtype(flat.scalar_type()) && flat.is_contiguous(), op, ": ", name,
                    " must be a contiguous float32, bfloat16 or float16 tensor, got ",
                    flat.scalar_type());
  TORCH_CHECK_VALUE(packed.device() == flat.device() && table.device() == flat.device(), op,
                    ": ", name, ", packed and table must be on one device, got ",
                    flat.device(), ", ", packed.device(), ", ", table.device());
  check_table(table, flat.numel(), packed.numel(), tiles, raw_itemsize, op);
}

}  // namespace

void check_quantize(const at::Tensor& packed, const at::Tensor& src, const at::Tensor& table,
                    int64_t tiles, at::ScalarType param_dtype) {
  TORCH_CHECK_VALUE(float_dtype(param_dtype), "quantize_tiles_: param_dtype must be float32, "
                    "bfloat16 or float16, got ", param_dtype);
  check_operands("quantize_tiles_", "src", src, packed, table, tiles,
                 c10::elementSize(param_dtype));
}

void check_dequantize(const at::Tensor& dst, const at::Tensor& packed, const at::Tensor& table,
                      int64_t tiles) {
  check_operands("dequantize_tiles_", "dst", dst, packed, table, tiles, dst.element_size());
}

void check_tile_table_op(const at::Tensor& table, int64_t numel, int64_t bytes, int64_t tiles,
                         int64_t raw_itemsize) {
  TORCH_CHECK_VALUE(table.device().is_cpu(), "check_tile_table: table must be on the CPU");
  TORCH_CHECK_VALUE(raw_itemsize >= 1, "check_tile_table: raw_itemsize must be >= 1");
  check_table(table, numel, bytes, tiles, raw_itemsize, "check_tile_table");
}

TORCH_LIBRARY_IMPL(veragged, CPU, m) {
  m.impl("check_tile_table", &check_tile_table_op);
  m.impl("quantize_tiles_", &quantize_op);
  m.impl("dequantize_tiles_", &dequantize_op);
}

#ifdef VERAGGED_WITH_CUDA
TORCH_LIBRARY_IMPL(veragged, CUDA, m) {
  m.impl("quantize_tiles_", &quantize_op_cuda);
  m.impl("dequantize_tiles_", &dequantize_op_cuda);
}
#endif

}  // namespace quant
}  // namespace veragged
