// plan_owners: input checks, the four cost models and the five strategies of
// [Note: matrix owner plan].

#include "optim/owners.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <queue>
#include <sstream>
#include <stdexcept>
#include <utility>

namespace veragged {
namespace optim {

namespace {

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

std::string str(int64_t value) { return std::to_string(value); }

int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

int64_t mul(int64_t a, int64_t b, const std::string& what) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) fail(what + " overflows int64");
  return out;
}

int64_t add(int64_t a, int64_t b, const std::string& what) {
  int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) fail(what + " overflows int64");
  return out;
}

void check_preconditioner(int64_t precondition_frequency, int64_t max_preconditioner_dim) {
  if (precondition_frequency < 1) {
    fail("precondition_frequency must be >= 1, got " + str(precondition_frequency));
  }
  if (max_preconditioner_dim < 1) {
    fail("max_preconditioner_dim must be >= 1, got " + str(max_preconditioner_dim));
  }
}

void check_cost_options(int64_t ns_steps, int64_t precondition_frequency,
                        int64_t max_preconditioner_dim) {
  if (ns_steps < 1) fail("ns_steps must be >= 1, got " + str(ns_steps));
  check_preconditioner(precondition_frequency, max_preconditioner_dim);
}

const char* cost_name(Cost cost) {
  switch (cost) {
    case Cost::kFlops:
      return "flops";
    case Cost::kNumel:
      return "numel";
    case Cost::kShampoo:
      return "shampoo";
    case Cost::kSoap:
      return "soap";
  }
  fail("unknown cost " + str(static_cast<int64_t>(cost)));
}

// Running per-step and refresh sums of one block, checked against int64 overflow; the block's
// cost is per_step + ceil(refresh / f) ([Note: matrix owner plan]).
struct Amortised {
  const std::string& what;
  int64_t per_step = 0;
  int64_t refresh = 0;

  // `count` copies of work costing `step` every step and `once` per refresh.
  void add_work(int64_t count, int64_t step, int64_t once) {
    per_step = add(per_step, mul(count, step, what), what);
    refresh = add(refresh, mul(count, once, what), what);
  }
  int64_t total(int64_t precondition_frequency) const {
    return add(per_step, ceil_div(refresh, precondition_frequency), what);
  }
};

// Blocked Shampoo: the block tiled into at most D x D tiles (torch.split(D) along each dim).
// Tiles come in at most four shapes (full or remainder along each dim), so this is O(1).
int64_t shampoo_cost(int64_t rows, int64_t cols, int64_t f, int64_t dim, const std::string& what) {
  // (tile size, number of tiles) along each dim: the full tiles, then the remainder.
  const std::pair<int64_t, int64_t> row_tiles[2] = {{dim, rows / dim}, {rows % dim, 1}};
  const std::pair<int64_t, int64_t> col_tiles[2] = {{dim, cols / dim}, {cols % dim, 1}};
  Amortised sum{what};
  for (const auto& row : row_tiles) {
    for (const auto& col : col_tiles) {
      const int64_t a = row.first, b = col.first;
      if (a == 0 || b == 0 || row.second == 0 || col.second == 0) continue;
      const int64_t a3 = mul(mul(a, a, what), a, what), b3 = mul(mul(b, b, what), b, what);
      // Per step 4 a b (a + b); per refresh 11 (a^3 + b^3).
      const int64_t step = mul(mul(mul(4, a, what), b, what), add(a, b, what), what);
      const int64_t once = mul(11, add(a3, b3, what), what);
      sum.add_work(mul(row.second, col.second, what), step, once);
    }
  }
  return sum.total(f);
}

// SOAP: each side n <= D (the other side m) is preconditioned whole; with neither, plain Adam.
int64_t soap_cost(int64_t rows, int64_t cols, int64_t f, int64_t dim, const std::string& what) {
  Amortised sum{what};
  bool any = false;
  for (const auto& side : {std::make_pair(rows, cols), std::make_pair(cols, rows)}) {
    const int64_t n = side.first, m = side.second;
    if (n > dim) continue;
    any = true;
    const int64_t n2m = mul(mul(n, n, what), m, what);
    // Per step 6 n^2 m; per refresh 9 n^3 + 4 n^2 m.
    const int64_t once = add(mul(9, mul(mul(n, n, what), n, what), what), mul(4, n2m, what), what);
    sum.add_work(1, mul(6, n2m, what), once);
  }
  return any ? sum.total(f) : mul(rows, cols, what);
}

