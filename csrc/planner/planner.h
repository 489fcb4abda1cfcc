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

// Which tensor order a plan was built with. The planner tries the heuristic orders and keeps
// the best, preferring the earlier one on ties, then the exact search where the group is small.
// The first three are the paper's; the rest are ours (greedy.h, exact.h).
enum class Order : int64_t {
  kGiven = 0,      // the caller's order
  kBlockSize = 1,  // block size descending, stable
  kShape = 2,      // block size descending, then numel descending (groups equal shapes), stable
  kFill = 3,       // chosen while placing: least padding first (FillRule::kLeastPadding)
  kFillLarge = 4,  // chosen while placing: larger blocks may pad half a block (kLargeBlocks)
  kExact = 5,      // the best of every order, by dynamic programming (ExactPlacer)
};

// The fill orders cost O(classes) per tensor; groups with more distinct (numel, block) classes
// of blocks > 1 skip them.
constexpr std::size_t kMaxFillClasses = 64;

// At most this many lattice units are searched ([Note: shard-size search]).
constexpr std::size_t kMaxLatticeUnits = 32;

// Groups with at most this many count vectors (prod over (numel, block) classes of count + 1)
// also get the exact search ([Note: exact placement] in exact.cpp).
constexpr int64_t kMaxExactStates = 4096;

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
// numel, world_size < 1, align < 1, or sizes whose total overflows int64. `max_exact_states`
// caps the exact search (0 turns it off; tests compare the heuristic orders with it).
Plan plan_layout(const std::vector<int64_t>& numels, const std::vector<int64_t>& block_sizes,
                 int64_t world_size, int64_t align = 1,
                 int64_t max_exact_states = kMaxExactStates);

// The least shard size any layout of the group can have under [Note: planner layout contract]
// ([Note: lower bound] in plan.cpp); the search stops when it reaches it. Same input checks.
int64_t lower_bound(const std::vector<int64_t>& numels, const std::vector<int64_t>& block_sizes,
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
