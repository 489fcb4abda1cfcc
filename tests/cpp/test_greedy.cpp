// The closed-form earliest_start and place_greedy against a position-by-position scan.

#include <gtest/gtest.h>

#include <random>

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
  std::mt19937_64 rng(7);
  for (int i = 0; i < 20000; ++i) {
    const int64_t shard = 1 + rng() % 300;
    const int64_t block = 1 + rng() % 64;
    const int64_t numel = block * (rng() % (4 * shard / block + 2));
    const int64_t pos = rng() % 100000;
    ASSERT_EQ(vp::earliest_start(pos, numel, block, shard),
              brute::earliest_start(pos, numel, block, shard))
        << "pos=" << pos << " numel=" << numel << " block=" << block << " shard=" << shard;
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