void check_inputs(const std::vector<std::vector<Block>>& matrices,
                  const std::vector<int64_t>& buckets, int64_t world_size,
                  const OwnerOptions& options) {
  if (world_size < 1) fail("world_size must be >= 1, got " + str(world_size));
  if (!(options.alpha >= 0.0 && options.alpha <= 1.0)) {  // also rejects NaN
    std::ostringstream message;
    message << "alpha must be in [0, 1], got " << options.alpha;
    fail(message.str());
  }
  check_cost_options(options.ns_steps, options.precondition_frequency,
                     options.max_preconditioner_dim);
  if (!buckets.empty() && buckets.size() != matrices.size()) {
    fail("buckets must be empty or have one id per matrix, got " + str(buckets.size()) +
         " ids for " + str(matrices.size()) + " matrices");
  }
  for (std::size_t i = 0; i < buckets.size(); ++i) {
    if (buckets[i] < 0) fail("buckets[" + str(i) + "] must be >= 0, got " + str(buckets[i]));
  }
  if (!(options.locality_slack >= 0.0)) {  // also rejects NaN
    std::ostringstream message;
    message << "locality_slack must be >= 0, got " << options.locality_slack;
    fail(message.str());
  }
  const std::size_t n = matrices.size(), world = static_cast<std::size_t>(world_size);
  if (!options.held.empty() && options.held.size() != n * world) {
    fail("held must be empty or have world_size entries per matrix (" + str(n * world) +
         "), got " + str(options.held.size()));
  }
}

// Per-rank totals of an owner assignment.
std::vector<int64_t> rank_loads(const std::vector<int64_t>& owners,
                                const std::vector<int64_t>& costs, int64_t world_size) {
  std::vector<int64_t> loads(static_cast<std::size_t>(world_size), 0);
  for (std::size_t i = 0; i < owners.size(); ++i) loads[owners[i]] += costs[i];
  return loads;  // no overflow: matrix_costs checked the grand total
}

// Elements per matrix: the sum of its row blocks' rows * cols.
std::vector<int64_t> matrix_numels(const std::vector<std::vector<Block>>& matrices) {
  std::vector<int64_t> numels;
  for (std::size_t i = 0; i < matrices.size(); ++i) {
    int64_t sum = 0;
    for (const Block& b : matrices[i]) {
      sum = add(sum, mul(b.rows, b.cols, "the numel of matrix " + str(i)),
                "the numel of matrix " + str(i));
    }
    numels.push_back(sum);
  }
  return numels;
}

void check_held(const std::vector<int64_t>& held, const std::vector<int64_t>& numels,
                int64_t world_size) {
  for (std::size_t i = 0; i < numels.size(); ++i) {
    for (int64_t r = 0; r < world_size; ++r) {
      const int64_t h = held[i * static_cast<std::size_t>(world_size) + r];
      if (h < 0 || h > numels[i]) {
        fail("held[" + str(i) + "][" + str(r) + "] = " + str(h) + " must be in [0, " +
             str(numels[i]) + "] (the numel of matrix " + str(i) + ")");
      }
    }
  }
}

// lpt's micro-groups over an assignment: `order` joins the current group while the cost every
// rank gains within it stays <= capacity (<= 0: the default max(largest cost,
// ceil(total / world / 4))); otherwise the group closes (rollback) and the item opens the next
// one. Returns the capacity used.
int64_t capacity_groups(const std::vector<int64_t>& order, const std::vector<int64_t>& owners,
                        const std::vector<int64_t>& costs, int64_t world_size, int64_t capacity,
                        std::vector<std::vector<int64_t>>& groups) {
  int64_t total = 0, largest = 0;
  for (int64_t c : costs) total += c, largest = std::max(largest, c);
  if (capacity <= 0) capacity = std::max(largest, ceil_div(ceil_div(total, world_size), 4));
  std::vector<int64_t> gained(static_cast<std::size_t>(world_size), 0);
  int64_t group_max = 0;
  for (int64_t item : order) {
    const int64_t rank = owners[item], cost = costs[item];
    if (!groups.empty() && std::max(group_max, gained[rank] + cost) > capacity) {
      groups.emplace_back();
      std::fill(gained.begin(), gained.end(), 0);
      group_max = 0;
    }
    if (groups.empty()) groups.emplace_back();
    groups.back().push_back(item);
    gained[rank] += cost;
    group_max = std::max(group_max, gained[rank]);
  }
  return capacity;
}

