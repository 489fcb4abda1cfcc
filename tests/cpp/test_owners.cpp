// The matrix owner plan (csrc/optim/owners.h): invariants of every strategy, LPT against a brute
// force optimum and an independent LPT, micro-group capacity, alpha's two extremes, layer's
// whole buckets, errors.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "optim/owners.h"

namespace vo = veragged::optim;

namespace {

// Matrices whose numel cost is exactly `costs` (one 1 x c block each).
std::vector<std::vector<vo::Block>> from_costs(const std::vector<int64_t>& costs) {
  std::vector<std::vector<vo::Block>> matrices;
  for (int64_t c : costs) matrices.push_back({{1, c}});
  return matrices;
}

vo::OwnerOptions options(vo::Strategy strategy, int64_t capacity = 0, double alpha = 1.0) {
  vo::OwnerOptions o;
  o.strategy = strategy;
  o.cost = vo::Cost::kNumel;
  o.capacity = capacity;
  o.alpha = alpha;
  return o;
}

vo::OwnerPlan plan(const std::vector<int64_t>& costs, int64_t world, const vo::OwnerOptions& o,
                   const std::vector<int64_t>& buckets = {}) {
  return vo::plan_owners(from_costs(costs), buckets, world, o);
}

// Every matrix has one owner in [0, world), is in exactly one micro-group, and the loads are
// the per-rank sums of the owners' costs.
void check_invariants(const vo::OwnerPlan& p, const std::vector<int64_t>& costs, int64_t world) {
  ASSERT_EQ(p.owners.size(), costs.size());
  ASSERT_EQ(p.loads.size(), static_cast<size_t>(world));
  std::vector<int64_t> loads(world, 0);
  for (size_t i = 0; i < costs.size(); ++i) {
    ASSERT_GE(p.owners[i], 0);
    ASSERT_LT(p.owners[i], world);
    loads[p.owners[i]] += costs[i];
  }
  EXPECT_EQ(p.loads, loads);
  std::vector<int> seen(costs.size(), 0);
  for (const auto& group : p.groups) {
    EXPECT_FALSE(group.empty());
    for (int64_t i : group) {
      ASSERT_GE(i, 0);
      ASSERT_LT(i, static_cast<int64_t>(costs.size()));
      ++seen[i];
    }
  }
  for (size_t i = 0; i < costs.size(); ++i) EXPECT_EQ(seen[i], 1) << "matrix " << i;
}

std::vector<int64_t> random_costs(std::mt19937_64& rng, size_t n, int64_t max_cost) {
  std::vector<int64_t> costs(n);
  for (auto& c : costs) c = static_cast<int64_t>(rng() % max_cost) + 1;
  return costs;
}

// Least makespan over all world^n assignments.
int64_t brute_force_opt(const std::vector<int64_t>& costs, int64_t world) {
  std::vector<int64_t> loads(world, 0);
  int64_t best = std::numeric_limits<int64_t>::max();
  std::function<void(size_t)> go = [&](size_t i) {
    const int64_t now = *std::max_element(loads.begin(), loads.end());
    if (now >= best) return;
    if (i == costs.size()) {
      best = now;
      return;
    }
    for (int64_t r = 0; r < world; ++r) {
      loads[r] += costs[i];
      go(i + 1);
      loads[r] -= costs[i];
    }
  };
  go(0);
  return best;
}

// Textbook LPT by linear scans: largest cost first (lower index on ties), to the least loaded
// rank (lower rank on ties).
std::vector<int64_t> reference_lpt(const std::vector<int64_t>& costs, int64_t world) {
  std::vector<size_t> order(costs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return costs[a] > costs[b]; });
  std::vector<int64_t> loads(world, 0), owners(costs.size());
  for (size_t i : order) {
    const int64_t r = std::min_element(loads.begin(), loads.end()) - loads.begin();
    owners[i] = r;
    loads[r] += costs[i];
  }
  return owners;
}

template <typename F>
void expect_invalid(F call, const std::string& expected) {
  try {
    call();
    ADD_FAILURE() << "no exception, expected: " << expected;
  } catch (const std::invalid_argument& error) {
    EXPECT_NE(std::string(error.what()).find(expected), std::string::npos)
        << "message: " << error.what() << "\nexpected to contain: " << expected;
  }
}

}  // namespace

