// Structure-aware layout planner for a group of RaggedShard tensors (veScale-FSDP, Algorithm 1).
//
// Pure C++17: no torch headers, so the same code builds into veragged._C and into the
// GoogleTest binary under tests/cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace veragged {
namespace planner {

// [Note: planner layout contract]
// A group of n tensors is placed in one flat buffer of world_size * shard_size elements; rank k
// owns the elements [k * shard_size, (k + 1) * shard_size). Tensor t occupies the contiguous
// interval [starts[t], starts[t] + numels[t]) and is cut into blocks of block_sizes[t] elements.
// A plan satisfies:
//   1. every tensor is contiguous and tensors do not overlap;
//   2. no block is cut by a rank boundary: a boundary b with start < b < end has
//      (b - start) % block == 0, so each rank holds a whole number of blocks of every tensor;
//   3. every rank has the same shard_size, a multiple of the alignment unit;
//   4. padding = world_size * shard_size - sum(numels) is as small as the heuristic finds.
// Consumers (DBuffer views, fully_shard, AdamW8bit's block alignment) rely on 1-3 only;
// validate() checks exactly these rules.

// Which tensor order a plan was built with. The planner tries each and keeps the best, preferring
// the earlier one on ties. The first three are the paper's; kFill is ours (see greedy.h).
enum class Order : int64_t {
  kGiven = 0,      // the caller's order
  kBlockSize = 1,  // block size descending, stable
  kShape = 2,      // block size descending, then numel descending (groups equal shapes), stable
  kFill = 3,       // chosen while placing: least padding first (place_filling)
};

// kFill costs O(classes) per tensor; groups with more distinct (numel, block) classes skip it.
constexpr std::size_t kMaxFillClasses = 64;

const char* order_name(Order order);

struct Plan {
  int64_t shard_size = 0;            // S, a multiple of align
  int64_t padding = 0;               // world_size * S - sum(numels)
  std::vector<int64_t> starts;       // per input tensor, in input order
  std::vector<int64_t> permutation;  // input indices in buffer order
  Order order = Order::kGiven;
};

// Plans the layout. Throws std::invalid_argument naming the offending tensor index and values
// for: mismatched lengths, numel < 0, block size < 1, a block size that does not divide its
// numel, world_size < 1, align < 1, or sizes whose total overflows int64.
Plan plan_layout(const std::vector<int64_t>& numels, const std::vector<int64_t>& block_sizes,
                 int64_t world_size, int64_t align = 1);

// Checks a plan against [Note: planner layout contract]. Returns "" when valid, otherwise a
// description of the first violation. Used by tests; cheap enough to run after every plan.
std::string validate(const std::vector<int64_t>& numels, const std::vector<int64_t>& block_sizes,
                     int64_t world_size, int64_t align, const Plan& plan);

// Number of blocks of a tensor at [start, start + numel) that rank `rank` holds.
int64_t units_on_rank(int64_t start, int64_t numel, int64_t block, int64_t shard_size,
                      int64_t rank);

}  // namespace planner
}  // namespace veragged
