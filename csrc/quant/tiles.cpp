// CPU kernels of the block-scaled tile ops (see tiles.h and [Note: block-scaled rules] in
// rules.h): one task per tile, in parallel; every tile reads its own elements only, so the
// result does not depend on the thread count or on which rank quantises the tile.

#include "quant/tiles.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>

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

// Calls body(row pointer, tile index within the row) for tiles [begin, end) of the table.
template <typename Body>
void for_tiles(const int64_t* table, int64_t n_rows, int64_t begin, int64_t end, Body body) {
  for (int64_t row = table_row(table, n_rows, begin), k = begin; k < end; ++row) {
    const int64_t* t = table + row * kTableCols;
    const int64_t n = ceil_div(t[kRows], t[kTileRows]) * ceil_div(t[kCols], t[kTileCols]);
    for (int64_t j = k - t[kFirstTile]; j < n && k < end; ++j, ++k) body(t, j);
  }
}

template <typename src_t, typename param_t>
void quantize_cpu(uint8_t* packed, const src_t* src, const int64_t* table, int64_t n_rows,
                  int64_t tiles) {
  auto x_at = [&](const int64_t* t, int64_t r, int64_t c) {
    return static_cast<float>(static_cast<param_t>(src[t[kElemOff] + r * t[kCols] + c]));
  };
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for_tiles(table, n_rows, begin, end, [&](const int64_t* t, int64_t k) {
      const TileBox b = tile_box(t, k);
      const int64_t f = t[kFormat];
      if (f == kRaw) {
        param_t* out = reinterpret_cast<param_t*>(packed + t[kDataOff]);
        for (int64_t c = b.c0; c < b.c1; ++c) out[c] = static_cast<param_t>(src[t[kElemOff] + c]);
        return;
      }
      float amax = 0.0f;
      for (int64_t r = b.r0; r < b.r1; ++r)
        for (int64_t c = b.c0; c < b.c1; ++c) amax = abs_max(amax, x_at(t, r, c));
      const TileScale s = tile_scale(f, amax);
      store_scale(f, packed + t[kScaleOff] + k * tile_scale_bytes(f), s.stored);
      uint8_t* data = packed + t[kDataOff];
      for (int64_t r = b.r0; r < b.r1; ++r)
        for (int64_t c = b.c0; c < b.c1; ++c)
          data[r * t[kCols] + c] = quantize_value(x_at(t, r, c), s.mul);
    });
  });
}

template <typename param_t>
void dequantize_cpu(param_t* dst, const uint8_t* packed, const int64_t* table, int64_t n_rows,
                    int64_t tiles) {
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for_tiles(table, n_rows, begin, end, [&](const int64_t* t, int64_t k) {
      const TileBox b = tile_box(t, k);
      const int64_t f = t[kFormat];
      param_t* out = dst + t[kElemOff];
      if (f == kRaw) {
        std::memcpy(out + b.c0, packed + t[kDataOff] + b.c0 * sizeof(param_t),
                    (b.c1 - b.c0) * sizeof(param_t));
        return;
      }
      const float inv = stored_scale_inv(f, packed + t[kScaleOff] + k * tile_scale_bytes(f));
      const uint8_t* data = packed + t[kDataOff];
      for (int64_t r = b.r0; r < b.r1; ++r)
        for (int64_t c = b.c0; c < b.c1; ++c)
          out[r * t[kCols] + c] = static_cast<param_t>(dequantize_value(data[r * t[kCols] + c], inv));
    });
  });
}

void quantize_op(at::Tensor packed, const at::Tensor& src, const at::Tensor& table, int64_t tiles,
                 at::ScalarType param_dtype) {
  check_quantize(packed, src, table, tiles, param_dtype);
  VERAGGED_DISPATCH_QUANT(src.scalar_type(), "quantize_tiles_", [&] {
    using src_t = scalar_t;
    VERAGGED_DISPATCH_QUANT(param_dtype, "quantize_tiles_", [&] {
      quantize_cpu<src_t, scalar_t>(packed.data_ptr<uint8_t>(), src.data_ptr<src_t>(),
                                    table.data_ptr<int64_t>(), table.size(0), tiles);
    });
  });
}

void dequantize_op(at::Tensor dst, const at::Tensor& packed, const at::Tensor& table, int64_t tiles) {
  check_dequantize(dst, packed, table, tiles);
  VERAGGED_DISPATCH_QUANT(dst.scalar_type(), "dequantize_tiles_", [&] {
    dequantize_cpu<scalar_t>(dst.data_ptr<scalar_t>(), packed.data_ptr<uint8_t>(),
                             table.data_ptr<int64_t>(), table.size(0), tiles);
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
