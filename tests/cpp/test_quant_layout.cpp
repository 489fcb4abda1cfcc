// pack_layout() (csrc/quant/layout.h): the packed all-gather slot of a block-scaled DBuffer.
#include <gtest/gtest.h>

#include <stdexcept>

#include "quant/layout.h"

using veragged::quant::kFp32Scale;
using veragged::quant::kMxFloor;
using veragged::quant::kPieceAlign;
using veragged::quant::kRaw;
using veragged::quant::pack_layout;
using veragged::quant::TensorSpec;

namespace {

TensorSpec matrix(int64_t start, int64_t rows, int64_t cols, int64_t format, int64_t tr,
                  int64_t tc, int64_t matrices = 1) {
  return {start, matrices * rows * cols, rows, cols, format, tr, tc, 0};
}

}  // namespace

TEST(QuantLayout, OneRankOneMatrixWithPartialTiles) {
  // 300 x 200 with 128x128 tiles: 3 x 2 tiles, fp32 scales after the 60000 data bytes.
  const auto out = pack_layout({matrix(0, 300, 200, kFp32Scale, 128, 128)}, 60000, 1, 256);
  ASSERT_EQ(out.segments.size(), 1u);
  const auto& s = out.segments[0];
  EXPECT_EQ(s.data_off, 0);
  EXPECT_EQ(s.scale_off, 60000);
  EXPECT_EQ(out.rank_bytes[0], 60000 + 6 * 4);
  EXPECT_EQ(out.slot_bytes, 60160);  // rounded up to 256
}

TEST(QuantLayout, RanksHoldWholeTileRowsAndOnlyTheirOwnBytes) {
  // Two 256 x 64 matrices planned over 2 ranks of 16384 elements: rank 0 the first, rank 1 the
  // second; a raw bias of 64 fp32 elements at the end of rank 1's slot.
  std::vector<TensorSpec> t = {matrix(0, 256, 64, kFp32Scale, 128, 128),
                               matrix(16384, 128, 64, kMxFloor, 1, 32),
                               {16384 + 8192, 64, 1, 1, kRaw, 1, 1, 4}};
  const auto out = pack_layout(t, 16384, 2, 256);
  ASSERT_EQ(out.segments.size(), 3u);
  EXPECT_EQ(out.segments[0].rank, 0);
  EXPECT_EQ(out.rank_bytes[0], 16384 + 2 * 4);
  // rank 1: 8192 data bytes, 128 x 2 E8M0 scales, then 256 raw bytes, each 16-aligned
  EXPECT_EQ(out.segments[1].scale_off, 8192);
  EXPECT_EQ(out.segments[2].data_off, 8192 + 256);
  EXPECT_EQ(out.rank_bytes[1], 8192 + 256 + 256);
  EXPECT_EQ(out.slot_bytes, 16384 + 256);
  for (const auto& s : out.segments) EXPECT_EQ(s.data_off % kPieceAlign, 0);
}

TEST(QuantLayout, AStackIsSplitIntoOneSegmentPerMatrix) {
  // 3 matrices of 130 x 70 on one rank: tile-rows restart at each matrix.
  const auto out = pack_layout({matrix(0, 130, 70, kFp32Scale, 128, 128, 3)}, 27300, 1, 16);
  ASSERT_EQ(out.segments.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(out.segments[i].elem_off, i * 9100);
    EXPECT_EQ(out.segments[i].rows, 130);
  }
}

TEST(QuantLayout, ACutInsideATileRowIsRefused) {
  // 300 x 200 split at element 30000 (row 150): not a tile-row boundary.
  EXPECT_THROW(pack_layout({matrix(0, 300, 200, kFp32Scale, 128, 128)}, 30000, 2, 256),
               std::invalid_argument);
  // ... but a cut at row 256 (element 51200) is, and the rest ends at the tensor's end.
  EXPECT_NO_THROW(pack_layout({matrix(0, 300, 200, kFp32Scale, 128, 128)}, 51200, 2, 256));
}

TEST(QuantLayout, BadSpecsAreRefused) {
  EXPECT_THROW(pack_layout({matrix(0, 10, 10, 9, 1, 1)}, 100, 1, 1), std::invalid_argument);
  EXPECT_THROW(pack_layout({{0, 10, 1, 1, kRaw, 1, 1, 0}}, 10, 1, 1), std::invalid_argument);
  EXPECT_THROW(pack_layout({{0, 101, 10, 10, kFp32Scale, 1, 1, 0}}, 101, 1, 1),
               std::invalid_argument);
}
