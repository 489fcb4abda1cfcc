// Exact placement of small groups: the best tensor order for one shard size, by dynamic
// programming over the multisets of placed tensors ([Note: exact placement] in exact.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "planner/greedy.h"
#include "planner/planner.h"

namespace veragged {
namespace planner {

class ExactPlacer {
 public:
  // `states()` is 0 when the group has more than `max_states` count vectors (then place()
  // must not be called). `classes` must outlive the placer.
  ExactPlacer(const FillClasses& classes, int64_t max_states);

  int64_t states() const { return states_; }

  // The earliest end of the group over every order at this shard size, or kNever if it passes
  // `limit`. Writes the order reaching it (indices into the given order; members of a class in
  // ascending index) and the starts in that order when non-null.
  int64_t place(int64_t shard, int64_t limit, std::vector<int64_t>* order,
                std::vector<int64_t>* starts) const;

 private:
  const FillClasses& classes_;
  std::vector<int64_t> stride_;  // state index = sum over classes of count * stride
  int64_t states_ = 0;
  int64_t total_ = 0;
  mutable std::vector<int64_t> end_;     // per state: earliest end, or kNever
  mutable std::vector<uint8_t> last_;    // per state: the class placed last on the way there
};

}  // namespace planner
}  // namespace veragged
