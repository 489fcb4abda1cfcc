// plan_layout: every rule of [Note: planner layout contract] on random and edge-case groups,
// input errors, and the validator's own ability to reject bad plans.

#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <stdexcept>
#include <string>

#include "planner/planner.h"

namespace vp = veragged::planner;

namespace {

struct Group {
  std::vector<int64_t> numels, blocks;
  int64_t world_size = 1;
  int64_t align = 1;
};

// A random group mixing element-wise, row-wise and whole-tensor blocks, with empty tensors.
Group random_group(std::mt19937_64& rng, int64_t max_world) {
  Group g;
  const int n = 1 + static_cast<int>(rng() % 24);
  static const int64_t kRows[] = {1, 3, 5, 7, 16, 96, 128, 1000, 4096};
  for (int t = 0; t < n; ++t) {
    const int64_t row = kRows[rng() % 9];
    const int64_t rows = rng() % 5 == 0 ? 0 : 1 + rng() % 300;
    const int64_t numel = row * rows;
    int64_t block = 1;
    switch (rng() % 4) {
      case 1: block = row; break;
      case 2: block = row * (rows % 4 == 0 && rows > 0 ? 4 : 1); break;
      case 3: block = numel > 0 ? numel : 1; break;  // whole tensor
    }
    g.numels.push_back(numel);
    g.blocks.push_back(block);
  }
  g.world_size = 1 + static_cast<int64_t>(rng() % max_world);
  static const int64_t kAlign[] = {1, 1, 2, 4, 16, 128};
  g.align = kAlign[rng() % 6];
  return g;
}

void expect_valid(const Group& g, const vp::Plan& plan) {
  ASSERT_EQ(vp::validate(g.numels, g.blocks, g.world_size, g.align, plan), "");
  const int64_t total = std::accumulate(g.numels.begin(), g.numels.end(), int64_t{0});
  ASSERT_GE(plan.shard_size * g.world_size, total);
  // The blocks of every tensor, summed over ranks, are all its blocks.
  for (size_t t = 0; t < g.numels.size(); ++t) {
    int64_t units = 0;
    for (int64_t r = 0; r < g.world_size; ++r) {
      units += vp::units_on_rank(plan.starts[t], g.numels[t], g.blocks[t], plan.shard_size, r);
    }
    ASSERT_EQ(units, g.numels[t] / g.blocks[t]) << "tensor " << t;
  }
}

}  // namespace

TEST(Planner, RandomGroupsSatisfyEveryConstraint) {
  std::mt19937_64 rng(2026);
  for (int i = 0; i < 5000; ++i) {
    const Group g = random_group(rng, i % 10 == 0 ? 100000 : 64);
    const vp::Plan plan = vp::plan_layout(g.numels, g.blocks, g.world_size, g.align);
    expect_valid(g, plan);
  }
}

TEST(Planner, LowerBoundIsReachedWhenEverythingIsElementWise) {
  // Element-wise tensors can be cut anywhere: S = ceil(total / m) rounded to align.
  const std::vector<int64_t> numels{10, 7, 30, 1, 0, 13};
  const std::vector<int64_t> blocks(numels.size(), 1);
  const vp::Plan plan = vp::plan_layout(numels, blocks, 4, 1);
  EXPECT_EQ(plan.shard_size, 16);
  EXPECT_EQ(plan.padding, 3);
  EXPECT_EQ(plan.order, vp::Order::kGiven);
  EXPECT_EQ(vp::plan_layout(numels, blocks, 4, 8).shard_size, 16);
  EXPECT_EQ(vp::plan_layout(numels, blocks, 4, 5).shard_size, 20);
}

TEST(Planner, SingleRankHoldsEverythingContiguously) {
  const std::vector<int64_t> numels{6, 9, 4};
  const std::vector<int64_t> blocks{3, 9, 2};
  const vp::Plan plan = vp::plan_layout(numels, blocks, 1, 1);
  EXPECT_EQ(plan.shard_size, 19);
  EXPECT_EQ(plan.padding, 0);
  EXPECT_EQ(plan.starts, (std::vector<int64_t>{0, 6, 15}));
}

