// The packed all-gather slot of a block-scaled DBuffer: where each rank's 8-bit tiles, scales and
// raw (unquantised) elements go ([Note: block-scaled weights] in veragged/quant/__init__.py).
//
// Pure C++17: no torch headers, so the same code builds into veragged._C and into the GoogleTest
// binary under tests/cpp.
#pragma once

#include <cstdint>
#include <vector>

namespace veragged {
namespace quant {

// Formats, as the ints the ops take. kRaw: the tensor travels unquantised, in the param dtype.
enum Format : int64_t {
  kRaw = 0,
  kFp32Scale = 1,  // E4M3, one fp32 scale_inv per tile (DeepSeek-V3's weights)
  kUe8m0 = 2,      // E4M3, one power-of-two scale per tile in one byte (DeepSeek-V3.1 ue8m0)
  kMxFloor = 3,    // MXFP8: E4M3, E8M0 scale, FLOOR rounding of the exponent
  kMxRceil = 4,    // MXFP8: E4M3, E8M0 scale, RCEIL rounding
};
constexpr int64_t kNumFormats = 5;

// Bytes of one tile's scale in the packed slot (0 for kRaw).
int64_t scale_bytes(int64_t format);

// One tensor of the group, in the global buffer of world * shard_size elements. A quantised
// tensor is `numel / (rows * cols)` matrices of `rows x cols` (its shape's last two dims; a 1-D
// tensor is one row), each tiled from its first row and column by `tile_rows x tile_cols` tiles,
// the last ones partial.
struct TensorSpec {
  int64_t start = 0;  // first element in the global buffer
  int64_t numel = 0;
  int64_t rows = 1;  // rows of one matrix
  int64_t cols = 1;
  int64_t format = kRaw;
  int64_t tile_rows = 1;
  int64_t tile_cols = 1;
  int64_t raw_itemsize = 0;  // bytes per element of a kRaw tensor in the packed slot
};

// A run of one tensor's elements on one rank that the kernels treat as one matrix: `rows x cols`
// row-major elements starting `elem_off` elements into the rank's shard, starting on a tile-row
// boundary of its matrix and ending on one or at the matrix's end. Its `ceil(rows / tile_rows) *
// ceil(cols / tile_cols)` scales are row-major at `scale_off`, its data (one byte per element, or
// `raw_itemsize` for kRaw, where rows = 1, cols = the element count and tile_cols = kRawChunk) at
// `data_off`; both offsets
// are bytes from the start of the rank's packed slot.
struct Segment {
  int64_t rank = 0;
  int64_t format = kRaw;
  int64_t elem_off = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t tile_rows = 1;
  int64_t tile_cols = 1;
  int64_t data_off = 0;
  int64_t scale_off = 0;
};
constexpr int kSegmentInts = 9;

struct PackedLayout {
  int64_t slot_bytes = 0;            // bytes of every rank's slot (the largest rank's, aligned)
  std::vector<Segment> segments;     // rank-major, each rank's in buffer order
  std::vector<int64_t> rank_bytes;   // bytes each rank's segments use (before the alignment)
};

// Each piece starts at a multiple of kPieceAlign bytes in the slot.
constexpr int64_t kPieceAlign = 16;
// A kRaw segment is split into "tiles" of this many elements (units of kernel work, no scale).
constexpr int64_t kRawChunk = 4096;

// The packed layout for `tensors` planned into `world` slots of `shard_size` elements. Every
// rank's part of a quantised tensor must be whole tile-rows of whole matrices (ending at the
// tensor's end is allowed), which the planner guarantees when given the tile-row granularity;
// std::invalid_argument otherwise, naming the tensor, the rank and the elements.
PackedLayout pack_layout(const std::vector<TensorSpec>& tensors, int64_t shard_size,
                         int64_t world, int64_t align_bytes);

}  // namespace quant
}  // namespace veragged
