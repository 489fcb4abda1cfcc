// The planner against an exhaustive search over every tensor order and shard size on small
// groups (<= 6 tensors, <= 4 ranks): never worse than 2x optimal, and how often optimal.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>

#include "brute_force.h"
#include "planner/planner.h"

namespace vp = veragged::planner;

namespace {

// The smallest shard size, a multiple of align, for which some order of the tensors fits.
int64_t optimal_shard(const std::vector<int64_t>& numels, const std::vector<int64_t>& blocks,
                      int64_t world_size, int64_t align) {
  const int64_t total = std::accumulate(numels.begin(), numels.end(), int64_t{0});
  if (total == 0) return 0;
  for (int64_t shard = align;; shard += align) {
    if (shard * world_size < total) continue;
    std::vector<int> order(numels.size());
    std::iota(order.begin(), order.end(), 0);
    do {
      if (brute::fits_in_order(numels, blocks, order, world_size, shard)) return shard;
    } while (std::next_permutation(order.begin(), order.end()));
  }
}

}  // namespace

TEST(PlannerOptimality, WithinTwiceOptimalOnSmallGroups) {
  std::mt19937_64 rng(11);
  int optimal = 0, trials = 0;
  double worst = 1.0;
  for (; trials < 3000; ++trials) {
    const int n = 1 + static_cast<int>(rng() % 6);
    const int64_t world_size = 1 + static_cast<int64_t>(rng() % 4);
    const int64_t align = rng() % 4 == 0 ? 2 : 1;
    std::vector<int64_t> numels, blocks;
    for (int t = 0; t < n; ++t) {
      const int64_t block = 1 + rng() % 6;
      numels.push_back(block * (rng() % 6));
      blocks.push_back(block);
    }
    const vp::Plan plan = vp::plan_layout(numels, blocks, world_size, align);
    ASSERT_EQ(vp::validate(numels, blocks, world_size, align, plan), "");
    const int64_t best = optimal_shard(numels, blocks, world_size, align);
    ASSERT_LE(plan.shard_size, 2 * best) << "trial " << trials;
    ASSERT_GE(plan.shard_size, best) << "trial " << trials << ": beat the exhaustive search";
    if (plan.shard_size == best) ++optimal;
    if (best > 0) worst = std::max(worst, double(plan.shard_size) / double(best));
  }
  std::printf("[ planner ] optimal shard size on %d of %d small groups (%.1f%%), worst ratio %.3f\n",
              optimal, trials, 100.0 * optimal / trials, worst);
}