TEST(OwnerCost, FlopsAndNumelFormulas) {
  // s = 3, l = 5: 5 steps * (4 * 9 * 5 + 2 * 27) = 1170, either orientation.
  EXPECT_EQ(vo::block_cost({3, 5}, vo::Cost::kFlops, 5), 1170);
  EXPECT_EQ(vo::block_cost({5, 3}, vo::Cost::kFlops, 5), 1170);
  EXPECT_EQ(vo::block_cost({5, 3}, vo::Cost::kFlops, 1), 234);
  EXPECT_EQ(vo::block_cost({5, 3}, vo::Cost::kNumel, 5), 15);
  EXPECT_EQ(vo::block_cost({0, 7}, vo::Cost::kFlops, 5), 0);
  // A fused matrix costs the sum of its blocks, not the whole matrix.
  const auto costs = vo::matrix_costs({{{3, 5}, {2, 5}}, {{5, 5}}}, vo::Cost::kFlops, 5);
  const int64_t s2 = 5 * (4 * 4 * 5 + 2 * 8), whole = 5 * (4 * 25 * 5 + 2 * 125);
  EXPECT_EQ(costs, (std::vector<int64_t>{1170 + s2, whole}));
}

TEST(OwnerCost, ShampooTilesWithRemainders) {
  const auto shampoo = vo::Cost::kShampoo;
  // D = 4, 6x4: tiles 4x4 and 2x4. Per step 4ab(a+b): 512 + 192 = 704; refresh 11(a^3 + b^3):
  // 1408 + 792 = 2200.
  EXPECT_EQ(vo::block_cost({6, 4}, shampoo, 5, 1, 4), 704 + 2200);
  EXPECT_EQ(vo::block_cost({6, 4}, shampoo, 5, 10, 4), 704 + 220);  // exact division
  EXPECT_EQ(vo::block_cost({6, 4}, shampoo, 5, 7, 4), 704 + 315);   // ceil(2200 / 7)
  // D = 4, 5x6: rows 4, 1 and cols 4, 2, so tiles 4x4, 4x2, 1x4, 1x2. Per step
  // 512 + 192 + 80 + 24 = 808; refresh 1408 + 792 + 715 + 99 = 3014.
  EXPECT_EQ(vo::block_cost({5, 6}, shampoo, 5, 1, 4), 808 + 3014);
  EXPECT_EQ(vo::block_cost({5, 6}, shampoo, 5, 10, 4), 808 + 302);  // ceil(301.4)
  // The refresh is summed over the block's tiles before the one division: with f = 3014 it adds
  // 1, where dividing each tile's refresh and rounding up would add 4.
  EXPECT_EQ(vo::block_cost({5, 6}, shampoo, 5, 3014, 4), 808 + 1);
  // One tile when both sides fit (the default D = 1024): 4 * 3 * 5 * 8 + 11 * (27 + 125).
  EXPECT_EQ(vo::block_cost({3, 5}, shampoo, 5), 480 + 1672);
  EXPECT_EQ(vo::block_cost({5, 3}, shampoo, 5), 480 + 1672);
  // 8x8 with D = 4 is four 4x4 tiles; ns_steps never matters.
  EXPECT_EQ(vo::block_cost({8, 8}, shampoo, 1, 1, 4), 4 * (512 + 1408));
  EXPECT_EQ(vo::block_cost({0, 9}, shampoo, 5, 3, 4), 0);
  EXPECT_EQ(vo::block_cost({9, 0}, shampoo, 5, 3, 4), 0);
}

TEST(OwnerCost, SoapPreconditionsSidesUpToTheMaxDim) {
  const auto soap = vo::Cost::kSoap;
  // 3x5, D = 4: only the 3-side (m = 5). Per step 6 * 9 * 5 = 270; refresh 9 * 27 + 4 * 45 = 423.
  EXPECT_EQ(vo::block_cost({3, 5}, soap, 5, 1, 4), 270 + 423);
  EXPECT_EQ(vo::block_cost({3, 5}, soap, 5, 10, 4), 270 + 43);  // ceil(42.3)
  EXPECT_EQ(vo::block_cost({5, 3}, soap, 5, 10, 4), 270 + 43);
  // D = 8: both sides; the 5-side (m = 3) adds 6 * 25 * 3 = 450 and 9 * 125 + 4 * 75 = 1425.
  EXPECT_EQ(vo::block_cost({3, 5}, soap, 5, 1, 8), 720 + 1848);
  EXPECT_EQ(vo::block_cost({3, 5}, soap, 5, 10, 8), 720 + 185);  // ceil(184.8), not 43 + 143
  // Neither side <= D: plain Adam, r * c, whatever f.
  EXPECT_EQ(vo::block_cost({5, 6}, soap, 5, 1, 4), 30);
  EXPECT_EQ(vo::block_cost({5, 6}, soap, 5, 10, 4), 30);
  EXPECT_EQ(vo::block_cost({0, 5}, soap, 5, 1, 4), 0);
  EXPECT_EQ(vo::block_cost({5, 0}, soap, 5, 1, 8), 0);
  // A fused matrix sums its blocks (a 3x5 block and a plain-Adam 6x5 one), and the plan
  // balances exactly these costs.
  const auto costs = vo::matrix_costs({{{3, 5}, {6, 5}}, {{5, 6}}}, soap, 5, 10, 4);
  EXPECT_EQ(costs, (std::vector<int64_t>{313 + 30, 30}));
  vo::OwnerOptions o;
  o.cost = soap;
  o.precondition_frequency = 10;
  o.max_preconditioner_dim = 4;
  const auto p = vo::plan_owners({{{3, 5}, {6, 5}}, {{5, 6}}}, {}, 2, o);
  EXPECT_EQ(p.loads, (std::vector<int64_t>{343, 30}));
}