// Matrix indices by cost descending, ties to the lower index (lpt's order).
std::vector<int64_t> cost_order(const std::vector<int64_t>& costs) {
  std::vector<int64_t> order(costs.size());
  for (std::size_t i = 0; i < costs.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return costs[a] != costs[b] ? costs[a] > costs[b] : a < b;
  });
  return order;
}

OwnerPlan plan_lpt(const std::vector<int64_t>& costs, int64_t world_size, int64_t capacity) {
  const std::vector<int64_t> order = cost_order(costs);
  OwnerPlan plan;
  plan.owners.assign(costs.size(), 0);
  // Total load per rank, carried across micro-groups; the heap's top is the least loaded rank,
  // the lower rank on ties. The micro-groups (capacity_groups) close in the same order and never
  // change an owner, so they are cut after the assignment.
  using Slot = std::pair<int64_t, int64_t>;  // (load, rank)
  std::priority_queue<Slot, std::vector<Slot>, std::greater<Slot>> heap;
  for (int64_t r = 0; r < world_size; ++r) heap.push({0, r});
  for (int64_t item : order) {
    const Slot slot = heap.top();
    heap.pop();
    plan.owners[item] = slot.second;
    heap.push({slot.first + costs[item], slot.second});
  }
  plan.capacity = capacity_groups(order, plan.owners, costs, world_size, capacity, plan.groups);
  plan.loads = rank_loads(plan.owners, costs, world_size);
  return plan;
}

OwnerPlan plan_local(const std::vector<int64_t>& costs, const std::vector<int64_t>& numels,
                     const std::vector<int64_t>& held, int64_t world_size, int64_t capacity,
                     double slack) {
  const std::size_t n = costs.size(), world = static_cast<std::size_t>(world_size);
  auto holds = [&](std::size_t i, int64_t r) -> int64_t {
    return held.empty() ? 0 : held[i * world + static_cast<std::size_t>(r)];
  };
  // 1. Every matrix one rank holds whole is owned there.
  std::vector<int64_t> owners(n, -1), loads(world, 0);
  std::vector<char> at_home(n, 0);
  for (std::size_t i = 0; i < n; ++i) {
    if (numels[i] == 0) continue;
    for (int64_t r = 0; r < world_size; ++r) {
      if (holds(i, r) == numels[i]) {
        owners[i] = r, at_home[i] = 1, loads[r] += costs[i];
        break;
      }
    }
  }
  // 2. The others by LPT around them: cost descending (ties: lower index), each to the least
  //    loaded rank (ties: the rank holding more of it, then the lower rank).
  const std::vector<int64_t> order = cost_order(costs);
  for (int64_t item : order) {
    if (owners[item] >= 0) continue;
    int64_t best = 0;
    for (int64_t r = 1; r < world_size; ++r) {
      const bool tie = loads[r] == loads[best];
      if (loads[r] < loads[best] || (tie && holds(item, r) > holds(item, best))) {
        best = r;
      }
    }
    owners[item] = best;
    loads[best] += costs[item];
  }
  // 3. While the most loaded rank m (ties: lower rank) is above what lpt reaches plus
  //    delta = floor(slack * ceil(total / world)), move one of its matrices to the least
  //    loaded rank l (ties: lower rank): the first, travelling before at home, cost
  //    descending, lower index, with load[l] + c < load[m] (each move lowers the sum of
  //    squared loads, so this ends); none: stop.
  OwnerPlan lpt = plan_lpt(costs, world_size, capacity);
  const std::vector<int64_t>& lpt_loads = lpt.loads;
  int64_t total = 0;
  for (int64_t c : costs) total += c;
  const double extra = std::floor(slack * static_cast<double>(ceil_div(total, world_size)));
  const int64_t lpt_max = lpt_loads.empty() ? 0 : *std::max_element(lpt_loads.begin(),
                                                                     lpt_loads.end());
  const int64_t target = extra >= 9.2e18 ? INT64_MAX
                                         : add(lpt_max, static_cast<int64_t>(extra), "the bound");
  std::vector<int64_t> movable = order;
  std::stable_sort(movable.begin(), movable.end(),
                   [&](int64_t a, int64_t b) { return at_home[a] < at_home[b]; });
  while (true) {
    const auto m = std::max_element(loads.begin(), loads.end()) - loads.begin();
    if (loads[m] <= target) break;
    const auto l = std::min_element(loads.begin(), loads.end()) - loads.begin();
    int64_t chosen = -1;
    for (int64_t item : movable) {
      if (owners[item] == m && costs[item] > 0 && loads[l] + costs[item] < loads[m]) {
        chosen = item;
        break;
      }
    }
    if (chosen < 0) break;
    owners[chosen] = l, at_home[chosen] = 0;
    loads[m] -= costs[chosen], loads[l] += costs[chosen];
  }
  // 4. Still above the bound (single moves could not get there): lpt's plan.
  if (!loads.empty() && *std::max_element(loads.begin(), loads.end()) > target) return lpt;
  OwnerPlan plan;
  plan.owners = std::move(owners);
  plan.capacity = capacity_groups(order, plan.owners, costs, world_size, capacity, plan.groups);
  plan.loads = rank_loads(plan.owners, costs, world_size);
  return plan;
}

