// Owner plan for distributed matrix optimizers (Muon, Shampoo, SOAP): which rank computes the
// update of each whole 2-D matrix, and in which micro-groups the matrices are gathered, computed
// and scattered back (Canzona, arXiv 2602.06079).
//
// Pure C++17: no torch headers, so the same code builds into veragged._C and into the
// GoogleTest binary under tests/cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace veragged {
namespace optim {

// [Note: matrix owner plan]
// A distributed matrix optimizer (Muon, Shampoo, SOAP) gathers every 2-D matrix whole onto one
// owner rank, computes its update there and sends it back. Every rank computes the plan itself,
// so it must be bit-identical everywhere: costs are int64, orders are total (ties broken by index
// or rank), and the only floating point (alpha's targets) is a fixed sequence of IEEE operations
// compared exactly.
//
// Input: per matrix a list of row blocks (rows, cols). A fused matrix (QKV split into q, k, v)
// is one matrix with several blocks: each block is orthogonalised (or preconditioned)
// separately, but the matrix has one owner. Its cost is the sum over its blocks of one of four
// models (Canzona appendix D.5: a cost model per optimizer, its periodic work amortised over the
// update frequency). A block with rows == 0 or cols == 0 costs 0 under every model. Below, r x c
// is the block, D is max_preconditioner_dim, f is precondition_frequency, and "amortised" means
// per_step + ceil(refresh / f), with refresh summed over the whole block first and divided once
// (all of a block's factors are refreshed on the same step; the models stay exact integers, and
// f = 1 is the plain sum).
//   flops   (Muon) ns_steps * (4 s^2 l + 2 s^3), s = min(r, c), l = max(r, c): per Newton-Schulz
//           step A = X X^T (2 s^2 l), A @ A (2 s^3) and B @ X (2 s^2 l) on the s-by-l
//           orientation.
//   numel   r * c: communication volume, or any elementwise optimizer.
//   shampoo Blocked Shampoo: the block is tiled into tiles of at most D x D (along each dim
//           D, D, ..., remainder, as torch.split(D)), each tile a x b with its own factors
//           L (a x a) and R (b x b). Per tile, per step 4 a b (a + b): the factor updates
//           G G^T and G^T G (2 a b (a + b)) and applying L^-1/4 G R^-1/4 (2 a b (a + b));
//           per refresh 11 (a^3 + b^3): a symmetric eigendecomposition (~9 n^3) and forming
//           Q diag(lambda^-1/4) Q^T (~2 n^3) per factor. Amortised over the tiles' sums.
//   soap    SOAP (Adam in Shampoo's eigenbasis) does not tile: a side of size n is
//           preconditioned only if n <= D (a larger side stays in the identity basis). Per
//           preconditioned side of size n, with m the other dim: per step 6 n^2 m (the factor
//           update G G^T, projecting the gradient into the eigenbasis and the update back out);
//           per refresh 9 n^3 + 4 n^2 m (one power iteration L @ Q, 2 n^3; the estimated
//           eigenvalues Q^T L Q, 4 n^3; QR, ~3 n^3; rotating the first moment out of the old
//           basis and into the new one, 4 n^2 m). Amortised over the sides' sums. With neither
//           side preconditioned the block is plain Adam, and its elementwise work is all that
//           is left: r * c.
// Otherwise the elementwise work (momentum, Adam's moments) is left out of
// flops, shampoo and soap: it is linear in r * c and small beside the matrix products. The
// precondition_frequency and max_preconditioner_dim options change only shampoo and soap, so
// flops and numel plans (Muon's) do not depend on them.
// Output: the owner of each matrix, micro-groups (lists of matrix indices in execution order,
// each matrix in exactly one), the per-rank total loads and max/mean.
//
// Strategies:
//   naive  matrix i -> rank i % world in input order (Keller Jordan's Muon); one micro-group per
//          `world` consecutive matrices.
//   lpt    Canzona Algorithm 3 + 4 with carried loads. Matrices are sorted by cost descending,
//          ties by index. Each goes to the rank of least total load (min-heap of (load, rank),
//          so ties go to the lower rank): the heap is seeded with the loads of earlier
//          micro-groups, so the owners are exactly global LPT (max <= (4/3 - 1/(3 world)) OPT).
//          A matrix joins the current micro-group while the load every rank gains *within the
//          group* stays <= capacity; otherwise the group is closed (rollback) and the matrix
//          opens the next one. The paper's MinHeapSolver re-sorts and re-solves the group on
//          every addition; items arrive in the solver's own order (cost descending), so that is
//          the same as placing just the new item, which is what we do (O(n log world) total).
//          A matrix above capacity on its own forms a group alone rather than raising (the
//          paper raises): a plan always exists. capacity <= 0 picks the default
//          max(largest matrix cost, ceil(total / world / 4)), so no matrix is oversize and a
//          plan has about four or more micro-groups to pipeline.
//   alpha  Canzona Algorithm 1 (alpha-balanced static partitioning). Matrices with the same
//          bucket id form a bucket, kept in input order; buckets are processed by total cost
//          descending (ties: lower id). With mu = total / world and deficits
//          d_r = max(0, mu - L_r), the bucket's target share is
//          v* = (1 - alpha) / world + alpha * d / sum(d) (even when sum(d) == 0); rank r
//          (in rank order) gets a contiguous run of the bucket ending at the matrix boundary
//          whose cumulative cost is closest to the cumulative target (ties: the earlier
//          boundary; never before the previous cut). alpha = 1 balances compute, alpha = 0
//          cuts every bucket evenly (ZeRO-1 communication balance). One micro-group per
//          non-empty bucket, in ascending bucket id, members in input order; capacity unused.
//   layer  The layer-wise baseline (NVIDIA's layer-wise distributed optimizer, Distributed
//          Shampoo's per-parameter assignment): each bucket (a layer, or a parameter group)
//          goes whole to one rank. Buckets are placed by greedy LPT over their total costs:
//          largest total first (ties: lower bucket id), each to the least loaded rank (ties:
//          lower rank). Without buckets every matrix is its own bucket, which is LPT over
//          matrices without micro-groups. One micro-group holding every matrix in input order
//          (one exchange, as the layer-wise optimizer's single all-gatherv); capacity unused.
//          Its balance is bounded by the largest bucket, so it is the baseline lpt and alpha
//          improve on.
//   local  Locality-aware LPT (benchmarks/optim_matrix.py compares it with lpt). `held` gives,
//          per matrix and rank, the elements the rank already holds. A matrix one rank holds
//          whole (RaggedShard lets the planner keep an expert or a small matrix on one rank)
//          is owned there: gathering it moves nothing. The other matrices go by LPT on top of
//          those loads (cost descending, ties lower index; each to the least loaded rank, ties
//          to the rank holding more of it, then the lower rank). Then, while the most loaded
//          rank m (ties: lower rank) is above the max load of the lpt plan of the same matrices
//          plus delta = floor(locality_slack * ceil(total / world)), one matrix of m moves to
//          the least loaded rank l (ties: lower rank): the first, in the order (travelling
//          before held at home, cost descending, lower index), whose cost c keeps
//          load[l] + c < load[m]; none: stop. Each move lowers the sum of squared loads, so
//          this ends. If m is still above the bound, the plan is lpt's. So the max load is at
//          most lpt's plus delta, and a matrix leaves its home only where keeping it would cost
//          more than that: the default slack 0.05 gives up at most 5% of a rank's mean load of
//          compute, and each matrix kept home saves sending it to its owner and its update
//          back, every step. Micro-groups as lpt's (capacity bounded, cost descending).
// With `held`, every strategy reports `moved`: the elements that travel to their owners per
// step (sum over matrices of numel minus what the owner holds; the updates travel back the
// same number), so bytes on the wire per step are 2 * moved * the element size.
// Buckets are used by alpha and layer only (naive and lpt validate and ignore them); without
// buckets every matrix is in bucket 0 for alpha and in a bucket of its own for layer.

enum class Strategy : int64_t { kNaive = 0, kLpt = 1, kAlpha = 2, kLayer = 3, kLocal = 4 };
enum class Cost : int64_t { kFlops = 0, kNumel = 1, kShampoo = 2, kSoap = 3 };

// "naive" | "lpt" | "alpha" | "layer" | "local" and "flops" | "numel" | "shampoo" | "soap";
// std::invalid_argument on anything else.
Strategy parse_strategy(const std::string& name);
Cost parse_cost(const std::string& name);

// One row block of a matrix.
struct Block {
  int64_t rows;
  int64_t cols;
};

struct OwnerOptions {
  Strategy strategy = Strategy::kLpt;
  Cost cost = Cost::kFlops;
  double alpha = 1.0;    // alpha only, in [0, 1]
  int64_t capacity = 0;  // lpt only: max load a rank may gain within one micro-group; <= 0: default
  int64_t ns_steps = 5;  // flops only, >= 1
  // shampoo and soap only ([Note: matrix owner plan]): f, the steps per preconditioner refresh
  // (>= 1), and D, the largest preconditioned side (>= 1).
  int64_t precondition_frequency = 1;
  int64_t max_preconditioner_dim = 1024;
  // Per matrix and rank (matrix-major: held[i * world + r]), the elements rank r holds of
  // matrix i, in [0, numel]; empty: unknown (local then plans as lpt, and moved is -1).
  std::vector<int64_t> held;
  double locality_slack = 0.05;  // local only, >= 0
};

struct OwnerPlan {
  std::vector<int64_t> owners;               // per matrix, in [0, world)
  std::vector<std::vector<int64_t>> groups;  // micro-groups in execution order
  std::vector<int64_t> loads;                // per rank, sum of its matrices' costs
  int64_t capacity = 0;                      // lpt, local: the capacity used; others: 0
  int64_t moved = -1;  // elements sent to owners per step; -1: no held
  double ratio() const;                      // max / mean load; 1 when every load is 0
};

// Cost of one block under the cost model ([Note: matrix owner plan]). Throws
// std::invalid_argument on negative sizes, precondition_frequency < 1,
// max_preconditioner_dim < 1 or int64 overflow.
int64_t block_cost(const Block& block, Cost cost, int64_t ns_steps,
                   int64_t precondition_frequency = 1, int64_t max_preconditioner_dim = 1024);

// Per matrix, the sum of its blocks' costs (the same errors, naming the matrix and block; also
// ns_steps < 1 and a matrix with no blocks).
std::vector<int64_t> matrix_costs(const std::vector<std::vector<Block>>& matrices, Cost cost,
                                  int64_t ns_steps, int64_t precondition_frequency = 1,
                                  int64_t max_preconditioner_dim = 1024);

// Plans owners and micro-groups ([Note: matrix owner plan]). `buckets` is empty or has one id
// (>= 0) per matrix. Throws std::invalid_argument naming the argument and value for:
// world_size < 1, alpha outside [0, 1] (or NaN), ns_steps < 1, precondition_frequency < 1,
// max_preconditioner_dim < 1, locality_slack < 0 (or NaN), a held table of the wrong size or
// with an entry outside [0, numel], a matrix with no blocks, a negative rows or cols, a negative
// bucket id, a buckets length that differs from the matrix count, or costs that overflow int64.
OwnerPlan plan_owners(const std::vector<std::vector<Block>>& matrices,
                      const std::vector<int64_t>& buckets, int64_t world_size,
                      const OwnerOptions& options = OwnerOptions());

}  // namespace optim
}  // namespace veragged
