// flat_range_boxes and interval_overlaps against element-by-element brute force: every range of
// every small shape, random bounds, and the input errors.

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>

#include "placement/boxes.h"

namespace vb = veragged::placement;

namespace {

using Shape = std::vector<int64_t>;

int64_t numel_of(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<int64_t> strides_of(const Shape& shape) {
  std::vector<int64_t> stride(shape.size(), 1);
  for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d) {
    stride[d] = stride[d + 1] * shape[d + 1];
  }
  return stride;
}

// Every shape with 1..max_dims dims of sizes 0..max_size.
std::vector<Shape> all_shapes(int max_dims, int64_t max_size) {
  std::vector<Shape> shapes;
  std::function<void(Shape&)> grow = [&](Shape& shape) {
    if (!shape.empty()) shapes.push_back(shape);
    if (static_cast<int>(shape.size()) == max_dims) return;
    for (int64_t size = 0; size <= max_size; ++size) {
      shape.push_back(size);
      grow(shape);
      shape.pop_back();
    }
  };
  Shape shape;
  grow(shape);
  return shapes;
}

// Checks boxes against [begin, end) of `shape`: in bounds, each box one flat-contiguous slice
// (dims after its first non-1 dim full), slices in increasing order chaining from begin to end,
// and, element by element, every element of the range covered once and nothing else covered.
// `covered` is scratch of numel entries. Returns "" or the first violation.
std::string check_boxes(const Shape& shape, int64_t begin, int64_t end,
                        const std::vector<vb::Box>& boxes, std::vector<int>& covered) {
  const int k = static_cast<int>(shape.size());
  const std::vector<int64_t> stride = strides_of(shape);
  std::fill(covered.begin(), covered.end(), 0);
  int64_t previous_end = begin;
  for (std::size_t i = 0; i < boxes.size(); ++i) {
    const vb::Box& box = boxes[i];
    const std::string at = "box " + std::to_string(i) + ": ";
    if (static_cast<int>(box.offsets.size()) != k || static_cast<int>(box.sizes.size()) != k) {
      return at + "wrong rank";
    }
    int r = k - 1;  // the range dim: first dim of size != 1
    for (int d = k - 1; d >= 0; --d) {
      if (box.offsets[d] < 0 || box.sizes[d] < 1 || box.offsets[d] + box.sizes[d] > shape[d]) {
        return at + "out of bounds or empty in dim " + std::to_string(d);
      }
      if (box.sizes[d] != 1) r = d;
    }
    int64_t start = 0, volume = 1;
    for (int d = 0; d < k; ++d) {
      if (d > r && (box.offsets[d] != 0 || box.sizes[d] != shape[d])) {
        return at + "not contiguous: dim " + std::to_string(d) + " is not full";
      }
      start += box.offsets[d] * stride[d];
      volume *= box.sizes[d];
    }
    if (start != previous_end) {
      return at + "starts at " + std::to_string(start) + ", not at " + std::to_string(previous_end);
    }
    previous_end = start + volume;
    // Mark every element of the box, by its multi-index.
    std::vector<int64_t> index(box.offsets);
    for (int64_t n = 0; n < volume; ++n) {
      int64_t flat = 0;
      for (int d = 0; d < k; ++d) flat += index[d] * stride[d];
      ++covered[flat];
      for (int d = k - 1; d >= 0 && ++index[d] == box.offsets[d] + box.sizes[d]; --d) {
        index[d] = box.offsets[d];
      }
    }
  }
  if (previous_end != end) return "boxes end at " + std::to_string(previous_end);
  for (int64_t i = 0; i < static_cast<int64_t>(covered.size()); ++i) {
    if (covered[i] != (begin <= i && i < end ? 1 : 0)) {
      return "element " + std::to_string(i) + " covered " + std::to_string(covered[i]) + " times";
    }
  }
  return "";
}

// is_box[x * (n + 1) + y]: whether the flat range [x, y) is exactly a box, i.e. its bounding box
// has y - x elements.
std::vector<char> box_ranges(const Shape& shape) {
  const int k = static_cast<int>(shape.size());
  const int64_t n = numel_of(shape);
  const std::vector<int64_t> stride = strides_of(shape);
  std::vector<char> is_box((n + 1) * (n + 1), 0);
  for (int64_t x = 0; x < n; ++x) {
    std::vector<int64_t> lo(k, INT64_MAX), hi(k, -1);
    for (int64_t y = x + 1; y <= n; ++y) {
      int64_t volume = 1;
      for (int d = 0; d < k; ++d) {
        const int64_t i = (y - 1) / stride[d] % shape[d];
        lo[d] = std::min(lo[d], i);
        hi[d] = std::max(hi[d], i);
        volume *= hi[d] - lo[d] + 1;
      }
      is_box[x * (n + 1) + y] = volume == y - x;
    }
  }
  return is_box;
}

}  // namespace

