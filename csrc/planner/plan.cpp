// plan_layout: input checks, the lower bound, the tensor orders, and the search over shard sizes.
//
// [Note: shard-size search]
// Algorithm 1 classifies each tensor of a valid layout as (1) inside one shard, (2) straddling
// one boundary, or (3) containing a whole shard. Tensors of case 3 cross several boundaries, so
// S is a multiple of L = lcm(align, blocks of the case-3 set).
// Call P_L(S) "a layout at S in this order whose case-3 tensors all have blocks dividing L".
// Inserting L elements of padding in every shard, just before the first tensor that starts in
// it, turns a layout at S = k * L into one at (k + 1) * L, so P_L is monotone in k (the
// paper's argument; test_planner_optimality.cpp checks it by brute force). The greedy
// placement decides the looser P(S) ("any layout at S in this order", case 3 wherever the block
// divides S), and P_L(S) implies P(S). smallest_multiple() probes the largest k below the best
// S so far, then the smallest k at the lower bound, then bisects between them, all with P:
// every k it rules out has not P, so not P_L, nor P_L below it, and it ends at a feasible S no
// larger than the least S with P_L (or keeps the best when that is not below it).
// Every layout's case-3 set has some lcm L, so searching every L that is an lcm of align and a
// set of blocks finds the least S of a fixed order exactly. Only tensors with numel >= S can
// hold a shard, so only their blocks count, and only L below the best S: lattice_units()
// builds that closure smallest first. Past kMaxLatticeUnits units it keeps the smallest, which
// ends the exactness, and it always adds the paper's divisor chain (blocks of the tensors
// sorted by numel, largest first), so the search is never worse than the paper's. Lattices run
// coarse to fine: a few placements on a coarse one bring the best down, and then the first
// probe settles most finer lattices. Stopping at the best S is also what keeps LCM explosion
// (Megatron-style chunking) from costing padding or time.
// For the fill orders, chosen while placing, P is not monotone in k and the search is a
// heuristic. For the exact placement ([Note: exact placement] in exact.cpp) P(S) is "some order
// fits at S", and P_L for it is monotone like each order's, so its answer is the least S of
// all layouts.

#include <algorithm>
#include <cstddef>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "planner/exact.h"
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
    auto at = [t] { return "[" + std::to_string(t) + "]"; };
    if (numels[t] < 0) fail("numels" + at() + " must be >= 0, got " + std::to_string(numels[t]));
    if (block_sizes[t] < 1) {
      fail("block_sizes" + at() + " must be >= 1, got " + std::to_string(block_sizes[t]));
    }
    if (numels[t] % block_sizes[t] != 0) {
      fail("block_sizes" + at() + " = " + std::to_string(block_sizes[t]) +
           " does not divide numels" + at() + " = " + std::to_string(numels[t]));
    }
    if (numels[t] > kMax / 2 - total) {
      fail("the total numel overflows int64 at numels" + at() + " = " + std::to_string(numels[t]));
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
    const int64_t top = ceil_div(best, unit) - 1;  // the largest k with k * unit < best
    if (lo > top) return best;
    // The largest candidate first: where it fails, P_L fails at every k below it too, so most
    // orders that cannot beat the best so far cost one placement per lattice. Then the
    // smallest (groups that reach the lower bound stop there), then bisection in between.
    if (!feasible(top * unit)) return best;
    if (lo == top || feasible(lo * unit)) return lo * unit;
    int64_t hi = top;  // feasible
    ++lo;              // lo - 1 is not
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

// lcm(unit, block) if it is below `limit`, else 0 (computed without overflow).
int64_t lcm_below(int64_t unit, int64_t block, int64_t limit) {
  const int64_t factor = block / std::gcd(unit, block);
  return unit <= (limit - 1) / factor ? unit * factor : 0;
}

// The tensors by numel, largest first (then block, largest first): the order of the lower
// bound, the lattice units and the paper's divisor chain.
std::vector<Item> sorted_by_size(std::vector<Item> items) {
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.numel != b.numel ? a.numel > b.numel : a.block > b.block;
  });
  return items;
}

