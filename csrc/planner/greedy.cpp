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

#include <algorithm>
#include <cstddef>
#include <functional>
#include <unordered_map>
#include <utility>

namespace veragged {
namespace planner {

namespace {

constexpr int64_t kMaxScoredPadding = int64_t{1} << 61;

}  // namespace

int64_t place_greedy(const std::vector<Item>& items, int64_t shard, int64_t limit,
                     std::vector<int64_t>* starts) {
  int64_t unplaced = 0;  // numel still to place: a start past limit - unplaced cannot fit
  for (const Item& item : items) unplaced += item.numel;
  int64_t pos = 0;
  int64_t offset = 0;  // pos % shard
  int64_t last_block = 0;  // shard % block for the last block size seen (orders run in blocks)
  bool aligned = false;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const Item& item = items[i];
    if (item.block != last_block) {
      last_block = item.block;
      aligned = shard % item.block == 0;
    }
    const int64_t gap = gap_before(offset, item.numel, item.block, shard, aligned);
    if (gap == kNever || pos + gap > limit - unplaced) return kNever;
    unplaced -= item.numel;
    if (starts != nullptr) (*starts)[i] = pos + gap;
    pos += gap + item.numel;
    offset = advance_offset(offset, gap + item.numel, shard);
  }
  return pos;
}

FillClasses make_fill_classes(const std::vector<Item>& items) {
  FillClasses classes;
  struct KeyHash {
    std::size_t operator()(const std::pair<int64_t, int64_t>& key) const {
      return std::hash<int64_t>()(key.first) * 0x9e3779b97f4a7c15ULL ^
             std::hash<int64_t>()(key.second);
    }
  };
  std::unordered_map<std::pair<int64_t, int64_t>, std::size_t, KeyHash> index;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const auto key = std::make_pair(items[i].numel, items[i].block);
    auto found = index.find(key);
    if (found == index.end()) {
      found = index.emplace(key, classes.kinds.size()).first;
      classes.kinds.push_back(items[i]);
      classes.members.emplace_back();
    }
    classes.members[found->second].push_back(static_cast<int64_t>(i));
    if (items[i].block == 1) classes.elementwise.push_back(static_cast<int64_t>(i));
  }
  for (std::size_t c = 0; c < classes.kinds.size(); ++c) {
    if (classes.kinds[c].block != 1) classes.blocked.push_back(c);
  }
  return classes;
}

// [Note: fill rules]
// place_filling picks the next tensor by a score over the classes that can still be placed:
//   kLeastPadding  score = padding before it                      (the fill order)
//   kLargeBlocks   score = padding before it - block / 2          (the fill_large order)
// lowest score first; on ties the larger block, then the lower given index. The least-padding
// rule is myopic where a few block sizes share a group: in DeepSeek-V3's MoE layers at 128-row
// blocks the 2-row-block down projections start at padding 0 almost everywhere, so that rule
// spends them all first and leaves the 7-row-block gate and up projections to pad at every rank
// boundary (6.1% at 1024 ranks). Letting a tensor take up to half of its block in padding ahead
// of smaller-block tensors keeps the flexible ones for where they fill a gap (2.6% there, the
// optimum of the exact search over orders on that shard-size grid). Neither rule dominates the
// other, so the planner tries both.
int64_t place_filling(const FillClasses& classes, const std::vector<Item>& items, FillRule rule,
                      int64_t shard, int64_t limit, std::vector<int64_t>* order,
                      std::vector<int64_t>* starts) {
  const std::size_t n_classes = classes.kinds.size();
  std::vector<std::size_t> next(n_classes, 0);  // first unplaced member of each class
  std::size_t next_elementwise = 0;             // first unplaced element-wise tensor
  int64_t unplaced = 0;  // as in place_greedy
  for (const Item& item : items) unplaced += item.numel;
  const bool large_blocks = rule == FillRule::kLargeBlocks;
  // Twice the score of [Note: fill rules], in integers. On equal scores, larger blocks go first:
  // they are the hard ones to place, while small-block tensors are kept back to fill the gaps
  // the large ones leave before rank boundaries. Element-wise tensors start where they are
  // (gap 0) and rank below every larger block on ties, so only the lowest-index one competes.
  auto score = [&](int64_t block, int64_t gap) {
    // Clamped below any overflow: a gap that large cannot fit in the buffer anyway.
    return 2 * std::min(gap, kMaxScoredPadding) - (large_blocks ? block : 0);
  };
  std::vector<char> aligned(n_classes);  // shard % block == 0, once per class
  for (std::size_t c : classes.blocked) aligned[c] = shard % classes.kinds[c].block == 0;
  constexpr std::size_t kElementwise = static_cast<std::size_t>(-1);
  int64_t pos = 0;
  int64_t offset = 0;  // pos % shard
  for (std::size_t placed = 0; placed < items.size(); ++placed) {
    std::size_t chosen = n_classes;  // a class, kElementwise, or none
    int64_t chosen_gap = kNever;
    int64_t chosen_score = 0;
    if (next_elementwise < classes.elementwise.size()) {
      chosen = kElementwise;
      chosen_gap = 0;
      chosen_score = score(1, 0);
    }
    for (std::size_t c : classes.blocked) {
      if (next[c] == classes.members[c].size()) continue;
      const Item& kind = classes.kinds[c];
      const int64_t gap = gap_before(offset, kind.numel, kind.block, shard, aligned[c]);
      if (gap == kNever) continue;
      const int64_t s = score(kind.block, gap);
      bool better;
      if (chosen == n_classes || s != chosen_score) {
        better = chosen == n_classes || s < chosen_score;
      } else if (chosen == kElementwise) {
        better = true;  // a block > 1 beats an element-wise tensor on equal scores
      } else {
        const Item& other = classes.kinds[chosen];
        better = kind.block != other.block
                     ? kind.block > other.block
                     : classes.members[c][next[c]] < classes.members[chosen][next[chosen]];
      }
      if (better) {
        chosen = c;
        chosen_gap = gap;
        chosen_score = s;
      }
    }
    if (chosen == n_classes || pos + chosen_gap > limit - unplaced) return kNever;
    const int64_t index = chosen == kElementwise ? classes.elementwise[next_elementwise++]
                                                 : classes.members[chosen][next[chosen]++];
    const int64_t numel = items[static_cast<std::size_t>(index)].numel;
    unplaced -= numel;
    if (order != nullptr) (*order)[placed] = index;
    if (starts != nullptr) (*starts)[placed] = pos + chosen_gap;
    pos += chosen_gap + numel;
    offset = advance_offset(offset, chosen_gap + numel, shard);
  }
  return pos;
}

}  // namespace planner
}  // namespace veragged
