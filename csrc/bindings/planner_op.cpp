// Adapter from the plan_layout schema to the torch-free planner in csrc/planner.

#include <c10/util/Exception.h>

#include <stdexcept>

#include "bindings/ops.h"
#include "planner/planner.h"

namespace veragged {

std::tuple<int64_t, std::vector<int64_t>, std::vector<int64_t>, int64_t> plan_layout_op(
    c10::IntArrayRef numels, c10::IntArrayRef block_sizes, int64_t world_size, int64_t align) {
  planner::Plan plan;
  try {
    plan = planner::plan_layout(numels.vec(), block_sizes.vec(), world_size, align);
  } catch (const std::invalid_argument& error) {
    TORCH_CHECK_VALUE(false, error.what());  // surfaces in Python as ValueError
  }
  return {plan.shard_size, std::move(plan.starts), std::move(plan.permutation),
          static_cast<int64_t>(plan.order)};
}

}  // namespace veragged
