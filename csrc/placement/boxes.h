// Box and interval math for RaggedShard checkpointing and redistribution.
//
// A RaggedShard rank holds a contiguous range of a tensor's row-major flat elements. Checkpoints
// (DCP) describe data as rectangular boxes of the tensor, and redistribution exchanges flat
// ranges between ranks; these two helpers translate between the views.
//
// Pure C++17: no torch headers, so the same code builds into veragged._C and into the
// GoogleTest binary under tests/cpp.
#pragma once

#include <cstdint>
#include <vector>

namespace veragged {
namespace placement {

// A rectangle of a k-dim tensor: dim d spans [offsets[d], offsets[d] + sizes[d]).
struct Box {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
};

// [Note: flat range boxes]
// Let s[d] = shape[d+1] * ... * shape[k-1] be the row-major stride of dim d (s[k-1] = 1) and
// s[-1] = numel. A box with "range dim" r fixes dims < r to one index, spans [a, b) of dim r and
// spans dims > r fully; its elements are then exactly the flat range [x, y) with x, y multiples
// of s[r] inside one block of s[r-1] elements, so such a box is one contiguous slice of the flat
// range. The range [begin, end) is cut into boxes of this kind in three phases:
//   1. leading pieces, innermost dim first: while the next multiple of s[d-1] above lo is <= end,
//      the piece [lo, round_up(lo, s[d-1])) (range dim d, empty when lo is aligned) brings lo to
//      a multiple of s[d-1]; the first level m where that multiple lies beyond end stops it;
//   2. one middle block [lo, round_down(end, s[m])) with range dim m (m = 0 when phase 1 ran
//      through every level);
//   3. trailing pieces, outermost first: [lo, round_down(end, s[d])) for d = m+1 .. k-1.
// Empty pieces are skipped. Each level d > m gives at most one leading and one trailing piece,
// plus the middle: at most 2 (k - 1 - m) + 1 <= 2k - 1 boxes, in increasing flat order. Every
// piece is the longest box that starts at its lo and stays in the range, which is what makes the
// count the smallest possible for a cover by flat-contiguous boxes (tests/cpp/test_boxes.cpp
// checks it against a dynamic program over all such covers).

// Splits the row-major flat range [begin, end) of a tensor of `shape` into boxes, as above.
// Returns no boxes for an empty range. Throws std::invalid_argument naming the argument and its
// value for: an empty shape, a negative dim, a numel that overflows int64, begin < 0,
// end > numel, or begin > end.
std::vector<Box> flat_range_boxes(const std::vector<int64_t>& shape, int64_t begin, int64_t end);

// Rank j holds [src_bounds[j], src_bounds[j+1]) of a flat range before a redistribution and
// [dst_bounds[j], dst_bounds[j+1]) after it (P ranks, P + 1 bounds each). Fills, sized P:
//   send[j] = overlap of [src[rank], src[rank+1]) and [dst[j], dst[j+1]): what `rank` sends j;
//   recv[j] = overlap of [src[j], src[j+1]) and [dst[rank], dst[rank+1]): what it receives.
// Throws std::invalid_argument naming the value when the bounds differ in length or have fewer
// than 2 entries, do not start at 0, decrease, or end at different totals, or rank is not in
// [0, P).
void interval_overlaps(const std::vector<int64_t>& src_bounds,
                       const std::vector<int64_t>& dst_bounds, int64_t rank,
                       std::vector<int64_t>& send, std::vector<int64_t>& recv);

}  // namespace placement
}  // namespace veragged