TEST(OwnerCost, PreconditionerOptionsLeaveFlopsAndNumelAlone) {
  for (auto cost : {vo::Cost::kFlops, vo::Cost::kNumel}) {
    for (int64_t f : {1, 3, 100}) {
      for (int64_t dim : {1, 4, 1024}) {
        EXPECT_EQ(vo::block_cost({7, 300}, cost, 5, f, dim), vo::block_cost({7, 300}, cost, 5));
      }
    }
  }
}

TEST(OwnerCost, PreconditionerErrors) {
  expect_invalid([] { vo::block_cost({2, 2}, vo::Cost::kShampoo, 5, 0, 4); },
                 "precondition_frequency must be >= 1, got 0");
  expect_invalid([] { vo::block_cost({2, 2}, vo::Cost::kSoap, 5, 1, 0); },
                 "max_preconditioner_dim must be >= 1, got 0");
  expect_invalid([] { vo::matrix_costs({{{2, 2}}}, vo::Cost::kSoap, 5, -3, 4); },
                 "precondition_frequency must be >= 1, got -3");
  vo::OwnerOptions o;
  o.cost = vo::Cost::kShampoo;
  o.precondition_frequency = 0;
  expect_invalid([&] { vo::plan_owners({{{2, 2}}}, {}, 2, o); },
                 "precondition_frequency must be >= 1, got 0");
  o.precondition_frequency = 1;
  o.max_preconditioner_dim = -1;
  expect_invalid([&] { vo::plan_owners({{{2, 2}}}, {}, 2, o); },
                 "max_preconditioner_dim must be >= 1, got -1");
  // Overflow: 2^20 x 2^20 tiles of 1024 x 1024 (4 * 2^31 * 2^20 each); one 2^21-side factor.
  o.max_preconditioner_dim = 1024;
  expect_invalid([&] { vo::plan_owners({{{2, 2}}, {{1 << 30, 1 << 30}}}, {}, 2, o); },
                 "matrices[1] block 0: the shampoo cost of a 1073741824x1073741824 block "
                 "overflows int64");
  o.cost = vo::Cost::kSoap;
  o.max_preconditioner_dim = 1 << 22;
  expect_invalid([&] { vo::plan_owners({{{1 << 21, 1 << 21}}}, {}, 2, o); },
                 "matrices[0] block 0: the soap cost of a 2097152x2097152 block overflows int64");
  // The refresh sum is checked before the division, even where the amortised cost would fit:
  // 2^20 x 1 has per step 6 * 2^40 (+ 6 * 2^20), but 9 n^3 = 9 * 2^60 > int64 max.
  o.max_preconditioner_dim = 1 << 20;
  o.precondition_frequency = std::numeric_limits<int64_t>::max();
  expect_invalid([&] { vo::plan_owners({{{1 << 20, 1}}}, {}, 2, o); },
                 "matrices[0] block 0: the soap cost of a 1048576x1 block overflows int64");
}

TEST(OwnerPlan, NaiveIsRoundRobinInInputOrder) {
  const std::vector<int64_t> costs = {5, 1, 9, 2, 7, 3, 8};
  const auto p = plan(costs, 3, options(vo::Strategy::kNaive));
  check_invariants(p, costs, 3);
  EXPECT_EQ(p.owners, (std::vector<int64_t>{0, 1, 2, 0, 1, 2, 0}));
  EXPECT_EQ(p.groups, (std::vector<std::vector<int64_t>>{{0, 1, 2}, {3, 4, 5}, {6}}));
  EXPECT_EQ(p.loads, (std::vector<int64_t>{15, 8, 12}));
  EXPECT_DOUBLE_EQ(p.ratio(), 15.0 * 3 / 35);
}

TEST(OwnerPlan, LptMatchesTextbookLptAndIsDeterministic) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t world = 1 + static_cast<int64_t>(rng() % 9);
    const auto costs = random_costs(rng, rng() % 60, trial % 2 ? 5 : 1000);  // 5: many ties
    const auto o = options(vo::Strategy::kLpt, static_cast<int64_t>(rng() % 3000));
    const auto p = plan(costs, world, o);
    check_invariants(p, costs, world);
    EXPECT_EQ(p.owners, reference_lpt(costs, world)) << "trial " << trial;
    const auto again = plan(costs, world, o);
    EXPECT_EQ(again.owners, p.owners);
    EXPECT_EQ(again.groups, p.groups);
  }
}