TEST(Planner, WholeTensorBlocksGoToOneRankEach) {
  const std::vector<int64_t> numels{8, 8, 8, 8};
  const std::vector<int64_t> blocks{8, 8, 8, 8};
  const vp::Plan plan = vp::plan_layout(numels, blocks, 4, 1);
  EXPECT_EQ(plan.shard_size, 8);
  EXPECT_EQ(plan.padding, 0);
  for (size_t t = 0; t < numels.size(); ++t) EXPECT_EQ(plan.starts[t] % 8, 0);
}

TEST(Planner, TensorSpanningManyRanksKeepsRowsWhole) {
  // 100 rows of 12 over 64 ranks: the shard size must be a multiple of 12 for the rows to stay
  // whole, and the smallest such size that holds 1200 elements on 64 ranks is 24.
  const vp::Plan plan = vp::plan_layout({1200}, {12}, 64, 1);
  EXPECT_EQ(plan.shard_size, 24);
  EXPECT_EQ(vp::validate({1200}, {12}, 64, 1, plan), "");
}

TEST(Planner, EmptyGroupsAndEmptyTensors) {
  EXPECT_EQ(vp::plan_layout({}, {}, 8, 4).shard_size, 0);
  const vp::Plan zeros = vp::plan_layout({0, 0}, {5, 1}, 3, 1);
  EXPECT_EQ(zeros.shard_size, 0);
  EXPECT_EQ(zeros.padding, 0);
  const vp::Plan mixed = vp::plan_layout({0, 12, 0}, {7, 4, 1}, 3, 1);
  EXPECT_EQ(mixed.shard_size, 4);
  EXPECT_EQ(vp::validate({0, 12, 0}, {7, 4, 1}, 3, 1, mixed), "");
}

TEST(Planner, HundredThousandRanks) {
  const std::vector<int64_t> numels{7168LL * 2048, 2048LL * 7168, 7168, 129280LL * 7168};
  const std::vector<int64_t> blocks{7168, 2048, 1, 7168};
  const vp::Plan plan = vp::plan_layout(numels, blocks, 100000, 64);
  EXPECT_EQ(vp::validate(numels, blocks, 100000, 64, plan), "");
  EXPECT_LT(plan.padding, (7168LL * 2048 * 2 + 129280LL * 7168) / 2);
}

// One MoE decoder layer of DeepSeek-V3-671B as benchmarks/model_shapes.py groups it: the
// attention and norm tensors element-wise, each expert matrix (256 routed + 1 shared, gate/up
// [2048, 7168] and down [7168, 2048]) in blocks of `rows` rows.
Group deepseek_moe_layer(int64_t rows, int64_t world_size) {
  Group g;
  g.world_size = world_size;
  auto add = [&g](int64_t numel, int64_t block) {
    g.numels.push_back(numel);
    g.blocks.push_back(block);
  };
  for (int64_t numel : {7168LL, 1536LL * 7168, 1536LL, 24576LL * 1536, 576LL * 7168, 512LL,
                        32768LL * 512, 7168LL * 16384, 7168LL}) {
    add(numel, 1);
  }
  auto expert = [&] {
    add(2048LL * 7168, rows * 7168);  // gate_proj
    add(2048LL * 7168, rows * 7168);  // up_proj
    add(7168LL * 2048, rows * 2048);  // down_proj
  };
  for (int e = 0; e < 256; ++e) expert();
  add(256LL * 7168, 1);  // router
  add(256, 1);           // e_score_correction_bias
  expert();              // shared expert
  return g;
}

