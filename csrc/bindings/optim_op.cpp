// Adapters from the plan_owners and matrix_costs schemas to the torch-free owner plan in
// csrc/optim/owners.h ([Note: matrix owner plan]).

#include <c10/util/Exception.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>

#include "bindings/ops.h"
#include "optim/owners.h"

namespace veragged {

namespace {

// The flattened row blocks regrouped per matrix: matrix i has the next blocks_per_matrix[i].
std::vector<std::vector<optim::Block>> unflatten_blocks(c10::IntArrayRef block_rows,
                                                        c10::IntArrayRef block_cols,
                                                        c10::IntArrayRef blocks_per_matrix) {
  TORCH_CHECK_VALUE(block_rows.size() == block_cols.size(),
                    "block_rows and block_cols must have the same length, got ", block_rows.size(),
                    " and ", block_cols.size());
  std::vector<std::vector<optim::Block>> matrices(blocks_per_matrix.size());
  std::size_t next = 0;
  for (std::size_t i = 0; i < matrices.size(); ++i) {
    const int64_t count = blocks_per_matrix[i];
    TORCH_CHECK_VALUE(count >= 0 && static_cast<std::size_t>(count) <= block_rows.size() - next,
                      "blocks_per_matrix[", i, "] = ", count, " is negative or runs past the ",
                      block_rows.size(), " blocks");
    for (int64_t b = 0; b < count; ++b, ++next) {
      matrices[i].push_back({block_rows[next], block_cols[next]});
    }
  }
  TORCH_CHECK_VALUE(next == block_rows.size(), "blocks_per_matrix sums to ", next, ", but ",
                    block_rows.size(), " blocks were given");
  return matrices;
}

}  // namespace

std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
           int64_t, int64_t>
plan_owners_op(c10::IntArrayRef block_rows, c10::IntArrayRef block_cols,
               c10::IntArrayRef blocks_per_matrix, c10::IntArrayRef buckets, int64_t world_size,
               std::string_view strategy, std::string_view cost, double alpha, int64_t capacity,
               int64_t ns_steps, int64_t precondition_frequency, int64_t max_preconditioner_dim,
               c10::IntArrayRef held, double locality_slack) {
  const auto matrices = unflatten_blocks(block_rows, block_cols, blocks_per_matrix);
  optim::OwnerPlan plan;
  try {
    optim::OwnerOptions options;
    options.strategy = optim::parse_strategy(std::string(strategy));
    options.cost = optim::parse_cost(std::string(cost));
    options.alpha = alpha;
    options.capacity = capacity;
    options.ns_steps = ns_steps;
    options.precondition_frequency = precondition_frequency;
    options.max_preconditioner_dim = max_preconditioner_dim;
    options.held = held.vec();
    options.locality_slack = locality_slack;
    plan = optim::plan_owners(matrices, buckets.vec(), world_size, options);
  } catch (const std::invalid_argument& error) {
    TORCH_CHECK_VALUE(false, error.what());  // surfaces in Python as ValueError
  }
  std::vector<int64_t> offsets{0}, members;
  for (const std::vector<int64_t>& group : plan.groups) {
    members.insert(members.end(), group.begin(), group.end());
    offsets.push_back(static_cast<int64_t>(members.size()));
  }
  return {std::move(plan.owners), std::move(offsets), std::move(members), std::move(plan.loads),
          plan.capacity, plan.moved};
}

std::vector<int64_t> matrix_costs_op(c10::IntArrayRef block_rows, c10::IntArrayRef block_cols,
                                     c10::IntArrayRef blocks_per_matrix, std::string_view cost,
                                     int64_t ns_steps, int64_t precondition_frequency,
                                     int64_t max_preconditioner_dim) {
  const auto matrices = unflatten_blocks(block_rows, block_cols, blocks_per_matrix);
  std::vector<int64_t> costs;
  try {
    costs = optim::matrix_costs(matrices, optim::parse_cost(std::string(cost)), ns_steps,
                                precondition_frequency, max_preconditioner_dim);
  } catch (const std::invalid_argument& error) {
    TORCH_CHECK_VALUE(false, error.what());  // surfaces in Python as ValueError
  }
  return costs;
}

}  // namespace veragged
