// plan_layout: input checks, the three tensor orders, and the search over shard sizes.
//
// [Note: shard-size search]
// Algorithm 1 classifies each tensor of a valid layout as (1) inside one shard, (2) straddling
// one boundary, or (3) containing a whole shard. Tensors of case 3 cross several boundaries, so
// S must be a multiple of their blocks: S is a multiple of L = lcm(align, blocks of the case-3
// set). Enumerating case-3 sets is exponential; like the paper we take only prefixes of the
// tensors sorted by numel (largest first, since only large tensors can contain a shard), so L
// runs through a divisor chain with at most ~63 distinct values. Per L, feasibility is treated
// as monotone in k for S = k * L and the smallest feasible k is found by galloping up from the
// lower bound and then bisecting; every answer is a greedy placement that succeeded, so it is
// always valid even where monotonicity fails. The chain stops once L reaches the best S found:
// this is what keeps LCM explosion (Megatron-style chunking) from costing padding or time.

#include <algorithm>
#include <cstddef>
#include <functional>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>

#include "planner/greedy.h"
#include "planner/planner.h"

namespace veragged {
namespace planner {

namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

// Smallest multiple of `unit` that is >= value, or kMax on overflow.
int64_t round_up(int64_t value, int64_t unit) {
  const int64_t k = ceil_div(value, unit);
  return k > kMax / unit ? kMax : k * unit;
}

// m * S, saturated: positions never exceed it, so saturation only loosens an unreachable bound.
int64_t buffer_end(int64_t world_size, int64_t shard) {
  return shard > kMax / world_size ? kMax : world_size * shard;
}

void check_inputs(const std::vector<int64_t>& numels, const std::vector<int64_t>& block_sizes,
                  int64_t world_size, int64_t align) {
  if (numels.size() != block_sizes.size()) {
    fail("numels and block_sizes must have the same length, got " +
         std::to_string(numels.size()) + " and " + std::to_string(block_sizes.size()));
  }
  if (world_size < 1) fail("world_size must be >= 1, got " + std::to_string(world_size));
  if (align < 1) fail("align must be >= 1, got " + std::to_string(align));
  int64_t total = 0;
  for (size_t t = 0; t < numels.size(); ++t) {
    const std::string at = "[" + std::to_string(t) + "]";
    if (numels[t] < 0) fail("numels" + at + " must be >= 0, got " + std::to_string(numels[t]));
    if (block_sizes[t] < 1) {
      fail("block_sizes" + at + " must be >= 1, got " + std::to_string(block_sizes[t]));
    }
    if (numels[t] % block_sizes[t] != 0) {
      fail("block_sizes" + at + " = " + std::to_string(block_sizes[t]) +
           " does not divide numels" + at + " = " + std::to_string(numels[t]));
    }
    if (numels[t] > kMax / 2 - total) {
      fail("the total numel overflows int64 at numels" + at + " = " + std::to_string(numels[t]));
    }
    total += numels[t];
  }
}

// Places the group at a given shard size: returns the end of the placement or kNever, and with
// non-null outputs, the buffer order (input indices) and each input tensor's start.
using Placer = std::function<int64_t(int64_t shard, int64_t limit, std::vector<int64_t>* order,
                                     std::vector<int64_t>* starts)>;

// The smallest shard size found for one tensor order, searching only below `best`.
class ShardSearch {
 public:
  ShardSearch(Placer placer, int64_t world_size, int64_t lower)
      : placer_(std::move(placer)), world_size_(world_size), lower_(lower) {}

  bool feasible(int64_t shard) const {
    return placer_(shard, buffer_end(world_size_, shard), nullptr, nullptr) != kNever;
  }

  // Smallest feasible multiple of `unit` below `best`, or `best` if none is found.
  int64_t smallest_multiple(int64_t unit, int64_t best) const {
    int64_t lo = ceil_div(lower_, unit);  // first candidate k, feasibility unknown
    const int64_t k_best = ceil_div(best, unit);  // k * unit >= best for k >= k_best
    if (lo >= k_best) return best;
    // Gallop: lo stays the smallest k not yet known infeasible, hi the first feasible found.
    int64_t step = 1;
    int64_t hi = lo;
    while (!feasible(hi * unit)) {
      lo = hi + 1;
      if (hi + step >= k_best) return best;
      hi += step;
      step *= 2;
    }
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (feasible(mid * unit)) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    return hi * unit;
  }

 private:
  Placer placer_;
  int64_t world_size_;
  int64_t lower_;
};

// Units of the lattices S = k * L in [Note: shard-size search], smallest first, each < best.
std::vector<int64_t> lattice_units(std::vector<Item> items, int64_t align, int64_t best) {
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.numel != b.numel ? a.numel > b.numel : a.block > b.block;
  });
  std::vector<int64_t> units{align};
  int64_t unit = align;
  for (const Item& item : items) {
    const int64_t factor = item.block / std::gcd(unit, item.block);
    if (unit > (best - 1) / factor) break;  // the lcm reaches best: no multiple can improve
    unit *= factor;
    if (unit != units.back()) units.push_back(unit);
  }
  return units;
}

std::vector<Item> items_in(const std::vector<int64_t>& numels,
                           const std::vector<int64_t>& block_sizes,
                           const std::vector<int64_t>& perm) {
  std::vector<Item> items(perm.size());
  for (std::size_t i = 0; i < perm.size(); ++i) {
    items[i] = {numels[perm[i]], block_sizes[perm[i]]};
  }
  return items;
}