TEST(FlatRangeBoxes, EveryRangeOfEverySmallShapeIsAMinimalCover) {
  int64_t ranges = 0;
  for (const Shape& shape : all_shapes(4, 4)) {
    const int k = static_cast<int>(shape.size());
    const int64_t n = numel_of(shape);
    const std::vector<char> is_box = box_ranges(shape);
    std::vector<int> covered(n);
    std::vector<int64_t> fewest(n + 1);
    for (int64_t begin = 0; begin <= n; ++begin) {
      // fewest[e]: the fewest flat-contiguous boxes covering [begin, e), by dynamic programming.
      fewest[begin] = 0;
      for (int64_t e = begin + 1; e <= n; ++e) {
        fewest[e] = INT64_MAX;
        for (int64_t x = begin; x < e; ++x) {
          if (is_box[x * (n + 1) + e]) fewest[e] = std::min(fewest[e], fewest[x] + 1);
        }
      }
      for (int64_t end = begin; end <= n; ++end, ++ranges) {
        const std::vector<vb::Box> boxes = vb::flat_range_boxes(shape, begin, end);
        const int64_t count = static_cast<int64_t>(boxes.size());
        const std::string where = "shape of " + std::to_string(k) + " dims, numel " +
                                  std::to_string(n) + ", range [" + std::to_string(begin) +
                                  ", " + std::to_string(end) + ")";
        ASSERT_EQ(check_boxes(shape, begin, end, boxes, covered), "") << where;
        ASSERT_LE(count, 2 * k - 1) << where;
        ASSERT_EQ(count, fewest[end]) << where;
        if (k == 1) {
          ASSERT_EQ(count, begin < end ? 1 : 0) << where;
        }
        if (k == 2) {
          ASSERT_LE(count, 3) << where;
        }
      }
    }
  }
  EXPECT_EQ(ranges, 436410);  // 780 shapes, every [begin, end): the sweep really ran
}

TEST(FlatRangeBoxes, RandomRangesOfDeeperShapes) {
  std::mt19937_64 rng(11);
  for (int i = 0; i < 3000; ++i) {
    Shape shape(5 + rng() % 3);
    for (int64_t& d : shape) d = 1 + rng() % 4;
    const int64_t n = numel_of(shape);
    const int64_t begin = rng() % (n + 1);
    const int64_t end = begin + rng() % (n - begin + 1);
    std::vector<int> covered(n);
    const std::vector<vb::Box> boxes = vb::flat_range_boxes(shape, begin, end);
    ASSERT_EQ(check_boxes(shape, begin, end, boxes, covered), "") << "i=" << i;
    ASSERT_LE(boxes.size(), 2 * shape.size() - 1) << "i=" << i;
  }
}