OwnerPlan plan_naive(const std::vector<int64_t>& costs, int64_t world_size) {
  OwnerPlan plan;
  const int64_t n = static_cast<int64_t>(costs.size());
  for (int64_t i = 0; i < n; ++i) {
    plan.owners.push_back(i % world_size);
    if (i % world_size == 0) plan.groups.emplace_back();
    plan.groups.back().push_back(i);
  }
  plan.loads = rank_loads(plan.owners, costs, world_size);
  return plan;
}

// The closest boundary u in [lo, n] to the cumulative target `target`, where prefix[u] is the
// cost of the bucket's first u matrices (non-decreasing); ties go to the earlier boundary.
std::size_t closest_cut(const std::vector<int64_t>& prefix, std::size_t lo, double target) {
  const auto first = prefix.begin() + static_cast<std::ptrdiff_t>(lo);
  const auto above = std::upper_bound(first, prefix.end(), target, [](double t, int64_t p) {
    return t < static_cast<double>(p);
  });
  if (above == first) return lo;  // every boundary is past the target: the earliest is closest
  // The earliest boundary with the largest cumulative cost <= target.
  const auto below = std::lower_bound(first, above, *(above - 1));
  const std::size_t u_below = static_cast<std::size_t>(below - prefix.begin());
  if (above == prefix.end()) return u_below;
  const double d_below = target - static_cast<double>(*below);
  const double d_above = static_cast<double>(*above) - target;
  return d_below <= d_above ? u_below : static_cast<std::size_t>(above - prefix.begin());
}