TEST(OwnerPlan, LptTiesGoToLowerIndexAndLowerRank) {
  const auto p = plan({4, 4, 4, 4, 4, 4, 4, 4}, 4, options(vo::Strategy::kLpt));
  EXPECT_EQ(p.owners, (std::vector<int64_t>{0, 1, 2, 3, 0, 1, 2, 3}));
  EXPECT_DOUBLE_EQ(p.ratio(), 1.0);
}

TEST(OwnerPlan, LptWithinGrahamBoundOfBruteForceOptimum) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t world = 2 + static_cast<int64_t>(rng() % 3);
    const auto costs = random_costs(rng, 1 + rng() % (world == 4 ? 7 : 9), 50);
    const auto p = plan(costs, world, options(vo::Strategy::kLpt));
    const int64_t lpt = *std::max_element(p.loads.begin(), p.loads.end());
    const int64_t opt = brute_force_opt(costs, world);
    EXPECT_GE(lpt, opt);
    EXPECT_LE(3 * lpt, 4 * opt) << "trial " << trial;
    EXPECT_LE(3 * world * lpt, (4 * world - 1) * opt) << "trial " << trial;  // 4/3 - 1/(3m)
  }
}

TEST(OwnerPlan, LptGroupsFollowTheSortAndRespectCapacity) {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t world = 1 + static_cast<int64_t>(rng() % 6);
    const auto costs = random_costs(rng, 1 + rng() % 40, 100);
    const int64_t capacity = 1 + static_cast<int64_t>(rng() % 250);  // some items above it
    const auto p = plan(costs, world, options(vo::Strategy::kLpt, capacity));
    check_invariants(p, costs, world);
    EXPECT_EQ(p.capacity, capacity);
    // Concatenated, the groups are the global order: cost descending, index ascending.
    std::vector<int64_t> flat;
    for (const auto& g : p.groups) flat.insert(flat.end(), g.begin(), g.end());
    for (size_t k = 1; k < flat.size(); ++k) {
      const int64_t a = flat[k - 1], b = flat[k];
      EXPECT_TRUE(costs[a] > costs[b] || (costs[a] == costs[b] && a < b));
    }
    std::vector<int64_t> gained(world);
    for (size_t g = 0; g < p.groups.size(); ++g) {
      std::fill(gained.begin(), gained.end(), 0);
      for (int64_t i : p.groups[g]) gained[p.owners[i]] += costs[i];
      const int64_t peak = *std::max_element(gained.begin(), gained.end());
      if (p.groups[g].size() > 1) {  // only a lone item may be above capacity
        EXPECT_LE(peak, capacity) << "trial " << trial << " group " << g;
      }
      // Groups are closed only when needed: the next group's first item did not fit.
      if (g + 1 < p.groups.size()) {
        const int64_t next = p.groups[g + 1][0];
        EXPECT_GT(std::max(peak, gained[p.owners[next]] + costs[next]), capacity);
      }
    }
  }
}

TEST(OwnerPlan, LptOversizeItemFormsItsOwnGroup) {
  const auto p = plan({3, 20, 2, 2}, 2, options(vo::Strategy::kLpt, 5));
  EXPECT_EQ(p.groups, (std::vector<std::vector<int64_t>>{{1}, {0, 2}, {3}}));
  EXPECT_EQ(p.owners, (std::vector<int64_t>{1, 0, 1, 1}));  // carried loads: 20 | 0 -> 20 | 7
  EXPECT_EQ(p.loads, (std::vector<int64_t>{20, 7}));
}

TEST(OwnerPlan, LptDefaultCapacity) {
  // max(largest = 9, ceil(ceil(40 / 2) / 4) = 5) = 9.
  EXPECT_EQ(plan({9, 8, 7, 6, 5, 5}, 2, options(vo::Strategy::kLpt)).capacity, 9);
  // max(largest = 10, ceil(ceil(1000 / 4) / 4) = 63) = 63: a few groups, none oversize.
  const std::vector<int64_t> costs(100, 10);
  const auto p = plan(costs, 4, options(vo::Strategy::kLpt));
  EXPECT_EQ(p.capacity, 63);
  EXPECT_EQ(p.groups.size(), 5u);  // 6 items per rank (60) per group: 24, 24, 24, 24, 4
  EXPECT_EQ(p.groups[0].size(), 24u);
  EXPECT_DOUBLE_EQ(p.ratio(), 1.0);
}

