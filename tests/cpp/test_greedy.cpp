// The closed-form earliest_start and place_greedy against a position-by-position scan.

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "brute_force.h"
#include "planner/greedy.h"

namespace vp = veragged::planner;

TEST(EarliestStart, MatchesScanOnEverySmallCase) {
  for (int64_t shard = 1; shard <= 12; ++shard) {
    for (int64_t block = 1; block <= 12; ++block) {
      for (int64_t numel = 0; numel <= 40; numel += block) {
        for (int64_t pos = 0; pos < 3 * shard; ++pos) {
          ASSERT_EQ(vp::earliest_start(pos, numel, block, shard),
                    brute::earliest_start(pos, numel, block, shard))
              << "pos=" << pos << " numel=" << numel << " block=" << block << " shard=" << shard;
        }
      }
    }
  }
}

TEST(EarliestStart, MatchesScanOnRandomLargeCases) {
  // earliest_start, and gap_before from the offset it starts at, against the scan; and
  // advance_offset against the modulo it replaces.
  std::mt19937_64 rng(7);
  for (int i = 0; i < 20000; ++i) {
    const int64_t shard = 1 + rng() % 300;
    const int64_t block = 1 + rng() % 64;
    const int64_t numel = block * (rng() % (4 * shard / block + 2));
    const int64_t pos = rng() % 100000;
    const int64_t start = brute::earliest_start(pos, numel, block, shard);
    ASSERT_EQ(vp::earliest_start(pos, numel, block, shard), start)
        << "pos=" << pos << " numel=" << numel << " block=" << block << " shard=" << shard;
    const int64_t gap = vp::gap_before(pos % shard, numel, block, shard, shard % block == 0);
    ASSERT_EQ(gap == vp::kNever ? int64_t{-1} : pos + gap, start)
        << "pos=" << pos << " numel=" << numel << " block=" << block << " shard=" << shard;
    const int64_t by = rng() % 5 == 0 ? rng() % 100000 : rng() % (2 * shard);
    ASSERT_EQ(vp::advance_offset(pos % shard, by, shard), (pos + by) % shard);
  }
}

TEST(EarliestStart, EmptyTensorStaysPut) {
  EXPECT_EQ(vp::earliest_start(5, 0, 7, 4), 5);
  EXPECT_EQ(vp::earliest_start(8, 0, 1, 4), 8);
}

TEST(EarliestStart, WholeTensorBlockNeverCrosses) {
  // A 6-element whole-tensor block in 8-element shards starting at offset 3 must move on.
  EXPECT_EQ(vp::earliest_start(3, 6, 6, 8), 8);
  // It can never fit in shards smaller than itself.
  EXPECT_EQ(vp::earliest_start(0, 6, 6, 5), vp::kNever);
}

TEST(PlaceGreedy, StopsAtTheLimit) {
  const std::vector<vp::Item> items{{4, 1}, {4, 1}};
  std::vector<int64_t> starts(2);
  EXPECT_EQ(vp::place_greedy(items, 4, 8, &starts), 8);
  EXPECT_EQ(starts, (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(vp::place_greedy(items, 4, 7, nullptr), vp::kNever);
}

TEST(PlaceFilling, RulesPlaceValidlyAndLargeBlocksKeepTheFlexibleTensors) {
  // Two tensor shapes of 112 units: blocks of 7 and of 2 units, twice as many of the first, in
  // shards of 88 units (the DeepSeek-V3 MoE case at 1024 ranks, in units of 2^17 elements).
  std::vector<vp::Item> items;
  for (int e = 0; e < 60; ++e) items.push_back({112, e % 3 == 2 ? 2 : 7});
  const vp::FillClasses classes = vp::make_fill_classes(items);
  EXPECT_EQ(classes.blocked.size(), 2u);
  EXPECT_TRUE(classes.elementwise.empty());
  int64_t ends[2];
  int i = 0;
  for (vp::FillRule rule : {vp::FillRule::kLeastPadding, vp::FillRule::kLargeBlocks}) {
    std::vector<int64_t> order(items.size()), starts(items.size());
    ends[i] = vp::place_filling(classes, items, rule, 88, 1 << 30, &order, &starts);
    std::vector<int64_t> seen(order);
    std::sort(seen.begin(), seen.end());
    for (std::size_t t = 0; t < seen.size(); ++t) ASSERT_EQ(seen[t], int64_t(t));
    int64_t end = 0;
    for (std::size_t k = 0; k < order.size(); ++k) {
      const vp::Item& item = items[order[k]];
      ASSERT_EQ(starts[k], brute::earliest_start(end, item.numel, item.block, 88));
      end = starts[k] + item.numel;
    }
    ASSERT_EQ(end, ends[i++]);
  }
  // Least padding first spends the 2-unit-block tensors early and pads every 7-unit one after.
  EXPECT_LT(ends[1], ends[0]);
}

TEST(PlaceFilling, ElementWiseTensorsGoInIndexOrder) {
  const std::vector<vp::Item> items{{5, 1}, {3, 1}, {8, 4}, {2, 1}};
  const vp::FillClasses classes = vp::make_fill_classes(items);
  EXPECT_EQ(classes.elementwise, (std::vector<int64_t>{0, 1, 3}));
  std::vector<int64_t> order(4), starts(4);
  // Shards of 8: the 8-element tensor with blocks of 4 fits at 0 with no padding and, having the
  // larger block, goes first; the element-wise ones follow by index.
  EXPECT_EQ(vp::place_filling(classes, items, vp::FillRule::kLeastPadding, 8, 100, &order,
                              &starts),
            18);
  EXPECT_EQ(order, (std::vector<int64_t>{2, 0, 1, 3}));
  EXPECT_EQ(starts, (std::vector<int64_t>{0, 8, 13, 16}));
}
