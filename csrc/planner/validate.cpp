// validate() and units_on_rank(): the layout rules of [Note: planner layout contract].

#include <algorithm>
#include <numeric>
#include <string>

#include "planner/planner.h"

namespace veragged {
namespace planner {

namespace {

std::string tensor(size_t t) { return "tensor " + std::to_string(t) + ": "; }

}  // namespace

int64_t units_on_rank(int64_t start, int64_t numel, int64_t block, int64_t shard_size,
                      int64_t rank) {
  if (numel == 0) return 0;
  const int64_t lo = std::max(start, rank * shard_size);
  const int64_t hi = std::min(start + numel, (rank + 1) * shard_size);
  return hi > lo ? (hi - lo) / block : 0;
}

std::string validate(const std::vector<int64_t>& numels, const std::vector<int64_t>& block_sizes,
                     int64_t world_size, int64_t align, const Plan& plan) {
  const size_t n = numels.size();
  if (plan.starts.size() != n) return "starts has " + std::to_string(plan.starts.size()) + " entries";
  const int64_t shard = plan.shard_size;
  const int64_t total = std::accumulate(numels.begin(), numels.end(), int64_t{0});
  if (shard < 0 || shard % align != 0) {
    return "shard_size " + std::to_string(shard) + " is not a multiple of align";
  }
  if (plan.padding != world_size * shard - total) return "padding disagrees with shard_size";
  std::vector<size_t> by_start(n);
  std::iota(by_start.begin(), by_start.end(), size_t{0});
  std::sort(by_start.begin(), by_start.end(), [&](size_t a, size_t b) {
    return plan.starts[a] != plan.starts[b] ? plan.starts[a] < plan.starts[b]
                                            : numels[a] < numels[b];
  });
  int64_t end_of_previous = 0;
  for (size_t t : by_start) {
    const int64_t start = plan.starts[t];
    const int64_t end = start + numels[t];
    if (start < 0 || end > world_size * shard) return tensor(t) + "outside the buffer";
    if (start < end_of_previous) return tensor(t) + "overlaps another tensor";
    end_of_previous = std::max(end_of_previous, end);
    if (shard == 0) continue;
    for (int64_t b = (start / shard + 1) * shard; b < end; b += shard) {
      if ((b - start) % block_sizes[t] != 0) {
        return tensor(t) + "block cut by the rank boundary at " + std::to_string(b);
      }
    }
  }
  return "";
}

}  // namespace planner
}  // namespace veragged