// [Note: lower bound]
// Any layout has S >= ceil(total / m), S >= every non-empty block (a block lies in one shard)
// and S a multiple of align. A tensor longer than 2S holds two rank boundaries S apart, so its
// block divides S. With the tensors sorted by numel, largest first, the ones longer than 2S are
// a prefix; for each prefix the least S consistent with it (a multiple of the lcm of its blocks,
// with the next tensor no longer than 2S, and 2S shorter than the prefix's last tensor) is a
// candidate, and the smallest candidate bounds every layout. benchmarks/planner.py computes the
// same bound independently, in Python.
int64_t bound_of(const std::vector<Item>& by_size, int64_t total, int64_t world_size,
                 int64_t align) {
  if (total == 0) return 0;
  int64_t max_block = 0;
  for (const Item& item : by_size) {
    if (item.numel > 0) max_block = std::max(max_block, item.block);
  }
  const int64_t need = std::max(ceil_div(total, world_size), max_block);
  int64_t best = kMax;
  int64_t unit = align;  // lcm of align and the blocks of the prefix
  int64_t shortest_long = kMax;
  for (std::size_t i = 0; i <= by_size.size(); ++i) {
    const int64_t numel = i < by_size.size() ? by_size[i].numel : 0;  // past the end: no tensor
    const int64_t size = round_up(std::max(need, ceil_div(numel, 2)), unit);
    if (size <= (shortest_long - 1) / 2) best = std::min(best, size);  // 2 * size < shortest
    if (numel == 0) break;
    unit = lcm_below(unit, by_size[i].block, best);
    if (unit == 0) break;  // every longer prefix needs S >= best
    shortest_long = numel;
  }
  return best;
}

// The paper's divisor chain: lcm of align and the blocks of the largest tensors, each < best.
std::vector<int64_t> chain_units(const std::vector<Item>& by_size, int64_t align, int64_t best) {
  std::vector<int64_t> units{align};
  int64_t unit = align;
  for (const Item& item : by_size) {
    unit = lcm_below(unit, item.block, best);
    if (unit == 0) break;  // the lcm reaches best: no multiple can improve
    if (unit != units.back()) units.push_back(unit);
  }
  return units;
}

// Units of the lattices S = k * L in [Note: shard-size search], smallest first, each < best.
std::vector<int64_t> lattice_units(const std::vector<Item>& by_size, int64_t align,
                                   int64_t lower, int64_t best) {
  std::vector<int64_t> blocks;  // of the tensors that can hold a whole shard: numel >= S
  for (const Item& item : by_size) {
    if (item.numel < lower) break;
    if (align % item.block != 0) blocks.push_back(item.block);
  }
  std::sort(blocks.begin(), blocks.end());
  blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
  std::vector<int64_t> units{align};
  for (int64_t block : blocks) {
    const std::size_t known = units.size();
    for (std::size_t i = 0; i < known; ++i) {
      if (const int64_t unit = lcm_below(units[i], block, best)) units.push_back(unit);
    }
    std::sort(units.begin(), units.end());
    units.erase(std::unique(units.begin(), units.end()), units.end());
    if (units.size() > kMaxLatticeUnits) units.resize(kMaxLatticeUnits);
  }
  for (int64_t unit : chain_units(by_size, align, best)) units.push_back(unit);
  std::sort(units.begin(), units.end());
  units.erase(std::unique(units.begin(), units.end()), units.end());
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

// A placement that chooses the order itself: writes the chosen order (indices into the given
// order) and the starts in that order when non-null, or returns kNever.
using ChoosingPlacement = std::function<int64_t(int64_t shard, int64_t limit,
                                                std::vector<int64_t>* chosen,
                                                std::vector<int64_t>* placed)>;

// A Placer over a choosing placement of n tensors: starts come back in input order.
Placer choosing_order(ChoosingPlacement place, std::size_t n) {
  return [place = std::move(place), n](int64_t shard, int64_t limit, std::vector<int64_t>* order,
                                       std::vector<int64_t>* starts) {
    std::vector<int64_t> chosen(starts != nullptr || order != nullptr ? n : 0);
    std::vector<int64_t> placed(starts != nullptr ? n : 0);
    const int64_t end = place(shard, limit, chosen.empty() ? nullptr : &chosen,
                              placed.empty() ? nullptr : &placed);
    if (end == kNever) return end;
    if (order != nullptr) *order = chosen;
    if (starts != nullptr) {
      for (std::size_t i = 0; i < n; ++i) (*starts)[chosen[i]] = placed[i];
    }
    return end;
  };
}

// A placer for a fill order (place_filling), or nullptr when the group has too many classes.
Placer fill_order(const FillClasses& classes, const std::vector<Item>& items, FillRule rule) {
  if (classes.blocked.size() > kMaxFillClasses) return nullptr;
  return choosing_order(
      [&classes, &items, rule](int64_t shard, int64_t limit, std::vector<int64_t>* chosen,
                               std::vector<int64_t>* placed) {
        return place_filling(classes, items, rule, shard, limit, chosen, placed);
      },
      items.size());
}

// A placer for the exact search (ExactPlacer), or nullptr when the group is too large for it.
Placer exact_order(const ExactPlacer& exact, std::size_t n) {
  if (exact.states() == 0) return nullptr;
  return choosing_order(
      [&exact](int64_t shard, int64_t limit, std::vector<int64_t>* chosen,
               std::vector<int64_t>* placed) { return exact.place(shard, limit, chosen, placed); },
      n);
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
    case Order::kFillLarge:
      return "fill_large";
    case Order::kExact:
      return "exact";
  }
  return "unknown";
}

