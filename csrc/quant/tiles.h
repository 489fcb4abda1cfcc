// The block-scaled tile kernels' shared declarations: the segment table the ops take and the
// checks both backends run ([Note: block-scaled weights], veragged/quant/__init__.py).
//
// A table is an int64 tensor [n, kTableCols], one row per Segment (layout.h) without its rank:
//   (format, elem_off, rows, cols, tile_rows, tile_cols, data_off, scale_off, first_tile)
// first_tile is the number of tiles of the rows before it, so a tile index finds its row by a
// binary search; `tiles` (the ops' int) is the total. elem_off counts elements of the op's
// flat tensor (the rank's shard for quantize_tiles_, the unsharded buffer for
// dequantize_tiles_) and the byte offsets count bytes of its packed tensor.
//   quantize_tiles_(packed, src, table, tiles, param_dtype): every tile of every row of the
//     table quantised from src (rounded to param_dtype first) into packed; kRaw rows written
//     as param_dtype bytes.
//   dequantize_tiles_(dst, packed, table, tiles): the inverse into dst (param dtype); kRaw rows
//     copied.
// Checks: the CPU ops check every row against the tensors (ValueError naming the row). The CUDA
// ops check dtypes, devices and the table's shape only: reading a device table's rows would
// synchronise the host with the stream inside a step. veragged makes each device table once,
// from a host table checked by `check_tile_table(table, numel, bytes, tiles, raw_itemsize)`, the
// CPU ops' row checks as an op of its own (veragged/quant/layout.py).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/macros/Macros.h>

#include <cstdint>

namespace veragged {
namespace quant {

// The dtypes the tile ops read and write: float32, bfloat16, float16.
#define VERAGGED_DISPATCH_QUANT(TYPE, NAME, ...)                         \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)      \
                             AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

constexpr int64_t kTableCols = 9;
enum Col : int64_t {
  kFormat = 0, kElemOff, kRows, kCols, kTileRows, kTileCols, kDataOff, kScaleOff, kFirstTile
};

// One tile's element range in its table row: rows [r0, r1) x columns [c0, c1).
struct TileBox {
  int64_t r0, r1, c0, c1;
};

// The table row holding tile `tile`: the last row whose first_tile <= tile.
C10_HOST_DEVICE inline int64_t table_row(const int64_t* table, int64_t n_rows, int64_t tile) {
  int64_t lo = 0, hi = n_rows - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (table[mid * kTableCols + kFirstTile] <= tile) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Tile `k` (row-major over tile-rows x tile-cols) of table row `t`.
C10_HOST_DEVICE inline TileBox tile_box(const int64_t* t, int64_t k) {
  const int64_t per_row = (t[kCols] + t[kTileCols] - 1) / t[kTileCols];
  const int64_t tr = k / per_row, tc = k % per_row;
  const int64_t r1 = (tr + 1) * t[kTileRows] < t[kRows] ? (tr + 1) * t[kTileRows] : t[kRows];
  const int64_t c1 = (tc + 1) * t[kTileCols] < t[kCols] ? (tc + 1) * t[kTileCols] : t[kCols];
  return {tr * t[kTileRows], r1, tc * t[kTileCols], c1};
}

// Checks shared by the CPU and CUDA ops (and mirrored by the fake kernels).
void check_quantize(const at::Tensor& packed, const at::Tensor& src, const at::Tensor& table,
                    int64_t tiles, at::ScalarType param_dtype);
void check_dequantize(const at::Tensor& dst, const at::Tensor& packed, const at::Tensor& table,
                      int64_t tiles);

#ifdef VERAGGED_WITH_CUDA
void quantize_tiles_cuda(at::Tensor& packed, const at::Tensor& src, const at::Tensor& table,
                         int64_t tiles, at::ScalarType param_dtype);
void dequantize_tiles_cuda(at::Tensor& dst, const at::Tensor& packed, const at::Tensor& table,
                           int64_t tiles);
#endif

}  // namespace quant
}  // namespace veragged