TEST(OwnerPlan, AlphaRunsAreContiguousPerBucket) {
  std::mt19937_64 rng(9);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t world = 1 + static_cast<int64_t>(rng() % 8);
    const auto costs = random_costs(rng, rng() % 50, 100);
    std::vector<int64_t> buckets(costs.size());
    for (auto& b : buckets) b = static_cast<int64_t>(rng() % 5);
    const double alpha = (rng() % 5) / 4.0;
    const auto p = plan(costs, world, options(vo::Strategy::kAlpha, 0, alpha), buckets);
    check_invariants(p, costs, world);
    EXPECT_EQ(p.capacity, 0);
    // One group per non-empty bucket in ascending id, members in input order, owners
    // non-decreasing along the bucket (each rank a contiguous run).
    int64_t last_id = -1;
    for (const auto& g : p.groups) {
      const int64_t id = buckets[g[0]];
      EXPECT_GT(id, last_id);
      last_id = id;
      for (size_t k = 0; k < g.size(); ++k) {
        EXPECT_EQ(buckets[g[k]], id);
        if (k > 0) {
          EXPECT_LT(g[k - 1], g[k]);
          EXPECT_LE(p.owners[g[k - 1]], p.owners[g[k]]);
        }
      }
    }
  }
}

TEST(OwnerPlan, AlphaZeroCutsEachBucketEvenlyAlphaOneFillsDeficits) {
  // Bucket 0 = {5, 3}, bucket 1 = six 1s, world 2, mean 7.
  const std::vector<int64_t> costs = {5, 3, 1, 1, 1, 1, 1, 1};
  const std::vector<int64_t> buckets = {0, 0, 1, 1, 1, 1, 1, 1};
  // alpha = 0: bucket 0 cut nearest 4 (after the 5), bucket 1 cut at 3 of 6: 8 | 6.
  const auto even = plan(costs, 2, options(vo::Strategy::kAlpha, 0, 0.0), buckets);
  EXPECT_EQ(even.owners, (std::vector<int64_t>{0, 1, 0, 0, 0, 1, 1, 1}));
  EXPECT_EQ(even.loads, (std::vector<int64_t>{8, 6}));
  // alpha = 1: deficits after bucket 0 are 2 | 4, so rank 0 gets 2 of bucket 1: 7 | 7.
  const auto fill = plan(costs, 2, options(vo::Strategy::kAlpha, 0, 1.0), buckets);
  EXPECT_EQ(fill.owners, (std::vector<int64_t>{0, 1, 0, 0, 1, 1, 1, 1}));
  EXPECT_EQ(fill.loads, (std::vector<int64_t>{7, 7}));
  EXPECT_DOUBLE_EQ(fill.ratio(), 1.0);
  EXPECT_EQ(fill.groups, (std::vector<std::vector<int64_t>>{{0, 1}, {2, 3, 4, 5, 6, 7}}));
}

TEST(OwnerPlan, AlphaZeroIgnoresHistory) {
  // With alpha = 0 each bucket is cut as if it were alone.
  std::mt19937_64 rng(13);
  for (int trial = 0; trial < 100; ++trial) {
    const int64_t world = 1 + static_cast<int64_t>(rng() % 6);
    const auto a = random_costs(rng, 1 + rng() % 20, 100);
    const auto b = random_costs(rng, 1 + rng() % 20, 100);
    std::vector<int64_t> both = a, buckets(a.size(), 0);
    both.insert(both.end(), b.begin(), b.end());
    buckets.resize(both.size(), 1);
    const auto o = options(vo::Strategy::kAlpha, 0, 0.0);
    const auto p = plan(both, world, o, buckets);
    const auto pa = plan(a, world, o), pb = plan(b, world, o);
    std::vector<int64_t> owners = pa.owners;
    owners.insert(owners.end(), pb.owners.begin(), pb.owners.end());
    EXPECT_EQ(p.owners, owners) << "trial " << trial;
  }
}

TEST(OwnerPlan, AlphaOneBalancesBetterThanAlphaZero) {
  std::mt19937_64 rng(17);
  double sum_fill = 0, sum_even = 0;
  for (int trial = 0; trial < 100; ++trial) {
    const auto costs = random_costs(rng, 80, 100);
    std::vector<int64_t> buckets(costs.size());
    for (size_t i = 0; i < costs.size(); ++i) buckets[i] = static_cast<int64_t>(i / 8);
    sum_fill += plan(costs, 8, options(vo::Strategy::kAlpha, 0, 1.0), buckets).ratio();
    sum_even += plan(costs, 8, options(vo::Strategy::kAlpha, 0, 0.0), buckets).ratio();
  }
  EXPECT_LT(sum_fill, 0.9 * sum_even);  // about 1.08 vs 1.28 on average
}