TEST(FlatRangeBoxes, Examples) {
  // [3, 4], elements 1..10: the rest of row 0, row 1, the start of row 2.
  const std::vector<vb::Box> boxes = vb::flat_range_boxes({3, 4}, 1, 10);
  ASSERT_EQ(boxes.size(), 3u);
  EXPECT_EQ(boxes[0].offsets, (Shape{0, 1}));
  EXPECT_EQ(boxes[0].sizes, (Shape{1, 3}));
  EXPECT_EQ(boxes[1].offsets, (Shape{1, 0}));
  EXPECT_EQ(boxes[1].sizes, (Shape{1, 4}));
  EXPECT_EQ(boxes[2].offsets, (Shape{2, 0}));
  EXPECT_EQ(boxes[2].sizes, (Shape{1, 2}));
  // Whole rows are one box; an empty range and a zero-size shape give none.
  const std::vector<vb::Box> rows = vb::flat_range_boxes({3, 4}, 4, 12);
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].offsets, (Shape{1, 0}));
  EXPECT_EQ(rows[0].sizes, (Shape{2, 4}));
  EXPECT_TRUE(vb::flat_range_boxes({3, 4}, 5, 5).empty());
  EXPECT_TRUE(vb::flat_range_boxes({3, 0, 4}, 0, 0).empty());
}

TEST(FlatRangeBoxes, HugeShapesDoNotOverflow) {
  const int64_t side = 3037000499;  // side * side is just below 2^63
  const std::vector<vb::Box> boxes = vb::flat_range_boxes({side, side}, 1, side * side);
  ASSERT_EQ(boxes.size(), 2u);
  EXPECT_EQ(boxes[0].offsets, (Shape{0, 1}));
  EXPECT_EQ(boxes[0].sizes, (Shape{1, side - 1}));
  EXPECT_EQ(boxes[1].offsets, (Shape{1, 0}));
  EXPECT_EQ(boxes[1].sizes, (Shape{side - 1, side}));
  // A zero dim makes the numel 0 even where the other dims' product would overflow.
  EXPECT_TRUE(vb::flat_range_boxes({side, side, side, 0}, 0, 0).empty());
}