int64_t lower_bound(const std::vector<int64_t>& numels, const std::vector<int64_t>& block_sizes,
                    int64_t world_size, int64_t align) {
  check_inputs(numels, block_sizes, world_size, align);
  std::vector<int64_t> all(numels.size());
  std::iota(all.begin(), all.end(), 0);
  const int64_t total = std::accumulate(numels.begin(), numels.end(), int64_t{0});
  return bound_of(sorted_by_size(items_in(numels, block_sizes, all)), total, world_size, align);
}

Plan plan_layout(const std::vector<int64_t>& numels, const std::vector<int64_t>& block_sizes,
                 int64_t world_size, int64_t align, int64_t max_exact_states) {
  check_inputs(numels, block_sizes, world_size, align);
  const int64_t total = std::accumulate(numels.begin(), numels.end(), int64_t{0});

  Plan plan;
  plan.starts.assign(numels.size(), 0);
  plan.permutation.resize(numels.size());
  std::iota(plan.permutation.begin(), plan.permutation.end(), 0);
  if (total == 0) return plan;  // nothing to place: S = 0, every tensor empty at offset 0

  const std::vector<Item> given = items_in(numels, block_sizes, plan.permutation);
  const std::vector<Item> by_size = sorted_by_size(given);
  const int64_t lower = bound_of(by_size, total, world_size, align);
  // Everything in rank 0's shard never crosses a boundary, so this is always feasible.
  int64_t best = round_up(total, align);
  Placer best_placer = fixed_order(given, plan.permutation);
  const std::vector<int64_t> units = lattice_units(by_size, align, lower, best);

  auto search = [&](const Placer& placer, Order order) {
    const ShardSearch shard_search(placer, world_size, lower);
    for (auto unit = units.rbegin(); unit != units.rend(); ++unit) {
      if (*unit >= best) continue;
      const int64_t found = shard_search.smallest_multiple(*unit, best);
      if (found < best) {
        best = found;
        plan.order = order;
        best_placer = placer;
      }
    }
  };

  std::optional<FillClasses> classes;  // built when the fixed orders leave padding
  std::vector<std::vector<int64_t>> tried;
  for (Order order : {Order::kGiven, Order::kBlockSize, Order::kShape, Order::kFill,
                      Order::kFillLarge}) {
    if (best == lower) break;  // nothing can beat the lower bound
    Placer placer;
    if (order == Order::kFill || order == Order::kFillLarge) {
      if (!classes) classes.emplace(make_fill_classes(given));
      const FillRule rule =
          order == Order::kFill ? FillRule::kLeastPadding : FillRule::kLargeBlocks;
      placer = fill_order(*classes, given, rule);
      if (!placer) continue;
    } else {
      std::vector<int64_t> perm = order_permutation(numels, block_sizes, order);
      if (std::find(tried.begin(), tried.end(), perm) != tried.end()) continue;
      tried.push_back(perm);
      std::vector<Item> items = items_in(numels, block_sizes, perm);
      placer = fixed_order(std::move(items), std::move(perm));
    }
    search(placer, order);
  }
  // Small groups: the exact search over every order, below what the heuristics found.
  std::optional<ExactPlacer> exact;
  if (best != lower && max_exact_states > 0) {
    if (!classes) classes.emplace(make_fill_classes(given));
    exact.emplace(*classes, max_exact_states);
    if (Placer placer = exact_order(*exact, given.size())) search(placer, Order::kExact);
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