TEST(OwnerPlan, LayerPutsEachBucketWholeOnOneRankByLpt) {
  // Buckets 0 = {5, 3} (8), 1 = {1, 1} (2), 2 = {4, 4} (8), 3 = {6} (6), world 2. By total,
  // ties by lower id: 0 (8) -> rank 0, 2 (8) -> rank 1, 3 (6) -> rank 0 (8 | 8, lower rank),
  // 1 (2) -> rank 1 (14 | 8).
  const std::vector<int64_t> costs = {5, 3, 1, 4, 1, 4, 6};
  const std::vector<int64_t> buckets = {0, 0, 1, 2, 1, 2, 3};
  const auto p = plan(costs, 2, options(vo::Strategy::kLayer), buckets);
  check_invariants(p, costs, 2);
  EXPECT_EQ(p.owners, (std::vector<int64_t>{0, 0, 1, 1, 1, 1, 0}));
  EXPECT_EQ(p.loads, (std::vector<int64_t>{14, 10}));
  EXPECT_EQ(p.groups, (std::vector<std::vector<int64_t>>{{0, 1, 2, 3, 4, 5, 6}}));
  EXPECT_EQ(p.capacity, 0);
  EXPECT_DOUBLE_EQ(p.ratio(), 14.0 * 2 / 24);
}

TEST(OwnerPlan, LayerWithoutBucketsIsLptOverMatrices) {
  std::mt19937_64 rng(19);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t world = 1 + static_cast<int64_t>(rng() % 9);
    const auto costs = random_costs(rng, rng() % 60, trial % 2 ? 5 : 1000);  // 5: many ties
    const auto p = plan(costs, world, options(vo::Strategy::kLayer));
    check_invariants(p, costs, world);
    EXPECT_EQ(p.owners, reference_lpt(costs, world)) << "trial " << trial;
    // Distinct bucket ids in input order: the same plan.
    std::vector<int64_t> ids(costs.size());
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(3 * i + 1);
    EXPECT_EQ(plan(costs, world, options(vo::Strategy::kLayer), ids).owners, p.owners);
    EXPECT_LE(p.groups.size(), 1u);
  }
}

TEST(OwnerPlan, LayerBucketsStayWholeAndFollowBucketLpt) {
  std::mt19937_64 rng(23);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t world = 1 + static_cast<int64_t>(rng() % 8);
    const auto costs = random_costs(rng, rng() % 50, 100);
    std::vector<int64_t> buckets(costs.size());
    for (auto& b : buckets) b = static_cast<int64_t>(rng() % 7);
    const auto p = plan(costs, world, options(vo::Strategy::kLayer, 7, 0.5), buckets);
    check_invariants(p, costs, world);
    // One group, input order.
    if (!costs.empty()) {
      ASSERT_EQ(p.groups.size(), 1u);
      for (size_t k = 0; k < costs.size(); ++k) EXPECT_EQ(p.groups[0][k], static_cast<int64_t>(k));
    }
    // Bucket totals in ascending id (the dense order reference_lpt breaks ties by), and their
    // owners: textbook LPT over the totals.
    std::vector<int64_t> ids(buckets), totals;
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    for (int64_t id : ids) {
      int64_t total = 0;
      for (size_t i = 0; i < costs.size(); ++i) total += buckets[i] == id ? costs[i] : 0;
      totals.push_back(total);
    }
    const auto bucket_owners = reference_lpt(totals, world);
    for (size_t i = 0; i < costs.size(); ++i) {
      const size_t k = std::lower_bound(ids.begin(), ids.end(), buckets[i]) - ids.begin();
      EXPECT_EQ(p.owners[i], bucket_owners[k]) << "trial " << trial << " matrix " << i;
    }
  }
}

TEST(OwnerPlan, EmptyAndZeroCostInputs) {
  for (auto s : {vo::Strategy::kNaive, vo::Strategy::kLpt, vo::Strategy::kAlpha,
                 vo::Strategy::kLayer, vo::Strategy::kLocal}) {
    const auto empty = plan({}, 3, options(s));
    EXPECT_TRUE(empty.owners.empty() && empty.groups.empty());
    EXPECT_EQ(empty.loads, (std::vector<int64_t>{0, 0, 0}));
    EXPECT_DOUBLE_EQ(empty.ratio(), 1.0);
    const auto zeros = plan({0, 0, 0, 0}, 2, options(s));
    check_invariants(zeros, {0, 0, 0, 0}, 2);
    EXPECT_DOUBLE_EQ(zeros.ratio(), 1.0);
  }
}