namespace {

// The message of the std::invalid_argument that f throws.
std::string message(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST(FlatRangeBoxes, Errors) {
  auto boxes = [](Shape shape, int64_t begin, int64_t end) {
    return message([&] { vb::flat_range_boxes(shape, begin, end); });
  };
  EXPECT_EQ(boxes({}, 0, 0), "flat_range_boxes: shape must have at least one dim, got []");
  EXPECT_EQ(boxes({3, -2}, 0, 0), "flat_range_boxes: shape[1] = -2 must be >= 0");
  EXPECT_EQ(boxes({1ll << 32, 1ll << 32}, 0, 0),
            "flat_range_boxes: numel of shape [4294967296, 4294967296] overflows int64");
  EXPECT_EQ(boxes({3, 4}, -1, 2), "flat_range_boxes: begin = -1 must be >= 0");
  EXPECT_EQ(boxes({3, 4}, 0, 13), "flat_range_boxes: end = 13 exceeds numel 12 of shape [3, 4]");
  EXPECT_EQ(boxes({3, 4}, 5, 3), "flat_range_boxes: begin = 5 exceeds end = 3");
}

TEST(IntervalOverlaps, MatchesElementCountOnRandomBounds) {
  std::mt19937_64 rng(3);
  for (int i = 0; i < 5000; ++i) {
    const int64_t ranks = 1 + rng() % 9;
    // src: random steps with zeros; dst: random cut points of the same total.
    std::vector<int64_t> src(ranks + 1, 0), dst(ranks + 1, 0);
    for (int64_t j = 1; j <= ranks; ++j) src[j] = src[j - 1] + (rng() % 3 == 0 ? 0 : rng() % 7);
    const int64_t total = src[ranks];
    for (int64_t j = 1; j < ranks; ++j) dst[j] = rng() % (total + 1);
    dst[ranks] = total;
    std::sort(dst.begin(), dst.end());
    // count[a][b]: elements on rank a before and rank b after.
    std::vector<std::vector<int64_t>> count(ranks, std::vector<int64_t>(ranks, 0));
    for (int64_t e = 0; e < total; ++e) {
      const int64_t a = std::upper_bound(src.begin(), src.end(), e) - src.begin() - 1;
      const int64_t b = std::upper_bound(dst.begin(), dst.end(), e) - dst.begin() - 1;
      ++count[a][b];
    }
    std::vector<std::vector<int64_t>> sends(ranks), recvs(ranks);
    for (int64_t r = 0; r < ranks; ++r) {
      vb::interval_overlaps(src, dst, r, sends[r], recvs[r]);
      ASSERT_EQ(sends[r].size(), static_cast<std::size_t>(ranks));
      ASSERT_EQ(recvs[r].size(), static_cast<std::size_t>(ranks));
      int64_t sent = 0, received = 0;
      for (int64_t j = 0; j < ranks; ++j) {
        ASSERT_EQ(sends[r][j], count[r][j]) << "i=" << i << " rank=" << r << " j=" << j;
        ASSERT_EQ(recvs[r][j], count[j][r]) << "i=" << i << " rank=" << r << " j=" << j;
        sent += sends[r][j];
        received += recvs[r][j];
      }
      ASSERT_EQ(sent, src[r + 1] - src[r]) << "i=" << i << " rank=" << r;
      ASSERT_EQ(received, dst[r + 1] - dst[r]) << "i=" << i << " rank=" << r;
    }
    for (int64_t r = 0; r < ranks; ++r) {
      for (int64_t j = 0; j < ranks; ++j) ASSERT_EQ(sends[r][j], recvs[j][r]) << "i=" << i;
    }
  }
}

TEST(IntervalOverlaps, Example) {
  std::vector<int64_t> send, recv;
  // 10 elements: 4, 4, 2 before; 3, 3, 4 after. Rank 1 holds [4, 8), then [3, 6).
  vb::interval_overlaps({0, 4, 8, 10}, {0, 3, 6, 10}, 1, send, recv);
  EXPECT_EQ(send, (std::vector<int64_t>{0, 2, 2}));
  EXPECT_EQ(recv, (std::vector<int64_t>{1, 2, 0}));
}

TEST(IntervalOverlaps, Errors) {
  auto overlaps = [](std::vector<int64_t> src, std::vector<int64_t> dst, int64_t rank) {
    std::vector<int64_t> send, recv;
    return message([&] { vb::interval_overlaps(src, dst, rank, send, recv); });
  };
  EXPECT_EQ(overlaps({0, 4}, {0, 2, 4}, 0),
            "interval_overlaps: src_bounds and dst_bounds must have the same length, got 2 and 3");
  EXPECT_EQ(overlaps({0}, {0}, 0), "interval_overlaps: the bounds need P + 1 >= 2 entries, got 1");
  EXPECT_EQ(overlaps({1, 4}, {0, 4}, 0), "interval_overlaps: src_bounds[0] = 1 must be 0");
  EXPECT_EQ(overlaps({0, 5, 4}, {0, 2, 4}, 0),
            "interval_overlaps: src_bounds[2] = 4 is less than src_bounds[1] = 5");
  EXPECT_EQ(overlaps({0, 2, 4}, {0, 3, 1}, 0),
            "interval_overlaps: dst_bounds[2] = 1 is less than dst_bounds[1] = 3");
  EXPECT_EQ(overlaps({0, 2, 4}, {0, 2, 6}, 0),
            "interval_overlaps: src_bounds ends at 4 but dst_bounds ends at 6");
  EXPECT_EQ(overlaps({0, 2, 4}, {0, 2, 4}, 2), "interval_overlaps: rank = 2 must be in [0, 2)");
  EXPECT_EQ(overlaps({0, 2, 4}, {0, 2, 4}, -1), "interval_overlaps: rank = -1 must be in [0, 2)");
}