OwnerPlan plan_alpha(const std::vector<int64_t>& costs, const std::vector<int64_t>& buckets,
                     int64_t world_size, double alpha) {
  const std::size_t n = costs.size();
  const std::size_t world = static_cast<std::size_t>(world_size);
  std::map<int64_t, std::vector<int64_t>> members;  // bucket id -> matrices in input order
  for (std::size_t i = 0; i < n; ++i) {
    members[buckets.empty() ? 0 : buckets[i]].push_back(static_cast<int64_t>(i));
  }
  struct Bucket {
    int64_t id;
    int64_t load;
  };
  std::vector<Bucket> by_load;
  int64_t total = 0;
  for (const auto& entry : members) {
    int64_t load = 0;
    for (int64_t i : entry.second) load += costs[i];
    by_load.push_back({entry.first, load});
    total += load;
  }
  std::sort(by_load.begin(), by_load.end(), [](const Bucket& a, const Bucket& b) {
    return a.load != b.load ? a.load > b.load : a.id < b.id;
  });

  OwnerPlan plan;
  plan.owners.assign(n, 0);
  std::vector<int64_t> loads(world, 0);
  const double mean = static_cast<double>(total) / static_cast<double>(world_size);
  const double even = 1.0 / static_cast<double>(world_size);
  std::vector<double> deficit(world);
  for (const Bucket& bucket : by_load) {
    const std::vector<int64_t>& items = members[bucket.id];
    double deficit_total = 0.0;
    for (std::size_t r = 0; r < world; ++r) {
      deficit[r] = std::max(0.0, mean - static_cast<double>(loads[r]));
      deficit_total += deficit[r];
    }
    std::vector<int64_t> prefix(items.size() + 1, 0);
    for (std::size_t k = 0; k < items.size(); ++k) prefix[k + 1] = prefix[k] + costs[items[k]];
    double target = 0.0;  // cumulative target load of ranks 0..r
    std::size_t start = 0;
    for (std::size_t r = 0; r < world; ++r) {
      std::size_t end = items.size();  // the last rank takes the rest
      if (r + 1 < world) {
        const double fill = deficit_total > 0.0 ? deficit[r] / deficit_total : even;
        target += static_cast<double>(bucket.load) * ((1.0 - alpha) * even + alpha * fill);
        end = closest_cut(prefix, start, target);
      }
      for (std::size_t k = start; k < end; ++k) plan.owners[items[k]] = static_cast<int64_t>(r);
      loads[r] += prefix[end] - prefix[start];
      start = end;
    }
  }
  for (const auto& entry : members) plan.groups.push_back(entry.second);
  plan.loads = std::move(loads);
  return plan;
}

// Layer-wise: each bucket whole on one rank, buckets by LPT over their total costs.
OwnerPlan plan_layer(const std::vector<int64_t>& costs, const std::vector<int64_t>& buckets,
                     int64_t world_size) {
  const std::size_t n = costs.size();
  std::map<int64_t, std::pair<int64_t, std::vector<int64_t>>> members;  // id -> (load, matrices)
  for (std::size_t i = 0; i < n; ++i) {
    auto& bucket = members[buckets.empty() ? static_cast<int64_t>(i) : buckets[i]];
    bucket.first += costs[i];  // no overflow: matrix_costs checked the grand total
    bucket.second.push_back(static_cast<int64_t>(i));
  }
  std::vector<std::pair<int64_t, int64_t>> order;  // (load, id)
  for (const auto& entry : members) order.push_back({entry.second.first, entry.first});
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  using Slot = std::pair<int64_t, int64_t>;  // (load, rank): least loaded, then lower rank
  std::priority_queue<Slot, std::vector<Slot>, std::greater<Slot>> heap;
  for (int64_t r = 0; r < world_size; ++r) heap.push({0, r});
  OwnerPlan plan;
  plan.owners.assign(n, 0);
  for (const auto& bucket : order) {
    const Slot slot = heap.top();
    heap.pop();
    for (int64_t i : members[bucket.second].second) plan.owners[i] = slot.second;
    heap.push({slot.first + bucket.first, slot.second});
  }
  if (n > 0) {
    plan.groups.emplace_back(n);
    for (std::size_t i = 0; i < n; ++i) plan.groups[0][i] = static_cast<int64_t>(i);
  }
  plan.loads = rank_loads(plan.owners, costs, world_size);
  return plan;
}

}  // namespace

Strategy parse_strategy(const std::string& name) {
  if (name == "naive") return Strategy::kNaive;
  if (name == "lpt") return Strategy::kLpt;
  if (name == "alpha") return Strategy::kAlpha;
  if (name == "layer") return Strategy::kLayer;
  if (name == "local") return Strategy::kLocal;
  fail("unknown strategy '" + name + "' (expected naive, lpt, alpha, layer or local)");
}

Cost parse_cost(const std::string& name) {
  if (name == "flops") return Cost::kFlops;
  if (name == "numel") return Cost::kNumel;
  if (name == "shampoo") return Cost::kShampoo;
  if (name == "soap") return Cost::kSoap;
  fail("unknown cost '" + name + "' (expected flops, numel, shampoo or soap)");
}

double OwnerPlan::ratio() const {
  int64_t total = 0, largest = 0;
  for (int64_t load : loads) total += load, largest = std::max(largest, load);
  if (total == 0) return 1.0;
  return static_cast<double>(largest) * static_cast<double>(loads.size()) /
         static_cast<double>(total);
}