TEST(OwnerPlan, ErrorsNameTheArgument) {
  const auto lpt = options(vo::Strategy::kLpt);
  expect_invalid([&] { plan({1}, 0, lpt); }, "world_size must be >= 1, got 0");
  expect_invalid([&] { plan({1}, 2, options(vo::Strategy::kAlpha, 0, 1.5)); },
                 "alpha must be in [0, 1], got 1.5");
  expect_invalid([&] { plan({1}, 2, options(vo::Strategy::kAlpha, 0, -0.25)); },
                 "alpha must be in [0, 1], got -0.25");
  expect_invalid([&] { plan({1}, 2, options(vo::Strategy::kLpt, 0, std::nan(""))); },
                 "alpha must be in [0, 1], got nan");
  expect_invalid([&] { vo::plan_owners({{{2, 2}}, {{2, 2}, {-3, 2}}}, {}, 2, lpt); },
                 "matrices[1] block 1: rows must be >= 0, got -3");
  expect_invalid([&] { vo::plan_owners({{{2, -1}}}, {}, 2, lpt); },
                 "matrices[0] block 0: cols must be >= 0, got -1");
  expect_invalid([&] { vo::plan_owners({{{2, 2}}, {}}, {}, 2, lpt); }, "matrices[1] has no blocks");
  expect_invalid([] { vo::parse_strategy("greedy"); },
                 "unknown strategy 'greedy' (expected naive, lpt, alpha, layer or local)");
  EXPECT_EQ(vo::parse_strategy("layer"), vo::Strategy::kLayer);
  expect_invalid([] { vo::parse_cost("bytes"); },
                 "unknown cost 'bytes' (expected flops, numel, shampoo or soap)");
  EXPECT_EQ(vo::parse_cost("shampoo"), vo::Cost::kShampoo);
  EXPECT_EQ(vo::parse_cost("soap"), vo::Cost::kSoap);
  auto bad_steps = lpt;
  bad_steps.ns_steps = 0;
  expect_invalid([&] { plan({1}, 2, bad_steps); }, "ns_steps must be >= 1, got 0");
  expect_invalid([&] { plan({1, 2}, 2, lpt, {0}); },
                 "buckets must be empty or have one id per matrix, got 1 ids for 2 matrices");
  expect_invalid([&] { plan({1, 2}, 2, lpt, {0, -2}); }, "buckets[1] must be >= 0, got -2");
  auto flops = lpt;
  flops.cost = vo::Cost::kFlops;
  expect_invalid([&] { vo::plan_owners({{{1 << 30, 1 << 30}}}, {}, 2, flops); },
                 "matrices[0] block 0: the flops cost of a 1073741824x1073741824 block overflows");
  const int64_t big = std::numeric_limits<int64_t>::max() / 2 + 1;
  expect_invalid([&] { plan({big, big}, 2, lpt); }, "the total cost at matrices[1] overflows");
}

// ---- local: matrices held whole stay home -------------------------------------------------------

namespace {

// `held` for matrices of numel `costs` (1 x c blocks): matrix i whole on home[i] (>= 0), or
// split evenly over the ranks (home -1; the remainder on rank 0).
std::vector<int64_t> held_table(const std::vector<int64_t>& costs, const std::vector<int64_t>& home,
                                int64_t world) {
  std::vector<int64_t> held;
  for (size_t i = 0; i < costs.size(); ++i) {
    for (int64_t r = 0; r < world; ++r) {
      if (home[i] >= 0) {
        held.push_back(r == home[i] ? costs[i] : 0);
      } else {
        held.push_back(costs[i] / world + (r == 0 ? costs[i] % world : 0));
      }
    }
  }
  return held;
}

vo::OwnerOptions local_options(const std::vector<int64_t>& held, double slack = 0.05) {
  auto o = options(vo::Strategy::kLocal);
  o.held = held;
  o.locality_slack = slack;
  return o;
}

}  // namespace

TEST(OwnerPlan, LocalKeepsBalancedHomesAndMovesNothing) {
  // 16 equal experts, 4 per rank: every expert stays where it is, nothing travels.
  const int64_t world = 4;
  std::vector<int64_t> costs(16, 100), home;
  for (int64_t i = 0; i < 16; ++i) home.push_back(i / 4);
  const auto held = held_table(costs, home, world);
  const auto p = plan(costs, world, local_options(held));
  check_invariants(p, costs, world);
  for (size_t i = 0; i < costs.size(); ++i) EXPECT_EQ(p.owners[i], home[i]);
  EXPECT_EQ(p.moved, 0);
  // lpt ignores where they are: it moves most of them (costs equal: round robin by index)
  const auto lpt = plan(costs, world, [&] { auto o = options(vo::Strategy::kLpt); o.held = held;
                                            return o; }());
  EXPECT_GT(lpt.moved, 0);
  EXPECT_EQ(*std::max_element(lpt.loads.begin(), lpt.loads.end()),
            *std::max_element(p.loads.begin(), p.loads.end()));
}

