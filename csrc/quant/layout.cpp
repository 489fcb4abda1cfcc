// pack_layout(): see layout.h.
#include "quant/layout.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

namespace veragged {
namespace quant {
namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

void check_spec(const TensorSpec& t, std::size_t i) {
  const std::string at = "tensor " + std::to_string(i) + ": ";
  if (t.format < 0 || t.format >= kNumFormats) {
    throw std::invalid_argument(at + "format " + std::to_string(t.format) + " is not one of 0-4");
  }
  if (t.numel < 0 || t.start < 0) throw std::invalid_argument(at + "negative start or numel");
  if (t.format == kRaw) {
    if (t.raw_itemsize < 1) throw std::invalid_argument(at + "raw_itemsize must be >= 1");
    return;
  }
  if (t.rows < 1 || t.cols < 1 || t.tile_rows < 1 || t.tile_cols < 1) {
    throw std::invalid_argument(at + "rows, cols and the tile shape must be >= 1");
  }
  if (t.numel % (t.rows * t.cols) != 0) {
    throw std::invalid_argument(at + "numel " + std::to_string(t.numel) + " is not a multiple of rows * cols = " +
                                std::to_string(t.rows * t.cols));
  }
}

// Whether local row `r` of a matrix of `rows` rows is where a tile-row starts (or the end).
bool tile_row_boundary(int64_t r, const TensorSpec& t) {
  const int64_t in_matrix = r % t.rows;
  return in_matrix % t.tile_rows == 0;
}

}  // namespace

int64_t scale_bytes(int64_t format) {
  switch (format) {
    case kRaw:
      return 0;
    case kFp32Scale:
      return 4;
    default:
      return 1;
  }
}

PackedLayout pack_layout(const std::vector<TensorSpec>& tensors, int64_t shard_size,
                         int64_t world, int64_t align_bytes) {
  if (shard_size < 0 || world < 1 || align_bytes < 1) {
    throw std::invalid_argument("pack_layout: shard_size >= 0, world >= 1, align_bytes >= 1");
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) check_spec(tensors[i], i);
  std::vector<std::size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return tensors[a].start < tensors[b].start; });
  PackedLayout out;
  out.rank_bytes.assign(world, 0);
  for (int64_t r = 0; r < world; ++r) {
    const int64_t lo = r * shard_size, hi = lo + shard_size;
    int64_t cur = 0;
    for (std::size_t i : order) {
      const TensorSpec& t = tensors[i];
      const int64_t a = std::max(t.start, lo), b = std::min(t.start + t.numel, hi);
      if (a >= b) continue;
      Segment s;
      s.rank = r;
      s.format = t.format;
      if (t.format == kRaw) {
        s.elem_off = a - lo;
        s.rows = 1;
        s.cols = b - a;
        s.tile_cols = kRawChunk;
        s.data_off = round_up(cur, kPieceAlign);
        s.scale_off = s.data_off;
        cur = s.data_off + (b - a) * t.raw_itemsize;
        out.segments.push_back(s);
        continue;
      }
      // Whole tile-rows: the part must start and end on row boundaries that start tile-rows.
      const int64_t first = a - t.start, last = b - t.start;
      const bool starts = first % t.cols == 0 && tile_row_boundary(first / t.cols, t);
      const bool ends = last == t.numel || (last % t.cols == 0 && tile_row_boundary(last / t.cols, t));
      if (!starts || !ends) {
        throw std::invalid_argument(
            "tensor " + std::to_string(i) + ": rank " + std::to_string(r) + " holds elements [" +
            std::to_string(first) + ", " + std::to_string(last) + ") of it, not whole tile-rows of " +
            std::to_string(t.tile_rows) + " rows x " + std::to_string(t.cols) +
            " columns (plan it with the tile-row granularity)");
      }
      int64_t row = first / t.cols;
      const int64_t row_end = (last + t.cols - 1) / t.cols;
      while (row < row_end) {
        const int64_t matrix_end = (row / t.rows + 1) * t.rows;
        const int64_t n = std::min(row_end, matrix_end) - row;
        s.elem_off = t.start + row * t.cols - lo;
        s.rows = n;
        s.cols = t.cols;
        s.tile_rows = t.tile_rows;
        s.tile_cols = t.tile_cols;
        s.data_off = round_up(cur, kPieceAlign);
        cur = s.data_off + n * t.cols;
        s.scale_off = round_up(cur, kPieceAlign);
        cur = s.scale_off + ceil_div(n, t.tile_rows) * ceil_div(t.cols, t.tile_cols) * scale_bytes(t.format);
        out.segments.push_back(s);
        row += n;
      }
    }
    out.rank_bytes[r] = cur;
  }
  const int64_t most = *std::max_element(out.rank_bytes.begin(), out.rank_bytes.end());
  out.slot_bytes = round_up(std::max<int64_t>(most, 1), align_bytes);
  return out;
}

}  // namespace quant
}  // namespace veragged
