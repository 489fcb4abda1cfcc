// Adapters from the flat_range_boxes and interval_overlaps schemas to the torch-free box math in
// csrc/placement.

#include <c10/util/Exception.h>

#include <stdexcept>

#include "bindings/ops.h"
#include "placement/boxes.h"

namespace veragged {

std::vector<int64_t> flat_range_boxes_op(c10::IntArrayRef shape, int64_t begin, int64_t end) {
  std::vector<placement::Box> boxes;
  try {
    boxes = placement::flat_range_boxes(shape.vec(), begin, end);
  } catch (const std::invalid_argument& error) {
    TORCH_CHECK_VALUE(false, error.what());  // surfaces in Python as ValueError
  }
  // Flattened: per box, its k offsets, then its k sizes.
  std::vector<int64_t> flat;
  flat.reserve(boxes.size() * 2 * shape.size());
  for (const placement::Box& box : boxes) {
    flat.insert(flat.end(), box.offsets.begin(), box.offsets.end());
    flat.insert(flat.end(), box.sizes.begin(), box.sizes.end());
  }
  return flat;
}

std::tuple<std::vector<int64_t>, std::vector<int64_t>> interval_overlaps_op(
    c10::IntArrayRef src_bounds, c10::IntArrayRef dst_bounds, int64_t rank) {
  std::vector<int64_t> send, recv;
  try {
    placement::interval_overlaps(src_bounds.vec(), dst_bounds.vec(), rank, send, recv);
  } catch (const std::invalid_argument& error) {
    TORCH_CHECK_VALUE(false, error.what());  // surfaces in Python as ValueError
  }
  return {std::move(send), std::move(recv)};
}

}  // namespace veragged