TEST(Planner, DeepSeekMoeLayerPadsUnderThreePercent) {
  // The regime the fill order alone lost (6.1% at 1024 ranks, 128-row blocks): the 2-row-block
  // down projections fit at almost any offset and the least-padding rule spent them first. The
  // fill_large order keeps them for the gaps: 88 units of 2^17 per rank, 2.64%, the optimum
  // of the exact search over orders on that grid ([Note: fill rules]).
  for (int64_t world_size : {256, 512, 1024}) {
    for (int64_t rows : {1, 16, 128}) {
      const Group g = deepseek_moe_layer(rows, world_size);
      const vp::Plan plan = vp::plan_layout(g.numels, g.blocks, g.world_size, g.align);
      expect_valid(g, plan);
      const int64_t total = std::accumulate(g.numels.begin(), g.numels.end(), int64_t{0});
      EXPECT_LT(100.0 * double(plan.padding) / double(total), 3.0)
          << "rows " << rows << " world_size " << world_size;
    }
  }
  const Group hard = deepseek_moe_layer(128, 1024);
  const vp::Plan plan = vp::plan_layout(hard.numels, hard.blocks, 1024, 1);
  EXPECT_EQ(plan.shard_size, 88 * 131072);
  EXPECT_EQ(plan.order, vp::Order::kFillLarge);
}

TEST(Planner, LowerBoundHoldsAndIsReached) {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 2000; ++i) {
    const Group g = random_group(rng, 64);
    const int64_t bound = vp::lower_bound(g.numels, g.blocks, g.world_size, g.align);
    const vp::Plan plan = vp::plan_layout(g.numels, g.blocks, g.world_size, g.align);
    ASSERT_LE(bound, plan.shard_size);
    ASSERT_EQ(bound % g.align, 0);
  }
  // A tensor longer than 2S holds two boundaries, so its block divides S: 100 rows of 12 on 64
  // ranks need S = 24, not ceil(1200 / 64) = 19; the plan meets the bound.
  EXPECT_EQ(vp::lower_bound({1200}, {12}, 64, 1), 24);
  // Element-wise groups reach ceil(total / m).
  EXPECT_EQ(vp::lower_bound({10, 7, 30}, {1, 1, 1}, 4, 1), 12);
  EXPECT_EQ(vp::lower_bound({}, {}, 4, 1), 0);
}

TEST(Planner, RejectsBadInputNamingTheValues) {
  auto message = [](auto&& call) -> std::string {
    try {
      call();
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_EQ(message([] { vp::plan_layout({10, 9}, {5, 2}, 2, 1); }),
            "block_sizes[1] = 2 does not divide numels[1] = 9");
  EXPECT_EQ(message([] { vp::plan_layout({10, -4}, {5, 2}, 2, 1); }),
            "numels[1] must be >= 0, got -4");
  EXPECT_EQ(message([] { vp::plan_layout({10}, {0}, 2, 1); }),
            "block_sizes[0] must be >= 1, got 0");
  EXPECT_EQ(message([] { vp::plan_layout({10}, {5}, 0, 1); }), "world_size must be >= 1, got 0");
  EXPECT_EQ(message([] { vp::plan_layout({10}, {5}, 2, 0); }), "align must be >= 1, got 0");
  EXPECT_EQ(message([] { vp::plan_layout({10}, {5, 1}, 2, 1); }),
            "numels and block_sizes must have the same length, got 1 and 2");
  EXPECT_EQ(message([] { vp::lower_bound({10, 9}, {5, 2}, 2, 1); }),
            "block_sizes[1] = 2 does not divide numels[1] = 9");
}

TEST(Validator, RejectsBrokenPlans) {
  const std::vector<int64_t> numels{6, 4};
  const std::vector<int64_t> blocks{3, 2};
  vp::Plan plan = vp::plan_layout(numels, blocks, 2, 1);
  ASSERT_EQ(vp::validate(numels, blocks, 2, 1, plan), "");
  vp::Plan cut = plan;
  cut.starts = {1, 7};  // tensor 0 spans [1, 7): the boundary at 5 cuts a block
  cut.shard_size = 5;
  cut.padding = 0;
  EXPECT_NE(vp::validate(numels, blocks, 2, 1, cut), "");
  vp::Plan overlap = plan;
  overlap.starts[1] = overlap.starts[0] + 2;
  EXPECT_NE(vp::validate(numels, blocks, 2, 1, overlap), "");
  vp::Plan outside = plan;
  outside.starts[1] = 2 * plan.shard_size - 2;
  EXPECT_NE(vp::validate(numels, blocks, 2, 1, outside), "");
  EXPECT_NE(vp::validate(numels, blocks, 2, 4, plan), "");  // shard_size not aligned
}
