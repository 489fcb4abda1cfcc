// The planner against exhaustive searches over every tensor order and shard size on small
// groups: the exact search reaches the optimum, the lower bound never passes it, the lattice
// feasibility behind [Note: shard-size search] is monotone, and the heuristic orders used on
// large groups mostly reach the exact search.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "brute_force.h"
#include "planner/planner.h"

namespace vp = veragged::planner;

namespace {

struct Group {
  std::vector<int64_t> numels, blocks;
  int64_t world_size = 1;
  int64_t align = 1;
};

// <= 6 tensors of <= 5 blocks of <= 6 elements, <= 4 ranks: small enough for every order.
Group small_group(std::mt19937_64& rng) {
  Group g;
  const int n = 1 + static_cast<int>(rng() % 6);
  g.world_size = 1 + static_cast<int64_t>(rng() % 4);
  g.align = rng() % 4 == 0 ? 2 : 1;
  for (int t = 0; t < n; ++t) {
    const int64_t block = 1 + rng() % 6;
    g.numels.push_back(block * (rng() % 6));
    g.blocks.push_back(block);
  }
  return g;
}

// The smallest shard size, a multiple of align, for which some order of the tensors fits.
int64_t optimal_shard(const Group& g) {
  const int64_t total = std::accumulate(g.numels.begin(), g.numels.end(), int64_t{0});
  if (total == 0) return 0;
  for (int64_t shard = g.align;; shard += g.align) {
    if (shard * g.world_size < total) continue;
    std::vector<int> order(g.numels.size());
    std::iota(order.begin(), order.end(), 0);
    do {
      if (brute::fits_in_order(g.numels, g.blocks, order, g.world_size, shard)) return shard;
    } while (std::next_permutation(order.begin(), order.end()));
  }
}

}  // namespace

TEST(PlannerOptimality, OptimalOnSmallGroups) {
  // Small groups take the exact search ([Note: exact placement]) unless a heuristic order
  // already meets the lower bound; either way the shard size is the optimum.
  std::mt19937_64 rng(11);
  int exact = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const Group g = small_group(rng);
    const vp::Plan plan = vp::plan_layout(g.numels, g.blocks, g.world_size, g.align);
    ASSERT_EQ(vp::validate(g.numels, g.blocks, g.world_size, g.align, plan), "");
    const int64_t best = optimal_shard(g);
    ASSERT_EQ(plan.shard_size, best) << "trial " << trial;
    ASSERT_LE(vp::lower_bound(g.numels, g.blocks, g.world_size, g.align), best);
    if (plan.order == vp::Order::kExact) ++exact;
  }
  std::printf("[ planner ] optimal on 3000 of 3000 small groups, %d of them by the exact search\n",
              exact);
  EXPECT_GT(exact, 0);
}

TEST(PlannerOptimality, LatticeFeasibilityIsMonotone) {
  // P_L of [Note: shard-size search]: if an order fits at k * L with case-3 tensors only of
  // blocks dividing L, it fits at (k + 1) * L too. The exact search relies on it.
  std::mt19937_64 rng(12);
  int checked = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const Group g = small_group(rng);
    std::vector<int64_t> units{g.align};
    for (int64_t block : g.blocks) {  // every lcm of align and a set of blocks
      const std::size_t known = units.size();
      for (std::size_t i = 0; i < known; ++i) units.push_back(std::lcm(units[i], block));
    }
    std::sort(units.begin(), units.end());
    units.erase(std::unique(units.begin(), units.end()), units.end());
    std::vector<int> order(g.numels.size());
    std::iota(order.begin(), order.end(), 0);
    do {
      for (int64_t unit : units) {
        bool fitted = false;
        for (int64_t k = 1; k * unit <= 40; ++k) {
          const bool fits =
              brute::fits_on_lattice(g.numels, g.blocks, order, g.world_size, k * unit, unit);
          ASSERT_TRUE(fits || !fitted) << "trial " << trial << " unit " << unit << " k " << k;
          fitted = fits;
          ++checked;
        }
      }
    } while (std::next_permutation(order.begin(), order.end()));
  }
  EXPECT_GT(checked, 10000);
}

TEST(PlannerOptimality, HeuristicOrdersMostlyReachTheExactSearch) {
  // Large groups (over kMaxExactStates count vectors) get the heuristic orders only. On groups
  // of up to 12 tensors drawn from a few shapes the exact search gives the optimum (the test
  // above); the heuristic orders alone reach it on most of them (1438 of 1500 when written;
  // the misses are small shards, where one element is several percent, worst 20 vs 16).
  std::mt19937_64 rng(13);
  int optimal = 0, trials = 0;
  double worst = 1.0;
  for (; trials < 1500; ++trials) {
    Group g;
    const int kinds = 1 + static_cast<int>(rng() % 4);
    std::vector<std::pair<int64_t, int64_t>> shapes;
    for (int k = 0; k < kinds; ++k) {
      const int64_t block = rng() % 3 == 0 ? 1 : 2 + static_cast<int64_t>(rng() % 14);
      shapes.push_back({block * (1 + static_cast<int64_t>(rng() % 12)), block});
    }
    const int n = 2 + static_cast<int>(rng() % 11);
    for (int t = 0; t < n; ++t) {
      const auto& shape = shapes[rng() % shapes.size()];
      g.numels.push_back(shape.first);
      g.blocks.push_back(shape.second);
    }
    g.world_size = 2 + static_cast<int64_t>(rng() % 15);
    g.align = rng() % 4 == 0 ? 4 : 1;
    const vp::Plan exact = vp::plan_layout(g.numels, g.blocks, g.world_size, g.align);
    const vp::Plan heuristic = vp::plan_layout(g.numels, g.blocks, g.world_size, g.align, 0);
    ASSERT_EQ(vp::validate(g.numels, g.blocks, g.world_size, g.align, heuristic), "");
    ASSERT_LE(exact.shard_size, heuristic.shard_size) << "trial " << trials;
    const double ratio = double(heuristic.shard_size) / double(exact.shard_size);
    if (ratio == 1.0) ++optimal;
    worst = std::max(worst, ratio);
  }
  std::printf("[ planner ] heuristic orders optimal on %d of %d groups, worst ratio %.4f\n",
              optimal, trials, worst);
  EXPECT_GT(optimal, trials * 9 / 10);
}
