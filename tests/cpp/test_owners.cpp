// The Muon owner plan (csrc/optim/owners.h): invariants of every strategy, LPT against a brute
// force optimum and an independent LPT, micro-group capacity, alpha's two extremes, errors.

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

TEST(OwnerPlan, EmptyAndZeroCostInputs) {
  for (auto s : {vo::Strategy::kNaive, vo::Strategy::kLpt, vo::Strategy::kAlpha}) {
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
                 "unknown strategy 'greedy' (expected naive, lpt or alpha)");
  expect_invalid([] { vo::parse_cost("bytes"); }, "unknown cost 'bytes' (expected flops or numel)");
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