// A placer for one fixed order `perm` of the input tensors.
Placer fixed_order(std::vector<Item> items, std::vector<int64_t> perm) {
  return [items = std::move(items), perm = std::move(perm)](
             int64_t shard, int64_t limit, std::vector<int64_t>* order,
             std::vector<int64_t>* starts) {
    std::vector<int64_t> placed(starts != nullptr ? items.size() : 0);
    const int64_t end = place_greedy(items, shard, limit, starts != nullptr ? &placed : nullptr);
    if (order != nullptr) *order = perm;
    if (starts != nullptr) {
      for (std::size_t i = 0; i < perm.size(); ++i) (*starts)[perm[i]] = placed[i];
    }
    return end;
  };
}

// A placer for the fill order (place_filling), or nullptr when the group has too many classes.
Placer fill_order(const std::vector<Item>& items) {
  FillClasses classes = make_fill_classes(items);
  if (classes.kinds.size() > kMaxFillClasses) return nullptr;
  return [classes = std::move(classes), n = items.size()](
             int64_t shard, int64_t limit, std::vector<int64_t>* order,
             std::vector<int64_t>* starts) {
    std::vector<int64_t> chosen(starts != nullptr || order != nullptr ? n : 0);
    std::vector<int64_t> placed(starts != nullptr ? n : 0);
    const int64_t end = place_filling(classes, shard, limit, chosen.empty() ? nullptr : &chosen,
                                      placed.empty() ? nullptr : &placed);
    if (order != nullptr) *order = chosen;
    if (starts != nullptr) {
      for (std::size_t i = 0; i < n; ++i) (*starts)[chosen[i]] = placed[i];
    }
    return end;
  };
}

std::vector<int64_t> order_permutation(const std::vector<int64_t>& numels,
                                       const std::vector<int64_t>& block_sizes, Order order) {
  std::vector<int64_t> perm(numels.size());
  std::iota(perm.begin(), perm.end(), 0);
  if (order == Order::kBlockSize) {
    std::stable_sort(perm.begin(), perm.end(),
                     [&](int64_t a, int64_t b) { return block_sizes[a] > block_sizes[b]; });
  } else if (order == Order::kShape) {
    std::stable_sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) {
      if (block_sizes[a] != block_sizes[b]) return block_sizes[a] > block_sizes[b];
      return numels[a] > numels[b];
    });
  }
  return perm;
}

}  // namespace

const char* order_name(Order order) {
  switch (order) {
    case Order::kGiven:
      return "given";
    case Order::kBlockSize:
      return "block_size";
    case Order::kShape:
      return "shape";
    case Order::kFill:
      return "fill";
  }
  return "unknown";
}

Plan plan_layout(const std::vector<int64_t>& numels, const std::vector<int64_t>& block_sizes,
                 int64_t world_size, int64_t align) {
  check_inputs(numels, block_sizes, world_size, align);
  const int64_t total = std::accumulate(numels.begin(), numels.end(), int64_t{0});
  int64_t max_block = 0;  // a block lies inside one shard, so S >= every non-empty block
  for (std::size_t t = 0; t < numels.size(); ++t) {
    if (numels[t] > 0) max_block = std::max(max_block, block_sizes[t]);
  }

  Plan plan;
  plan.starts.assign(numels.size(), 0);
  plan.permutation.resize(numels.size());
  std::iota(plan.permutation.begin(), plan.permutation.end(), 0);
  if (total == 0) return plan;  // nothing to place: S = 0, every tensor empty at offset 0

  const int64_t lower = round_up(std::max(ceil_div(total, world_size), max_block), align);
  // Everything in rank 0's shard never crosses a boundary, so this is always feasible.
  int64_t best = round_up(total, align);
  const std::vector<Item> given = items_in(numels, block_sizes, plan.permutation);
  Placer best_placer = fixed_order(given, plan.permutation);
  const std::vector<int64_t> units = lattice_units(given, align, best);

  std::vector<std::vector<int64_t>> tried;
  for (Order order : {Order::kGiven, Order::kBlockSize, Order::kShape, Order::kFill}) {
    if (best == lower) break;  // nothing can beat the lower bound
    Placer placer;
    if (order == Order::kFill) {
      placer = fill_order(given);
      if (!placer) continue;
    } else {
      std::vector<int64_t> perm = order_permutation(numels, block_sizes, order);
      if (std::find(tried.begin(), tried.end(), perm) != tried.end()) continue;
      tried.push_back(perm);
      std::vector<Item> items = items_in(numels, block_sizes, perm);
      placer = fixed_order(std::move(items), std::move(perm));
    }
    const ShardSearch search(placer, world_size, lower);
    for (int64_t unit : units) {
      if (unit >= best) break;
      const int64_t found = search.smallest_multiple(unit, best);
      if (found < best) {
        best = found;
        plan.order = order;
        best_placer = placer;
      }
    }
  }

  if (best > kMax / world_size) {
    fail("the buffer of world_size = " + std::to_string(world_size) + " shards of " +
         std::to_string(best) + " elements overflows int64");
  }
  best_placer(best, buffer_end(world_size, best), &plan.permutation, &plan.starts);
  plan.shard_size = best;
  plan.padding = world_size * best - total;
  return plan;
}

}  // namespace planner
}  // namespace veragged
