// CheckValidShard of Algorithm 1 as a closed-form greedy scan.
//
// [Note: greedy is the DP with segments collapsed]
// The paper's dp(t, i; S) is the fewest shards holding every tensor before t plus the first i
// blocks of t; it is monotone in i, so it is constant on segments, and the paper walks one
// segment per shard a tensor touches. Keeping, instead of a shard count, the earliest buffer
// position at which the placed prefix can end is a finer DP value with the same recurrence, and
// it makes each tensor one O(1) step:
//   * a tensor may start at offset o of a shard iff it fits before the next boundary
//     (numel <= S - o), or the distance d = S - o to that boundary is a multiple of its block and
//     either S is a multiple of the block (every later boundary is then aligned too) or it
//     crosses only that one boundary (d + S >= numel);
//   * that rule depends only on o = pos mod S, so if neither the current shard nor the next one
//     offers an allowed offset, no shard does;
//   * the earliest start is monotone in pos, so placing each tensor as early as possible is
//     optimal for the given order and S (an exchange argument over any valid layout).
// Hence place_greedy(S) succeeds iff some layout with this order and shard size S exists, in
// O(n) for n tensors, instead of O(n * m) for the segment walk over m shards.

#include "planner/greedy.h"

#include <cstddef>
#include <map>
#include <utility>

namespace veragged {
namespace planner {

namespace {

// Largest distance d' <= d to a boundary at which the tensor may cross it, or 0 if none.
int64_t crossing_distance(int64_t d, int64_t numel, int64_t block, int64_t shard,
                          bool shard_is_aligned) {
  const int64_t aligned = d / block * block;
  if (aligned == 0) return 0;
  if (!shard_is_aligned && aligned + shard < numel) return 0;  // would cross a second boundary
  return aligned;
}

}  // namespace

int64_t earliest_start(int64_t pos, int64_t numel, int64_t block, int64_t shard) {
  const int64_t to_boundary = shard - pos % shard;  // in (0, shard]
  if (numel <= to_boundary) return pos;
  const bool shard_is_aligned = shard % block == 0;
  // Later in the current shard: the largest allowed crossing distance gives the earliest start.
  const int64_t here = crossing_distance(to_boundary, numel, block, shard, shard_is_aligned);
  if (here != 0) return pos + (to_boundary - here);
  // The next shard: its start, or its largest allowed crossing distance.
  const int64_t next = pos + to_boundary;
  if (numel <= shard) return next;
  const int64_t there = crossing_distance(shard, numel, block, shard, shard_is_aligned);
  if (there != 0) return next + (shard - there);
  return kNever;
}

int64_t place_greedy(const std::vector<Item>& items, int64_t shard, int64_t limit,
                     std::vector<int64_t>* starts) {
  int64_t unplaced = 0;  // numel still to place: a start past limit - unplaced cannot fit
  for (const Item& item : items) unplaced += item.numel;
  int64_t pos = 0;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const int64_t start = earliest_start(pos, items[i].numel, items[i].block, shard);
    if (start == kNever || start > limit - unplaced) return kNever;
    unplaced -= items[i].numel;
    if (starts != nullptr) (*starts)[i] = start;
    pos = start + items[i].numel;
  }
  return pos;
}

FillClasses make_fill_classes(const std::vector<Item>& items) {
  FillClasses classes;
  std::map<std::pair<int64_t, int64_t>, std::size_t> index;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const auto key = std::make_pair(items[i].numel, items[i].block);
    auto found = index.find(key);
    if (found == index.end()) {
      found = index.emplace(key, classes.kinds.size()).first;
      classes.kinds.push_back(items[i]);
      classes.members.emplace_back();
    }
    classes.members[found->second].push_back(static_cast<int64_t>(i));
  }
  return classes;
}

int64_t place_filling(const FillClasses& classes, int64_t shard, int64_t limit,
                      std::vector<int64_t>* order, std::vector<int64_t>* starts) {
  const std::size_t n_classes = classes.kinds.size();
  std::vector<std::size_t> next(n_classes, 0);  // first unplaced member of each class
  std::size_t remaining = 0;
  int64_t unplaced = 0;  // as in place_greedy
  for (std::size_t c = 0; c < n_classes; ++c) {
    remaining += classes.members[c].size();
    unplaced += classes.kinds[c].numel * static_cast<int64_t>(classes.members[c].size());
  }
  // On equal padding, larger blocks go first: they are the hard ones to place, while small-block
  // tensors are kept back to fill the gaps the large ones leave before rank boundaries.
  auto prefer = [&](std::size_t a, std::size_t b) {
    if (classes.kinds[a].block != classes.kinds[b].block) {
      return classes.kinds[a].block > classes.kinds[b].block;
    }
    return classes.members[a][next[a]] < classes.members[b][next[b]];
  };
  int64_t pos = 0;
  for (std::size_t placed = 0; placed < remaining; ++placed) {
    std::size_t chosen = n_classes;
    int64_t chosen_start = kNever;
    for (std::size_t c = 0; c < n_classes; ++c) {
      if (next[c] == classes.members[c].size()) continue;
      const int64_t start = earliest_start(pos, classes.kinds[c].numel, classes.kinds[c].block, shard);
      if (start == kNever) continue;
      if (chosen == n_classes || start < chosen_start ||
          (start == chosen_start && prefer(c, chosen))) {
        chosen = c;
        chosen_start = start;
      }
    }
    if (chosen == n_classes || chosen_start > limit - unplaced) return kNever;
    unplaced -= classes.kinds[chosen].numel;
    if (order != nullptr) (*order)[placed] = classes.members[chosen][next[chosen]];
    if (starts != nullptr) (*starts)[placed] = chosen_start;
    ++next[chosen];
    pos = chosen_start + classes.kinds[chosen].numel;
  }
  return pos;
}

}  // namespace planner
}  // namespace veragged
