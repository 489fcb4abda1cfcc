// Greedy placement of an ordered tensor list for one candidate shard size (CheckValidShard).
#pragma once

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

// Earliest start >= pos at which a tensor of `numel` elements with blocks of `block` elements
// lies in shards of `shard` elements with no block cut by a boundary. O(1); kNever if none.
int64_t earliest_start(int64_t pos, int64_t numel, int64_t block, int64_t shard);

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
};

FillClasses make_fill_classes(const std::vector<Item>& items);

// Like place_greedy, but the order is chosen while placing: next comes the class whose tensor
// can start earliest (least padding); on ties the larger block, then the lower given index.
// O(n * classes). Writes the chosen order (indices into the given order) and starts (in that
// chosen order) when non-null.
int64_t place_filling(const FillClasses& classes, int64_t shard, int64_t limit,
                      std::vector<int64_t>* order, std::vector<int64_t>* starts);

}  // namespace planner
}  // namespace veragged
