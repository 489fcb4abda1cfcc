// Greedy placement of an ordered tensor list for one candidate shard size (CheckValidShard).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace veragged {
namespace planner {

// One tensor as the search sees it.
struct Item {
  int64_t numel;
  int64_t block;
};

// Returned by earliest_start when no offset in any shard works for the tensor.
constexpr int64_t kNever = -1;

namespace detail {

// Largest distance d' <= d to a boundary at which the tensor may cross it, or 0 if none.
inline int64_t crossing_distance(int64_t d, int64_t numel, int64_t block, int64_t shard,
                                 bool shard_is_aligned) {
  const int64_t aligned = d / block * block;
  if (aligned == 0) return 0;
  if (!shard_is_aligned && aligned + shard < numel) return 0;  // would cross a second boundary
  return aligned;
}

}  // namespace detail

// Distance from a position `offset` elements into its shard (offset < shard) to the earliest
// start at which a tensor of `numel` elements with blocks of `block` elements lies in shards of
// `shard` elements with no block cut by a boundary; kNever if there is none. `aligned` says
// whether shard % block == 0 (then the tensor may contain whole shards). O(1), and no division
// unless the tensor reaches past the current shard.
inline int64_t gap_before(int64_t offset, int64_t numel, int64_t block, int64_t shard,
                          bool aligned) {
  if (block == 1) return 0;  // no boundary can cut a 1-element block
  const int64_t to_boundary = shard - offset;  // in (0, shard]
  if (numel <= to_boundary) return 0;
  // Later in the current shard: the largest allowed crossing distance gives the earliest start.
  const int64_t here = detail::crossing_distance(to_boundary, numel, block, shard, aligned);
  if (here != 0) return to_boundary - here;
  // The next shard: its start, or its largest allowed crossing distance.
  if (numel <= shard) return to_boundary;
  const int64_t there = detail::crossing_distance(shard, numel, block, shard, aligned);
  if (there != 0) return to_boundary + (shard - there);
  return kNever;
}

// Earliest start >= pos for such a tensor (gap_before from pos), or kNever.
inline int64_t earliest_start(int64_t pos, int64_t numel, int64_t block, int64_t shard) {
  if (block == 1) return pos;
  const int64_t gap = gap_before(pos % shard, numel, block, shard, shard % block == 0);
  return gap == kNever ? kNever : pos + gap;
}

// (offset + by) % shard for 0 <= offset < shard, dividing only when `by` spans a shard.
inline int64_t advance_offset(int64_t offset, int64_t by, int64_t shard) {
  if (by < shard - offset) return offset + by;
  const int64_t rest = by - (shard - offset);  // from the next boundary
  return rest < shard ? rest : rest % shard;
}

// Places `items` in order, each at its earliest start after the previous one ends, and returns
// the end of the last one, or kNever once a tensor cannot be placed or the end passes `limit`.
// Writes each item's start into `starts` when it is non-null.
int64_t place_greedy(const std::vector<Item>& items, int64_t shard, int64_t limit,
                     std::vector<int64_t>* starts);

// Tensors of equal (numel, block), for the fill order: `kinds[c]` is the shared shape of class c
// and `members[c]` its tensors' indices in the given order, ascending.
struct FillClasses {
  std::vector<Item> kinds;
  std::vector<std::vector<int64_t>> members;
  // For place_filling: the classes with blocks > 1, and the element-wise tensors (block 1) in
  // ascending index, which the fill orders take in that order whatever their numel.
  std::vector<std::size_t> blocked;
  std::vector<int64_t> elementwise;
};

FillClasses make_fill_classes(const std::vector<Item>& items);

// How place_filling weighs a larger block against padding.
enum class FillRule {
  kLeastPadding,  // the tensor that starts earliest; larger block, then lower index, on ties
  kLargeBlocks,   // as if each tensor's padding were half a block smaller: see [Note: fill rules]
};

// Like place_greedy, but the order is chosen while placing: next comes the class that `rule`
// ranks first. `classes` is make_fill_classes(items). O(n * classes with blocks > 1). Writes
// the chosen order (indices into the given order) and starts (in that chosen order) when
// non-null.
int64_t place_filling(const FillClasses& classes, const std::vector<Item>& items, FillRule rule,
                      int64_t shard, int64_t limit, std::vector<int64_t>* order,
                      std::vector<int64_t>* starts);

}  // namespace planner
}  // namespace veragged