int64_t block_cost(const Block& block, Cost cost, int64_t ns_steps, int64_t precondition_frequency,
                   int64_t max_preconditioner_dim) {
  if (block.rows < 0) fail("rows must be >= 0, got " + str(block.rows));
  if (block.cols < 0) fail("cols must be >= 0, got " + str(block.cols));
  check_preconditioner(precondition_frequency, max_preconditioner_dim);
  const std::string what = "the " + std::string(cost_name(cost)) + " cost of a " + str(block.rows) +
                           "x" + str(block.cols) + " block";
  if (block.rows == 0 || block.cols == 0) return 0;
  switch (cost) {
    case Cost::kNumel:
      return mul(block.rows, block.cols, what);
    case Cost::kShampoo:
      return shampoo_cost(block.rows, block.cols, precondition_frequency, max_preconditioner_dim,
                          what);
    case Cost::kSoap:
      return soap_cost(block.rows, block.cols, precondition_frequency, max_preconditioner_dim,
                       what);
    case Cost::kFlops:
      break;
  }
  const int64_t s = std::min(block.rows, block.cols), l = std::max(block.rows, block.cols);
  const int64_t s2 = mul(s, s, what);
  const int64_t step = add(mul(mul(4, s2, what), l, what), mul(mul(2, s2, what), s, what), what);
  return mul(ns_steps, step, what);
}

std::vector<int64_t> matrix_costs(const std::vector<std::vector<Block>>& matrices, Cost cost,
                                  int64_t ns_steps, int64_t precondition_frequency,
                                  int64_t max_preconditioner_dim) {
  check_cost_options(ns_steps, precondition_frequency, max_preconditioner_dim);
  std::vector<int64_t> costs;
  int64_t total = 0;
  for (std::size_t i = 0; i < matrices.size(); ++i) {
    const std::string at = "matrices[" + str(i) + "]";
    if (matrices[i].empty()) fail(at + " has no blocks");
    int64_t sum = 0;
    for (std::size_t b = 0; b < matrices[i].size(); ++b) {
      int64_t c = 0;
      try {
        c = block_cost(matrices[i][b], cost, ns_steps, precondition_frequency,
                       max_preconditioner_dim);
      } catch (const std::invalid_argument& error) {
        fail(at + " block " + str(b) + ": " + error.what());
      }
      sum = add(sum, c, "the cost of " + at);
    }
    total = add(total, sum, "the total cost at " + at);
    costs.push_back(sum);
  }
  return costs;
}

OwnerPlan plan_owners(const std::vector<std::vector<Block>>& matrices,
                      const std::vector<int64_t>& buckets, int64_t world_size,
                      const OwnerOptions& options) {
  check_inputs(matrices, buckets, world_size, options);
  const std::vector<int64_t> costs =
      matrix_costs(matrices, options.cost, options.ns_steps, options.precondition_frequency,
                   options.max_preconditioner_dim);
  const std::vector<int64_t> numels = matrix_numels(matrices);
  if (!options.held.empty()) check_held(options.held, numels, world_size);
  OwnerPlan plan;
  switch (options.strategy) {
    case Strategy::kNaive:
      plan = plan_naive(costs, world_size);
      break;
    case Strategy::kLpt:
      plan = plan_lpt(costs, world_size, options.capacity);
      break;
    case Strategy::kAlpha:
      plan = plan_alpha(costs, buckets, world_size, options.alpha);
      break;
    case Strategy::kLayer:
      plan = plan_layer(costs, buckets, world_size);
      break;
    case Strategy::kLocal:
      plan = plan_local(costs, numels, options.held, world_size, options.capacity,
                        options.locality_slack);
      break;
    default:
      fail("unknown strategy " + str(static_cast<int64_t>(options.strategy)));
  }
  if (!options.held.empty()) {
    const std::size_t world = static_cast<std::size_t>(world_size);
    plan.moved = 0;
    for (std::size_t i = 0; i < numels.size(); ++i) {
      const int64_t here = options.held[i * world + static_cast<std::size_t>(plan.owners[i])];
      plan.moved = add(plan.moved, numels[i] - here, "the moved elements");
    }
  }
  return plan;
}

}  // namespace optim
}  // namespace veragged
