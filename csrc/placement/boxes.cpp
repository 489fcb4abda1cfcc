// flat_range_boxes and interval_overlaps: see [Note: flat range boxes] in boxes.h.

#include "placement/boxes.h"

#include <algorithm>
#include <cstddef>
#include <limits>
#include <stdexcept>
#include <string>

namespace veragged {
namespace placement {

namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

std::string str(int64_t value) { return std::to_string(value); }

// "[3, 4]", for messages.
std::string str(const std::vector<int64_t>& values) {
  std::string out = "[";
  for (std::size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + str(values[i]);
  return out + "]";
}

int64_t round_down(int64_t value, int64_t unit) { return value / unit * unit; }

// Smallest multiple of `unit` that is >= value. Called with value <= numel and unit dividing
// numel, so the result is <= numel and cannot overflow.
int64_t round_up(int64_t value, int64_t unit) {
  const int64_t rest = value % unit;
  return rest == 0 ? value : value - rest + unit;
}

// Checks the arguments of flat_range_boxes and returns the numel of `shape`.
int64_t check_range(const std::vector<int64_t>& shape, int64_t begin, int64_t end) {
  const std::string op = "flat_range_boxes: ";
  if (shape.empty()) fail(op + "shape must have at least one dim, got []");
  bool has_zero = false;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] < 0) {
      fail(op + "shape[" + std::to_string(d) + "] = " + str(shape[d]) + " must be >= 0");
    }
    has_zero = has_zero || shape[d] == 0;
  }
  // A zero dim makes numel 0 whatever the others are; otherwise the product must fit in int64.
  int64_t numel = has_zero ? 0 : 1;
  for (std::size_t d = 0; d < shape.size() && !has_zero; ++d) {
    if (numel > kMax / shape[d]) fail(op + "numel of shape " + str(shape) + " overflows int64");
    numel *= shape[d];
  }
  if (begin < 0) fail(op + "begin = " + str(begin) + " must be >= 0");
  if (end > numel) {
    fail(op + "end = " + str(end) + " exceeds numel " + str(numel) + " of shape " + str(shape));
  }
  if (begin > end) fail(op + "begin = " + str(begin) + " exceeds end = " + str(end));
  return numel;
}

// Checks one bounds array of interval_overlaps.
void check_bounds(const char* name, const std::vector<int64_t>& bounds) {
  const std::string op = std::string("interval_overlaps: ") + name;
  if (bounds[0] != 0) fail(op + "[0] = " + str(bounds[0]) + " must be 0");
  for (std::size_t j = 1; j < bounds.size(); ++j) {
    if (bounds[j] < bounds[j - 1]) {
      fail(op + "[" + std::to_string(j) + "] = " + str(bounds[j]) + " is less than " + name +
           "[" + std::to_string(j - 1) + "] = " + str(bounds[j - 1]));
    }
  }
}

// Size of the overlap of [lo1, hi1) and [lo2, hi2).
int64_t overlap(int64_t lo1, int64_t hi1, int64_t lo2, int64_t hi2) {
  return std::max<int64_t>(0, std::min(hi1, hi2) - std::max(lo1, lo2));
}

}  // namespace

std::vector<Box> flat_range_boxes(const std::vector<int64_t>& shape, int64_t begin, int64_t end) {
  check_range(shape, begin, end);
  std::vector<Box> boxes;
  if (begin == end) return boxes;  // also every zero-numel shape, whose strides may be 0

  const int k = static_cast<int>(shape.size());
  std::vector<int64_t> stride(k, 1);  // stride[d] = s[d]; all >= 1 since numel > 0
  for (int d = k - 2; d >= 0; --d) stride[d] = stride[d + 1] * shape[d + 1];

  // Appends the box of [lo, hi) with range dim r: lo and hi are multiples of stride[r] in one
  // block of stride[r - 1] elements, so dims < r take lo's index and dims > r are full.
  auto emit = [&](int r, int64_t lo, int64_t hi) {
    Box box{std::vector<int64_t>(k, 0), std::vector<int64_t>(shape)};
    for (int d = 0; d < r; ++d) {
      box.offsets[d] = lo / stride[d] % shape[d];
      box.sizes[d] = 1;
    }
    box.offsets[r] = lo / stride[r] % shape[r];
    box.sizes[r] = (hi - lo) / stride[r];
    boxes.push_back(std::move(box));
  };

  int64_t lo = begin;
  // Phase 1, leading pieces: align lo to ever coarser strides while that stays within the range.
  int middle = 0;  // the range dim m of the middle block
  for (int d = k - 1; d >= 1; --d) {
    const int64_t next = round_up(lo, stride[d - 1]);
    if (next > end) {  // [lo, end) lies in one block of stride[d - 1]: the middle is at d
      middle = d;
      break;
    }
    if (next > lo) emit(d, lo, next);
    lo = next;
  }
  // Phase 2, the middle block, then phase 3, trailing pieces at ever finer strides. Before each
  // step lo is a multiple of stride[d] and end - lo < stride[d - 1], so every piece is one box.
  for (int d = middle; d < k; ++d) {
    const int64_t next = round_down(end, stride[d]);
    if (next > lo) emit(d, lo, next);
    lo = next;
  }
  return boxes;
}

void interval_overlaps(const std::vector<int64_t>& src_bounds,
                       const std::vector<int64_t>& dst_bounds, int64_t rank,
                       std::vector<int64_t>& send, std::vector<int64_t>& recv) {
  if (src_bounds.size() != dst_bounds.size()) {
    fail("interval_overlaps: src_bounds and dst_bounds must have the same length, got " +
         std::to_string(src_bounds.size()) + " and " + std::to_string(dst_bounds.size()));
  }
  if (src_bounds.size() < 2) {
    fail("interval_overlaps: the bounds need P + 1 >= 2 entries, got " +
         std::to_string(src_bounds.size()));
  }
  check_bounds("src_bounds", src_bounds);
  check_bounds("dst_bounds", dst_bounds);
  const int64_t ranks = static_cast<int64_t>(src_bounds.size()) - 1;
  if (src_bounds[ranks] != dst_bounds[ranks]) {
    fail("interval_overlaps: src_bounds ends at " + str(src_bounds[ranks]) +
         " but dst_bounds ends at " + str(dst_bounds[ranks]));
  }
  if (rank < 0 || rank >= ranks) {
    fail("interval_overlaps: rank = " + str(rank) + " must be in [0, " + str(ranks) + ")");
  }

  send.assign(ranks, 0);
  recv.assign(ranks, 0);
  const int64_t src_lo = src_bounds[rank], src_hi = src_bounds[rank + 1];
  const int64_t dst_lo = dst_bounds[rank], dst_hi = dst_bounds[rank + 1];
  for (int64_t j = 0; j < ranks; ++j) {
    send[j] = overlap(src_lo, src_hi, dst_bounds[j], dst_bounds[j + 1]);
    recv[j] = overlap(src_bounds[j], src_bounds[j + 1], dst_lo, dst_hi);
  }
}

}  // namespace placement
}  // namespace veragged
