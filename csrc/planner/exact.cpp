// ExactPlacer: the best order of a small group at one shard size.
//
// [Note: exact placement]
// For one shard size S, placing tensor c at the earliest start after position p ends at
// place(p, c) = earliest_start(p, c) + numel(c), which never decreases as p grows
// ([Note: greedy is the DP with segments collapsed]). So for a multiset M of tensors the
// earliest end over all orders of M is
//   end(M) = min over the classes c present in M of place(end(M - c), c):
// any order of M ends with some c, and its prefix, an order of M - c, ends no earlier than
// end(M - c). Tensors of equal (numel, block) are interchangeable, so the multisets are the
// count vectors, prod(count_c + 1) of them, visited in increasing mixed-radix index so that
// M - c comes before M. One pass costs O(states * classes) and decides whether any of the n!
// orders fits at S. Ties keep the first class in class order (classes in first-appearance order
// of the given tensors), so the result is deterministic.

#include "planner/exact.h"

#include <algorithm>
#include <cstddef>

namespace veragged {
namespace planner {

ExactPlacer::ExactPlacer(const FillClasses& classes, int64_t max_states) : classes_(classes) {
  const std::size_t n_classes = classes_.kinds.size();
  if (n_classes > 255) return;  // last_ stores a class in one byte
  int64_t states = 1;
  for (std::size_t c = 0; c < n_classes; ++c) {
    const int64_t radix = static_cast<int64_t>(classes_.members[c].size()) + 1;
    if (states > max_states / radix) return;
    stride_.push_back(states);
    states *= radix;
    total_ += classes_.kinds[c].numel * (radix - 1);
  }
  states_ = states;
  end_.resize(static_cast<std::size_t>(states));
  last_.resize(static_cast<std::size_t>(states));
}

int64_t ExactPlacer::place(int64_t shard, int64_t limit, std::vector<int64_t>* order,
                           std::vector<int64_t>* starts) const {
  const std::size_t n_classes = classes_.kinds.size();
  std::fill(end_.begin(), end_.end(), kNever);
  end_[0] = 0;
  std::vector<int64_t> count(n_classes, 0);  // the count vector of state s (an odometer)
  int64_t placed_numel = 0;
  for (int64_t s = 0; s < states_; ++s) {
    const int64_t pos = end_[s];
    // A state is useful only if what is left can still end by the limit.
    if (pos != kNever && pos <= limit - (total_ - placed_numel)) {
      for (std::size_t c = 0; c < n_classes; ++c) {
        if (count[c] == static_cast<int64_t>(classes_.members[c].size())) continue;
        const Item& kind = classes_.kinds[c];
        const int64_t start = earliest_start(pos, kind.numel, kind.block, shard);
        if (start == kNever) continue;
        int64_t& next = end_[s + stride_[c]];
        if (next == kNever || start + kind.numel < next) {
          next = start + kind.numel;
          last_[s + stride_[c]] = static_cast<uint8_t>(c);
        }
      }
    }
    for (std::size_t c = 0; c < n_classes; ++c) {  // advance the odometer to state s + 1
      if (count[c] < static_cast<int64_t>(classes_.members[c].size())) {
        ++count[c];
        placed_numel += classes_.kinds[c].numel;
        break;
      }
      placed_numel -= classes_.kinds[c].numel * count[c];
      count[c] = 0;
    }
  }
  const int64_t end = end_[states_ - 1];
  if (end == kNever || end > limit) return kNever;
  if (order == nullptr && starts == nullptr) return end;
  // Walk back from the full multiset to recover the order, then replay it for the starts.
  std::vector<std::size_t> reversed;
  for (int64_t s = states_ - 1; s > 0; s -= stride_[last_[s]]) reversed.push_back(last_[s]);
  std::vector<std::size_t> next(n_classes, 0);
  int64_t pos = 0;
  std::size_t i = 0;
  for (auto it = reversed.rbegin(); it != reversed.rend(); ++it, ++i) {
    const Item& kind = classes_.kinds[*it];
    const int64_t start = earliest_start(pos, kind.numel, kind.block, shard);
    if (order != nullptr) (*order)[i] = classes_.members[*it][next[*it]];
    if (starts != nullptr) (*starts)[i] = start;
    ++next[*it];
    pos = start + kind.numel;
  }
  return end;
}

}  // namespace planner
}  // namespace veragged