TEST(OwnerPlan, LocalPlacesTheRestByLptAroundTheHomes) {
  // Two experts at home on rank 0, the dense matrices split everywhere go by LPT on top.
  const int64_t world = 2;
  const std::vector<int64_t> costs{50, 50, 40, 30, 20, 10};
  const std::vector<int64_t> home{0, 0, -1, -1, -1, -1};
  const auto held = held_table(costs, home, world);
  const auto p = plan(costs, world, local_options(held));
  check_invariants(p, costs, world);
  EXPECT_EQ(p.owners[0], 0);
  EXPECT_EQ(p.owners[1], 0);
  // rank 1 takes 40, 30, 20 (least loaded each time), then 10 goes to rank 1 too (90 < 100)
  EXPECT_EQ(p.loads, (std::vector<int64_t>{100, 100}));
  // moved: the split matrices' halves that live on the other rank
  int64_t moved = 0;
  for (size_t i = 2; i < costs.size(); ++i) moved += costs[i] - held[i * world + p.owners[i]];
  EXPECT_EQ(p.moved, moved);
}

TEST(OwnerPlan, LocalMovesHomesOnlyBeyondTheSlack) {
  // Everything on rank 0: lpt reaches 40 (160 / 4), so with slack 0.05 (bound 40 + 2) rank 0
  // must shed matrices; with a huge slack nothing moves.
  const int64_t world = 4;
  const std::vector<int64_t> costs(8, 20);
  const std::vector<int64_t> home(8, 0);
  const auto held = held_table(costs, home, world);
  const auto kept = plan(costs, world, local_options(held, 1e9));
  EXPECT_EQ(kept.loads, (std::vector<int64_t>{160, 0, 0, 0}));
  EXPECT_EQ(kept.moved, 0);
  const auto p = plan(costs, world, local_options(held));
  check_invariants(p, costs, world);
  EXPECT_LE(*std::max_element(p.loads.begin(), p.loads.end()), 42);
  EXPECT_EQ(p.moved, 20 * (8 - std::count(p.owners.begin(), p.owners.end(), 0)));
  // slack 0: as balanced as single moves get (here perfectly)
  const auto tight = plan(costs, world, local_options(held, 0.0));
  EXPECT_EQ(tight.loads, (std::vector<int64_t>{40, 40, 40, 40}));
}

TEST(OwnerPlan, LocalRandomWithinBoundAndDeterministic) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t world = 1 + rng() % 8;
    const size_t n = rng() % 40;
    std::vector<int64_t> costs, home;
    for (size_t i = 0; i < n; ++i) {
      costs.push_back(1 + rng() % 1000);
      home.push_back(rng() % 3 == 0 ? -1 : static_cast<int64_t>(rng() % world));
    }
    const auto held = held_table(costs, home, world);
    const auto p = plan(costs, world, local_options(held));
    check_invariants(p, costs, world);
    const auto again = plan(costs, world, local_options(held));
    EXPECT_EQ(p.owners, again.owners);
    EXPECT_EQ(p.groups, again.groups);
    // Within lpt's max plus the slack (lpt's own plan where moves could not get there).
    int64_t total = 0;
    for (int64_t c : costs) total += c;
    const auto lpt = plan(costs, world, options(vo::Strategy::kLpt));
    const int64_t bound = (lpt.loads.empty() ? 0 : *std::max_element(lpt.loads.begin(),
                                                                     lpt.loads.end())) +
                          static_cast<int64_t>(std::floor(0.05 * ((total + world - 1) / world)));
    const auto m = std::max_element(p.loads.begin(), p.loads.end()) - p.loads.begin();
    if (n) {
      EXPECT_LE(p.loads[m], bound) << "trial " << trial;
    }
    // A matrix held whole stays home unless its rank was over the bound.
    int64_t moved = 0;
    for (size_t i = 0; i < n; ++i) moved += costs[i] - held[i * world + p.owners[i]];
    EXPECT_EQ(p.moved, n ? moved : -1);  // no matrices: an empty held, as without one
  }
}

TEST(OwnerPlan, HeldErrorsAndMovedForEveryStrategy) {
  const std::vector<int64_t> costs{4, 6};
  expect_invalid([&] { plan(costs, 2, local_options({4, 0, 6})); },
                 "held must be empty or have world_size entries per matrix (4), got 3");
  expect_invalid([&] { plan(costs, 2, local_options({4, 0, 7, 0})); },
                 "held[1][0] = 7 must be in [0, 6] (the numel of matrix 1)");
  expect_invalid([&] { plan(costs, 2, local_options({4, 0, 6, 0}, -1.0)); },
                 "locality_slack must be >= 0, got -1");
  EXPECT_EQ(plan(costs, 2, options(vo::Strategy::kLpt)).moved, -1);
  for (auto s : {vo::Strategy::kNaive, vo::Strategy::kLpt, vo::Strategy::kAlpha,
                 vo::Strategy::kLayer}) {
    auto o = options(s);
    o.held = {4, 0, 0, 6};  // matrix 0 on rank 0, matrix 1 on rank 1
    const auto p = plan(costs, 2, o);
    EXPECT_EQ(p.moved, (p.owners[0] == 0 ? 0 : 4) + (p.owners[1] == 1 ? 0 : 6));
  }
}
