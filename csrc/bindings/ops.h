// Declarations of the op entry points that registration.cpp binds to schemas.
#pragma once

#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string_view>
#include <tuple>
#include <vector>

namespace veragged {

// plan_layout(int[] numels, int[] block_sizes, int world_size, int align)
//   -> (int shard_size, int[] starts, int[] permutation, int order)
std::tuple<int64_t, std::vector<int64_t>, std::vector<int64_t>, int64_t> plan_layout_op(
    c10::IntArrayRef numels, c10::IntArrayRef block_sizes, int64_t world_size, int64_t align);

// flat_range_boxes(int[] shape, int begin, int end) -> int[]
//   flattened boxes: per box, its k offsets then its k sizes (placement/boxes.h)
std::vector<int64_t> flat_range_boxes_op(c10::IntArrayRef shape, int64_t begin, int64_t end);

// interval_overlaps(int[] src_bounds, int[] dst_bounds, int rank) -> (int[] send, int[] recv)
std::tuple<std::vector<int64_t>, std::vector<int64_t>> interval_overlaps_op(
    c10::IntArrayRef src_bounds, c10::IntArrayRef dst_bounds, int64_t rank);

// plan_owners(int[] block_rows, int[] block_cols, int[] blocks_per_matrix, int[] buckets,
//             int world_size, str strategy, str cost, float alpha, int capacity, int ns_steps,
//             int precondition_frequency, int max_preconditioner_dim, int[] held,
//             float locality_slack)
//   -> (int[] owners, int[] group_offsets, int[] group_members, int[] loads, int capacity,
//       int moved)
// Micro-group g is group_members[group_offsets[g]:group_offsets[g + 1]]; held is matrix-major
// (held[i * world_size + r]) or empty; moved is -1 without it (optim/owners.h).
std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
           int64_t, int64_t>
plan_owners_op(c10::IntArrayRef block_rows, c10::IntArrayRef block_cols,
               c10::IntArrayRef blocks_per_matrix, c10::IntArrayRef buckets, int64_t world_size,
               std::string_view strategy, std::string_view cost, double alpha, int64_t capacity,
               int64_t ns_steps, int64_t precondition_frequency, int64_t max_preconditioner_dim,
               c10::IntArrayRef held, double locality_slack);

// matrix_costs(int[] block_rows, int[] block_cols, int[] blocks_per_matrix, str cost,
//              int ns_steps, int precondition_frequency, int max_preconditioner_dim) -> int[]
// Per matrix, the summed cost of its blocks under the plan's cost model (optim/owners.h).
std::vector<int64_t> matrix_costs_op(c10::IntArrayRef block_rows, c10::IntArrayRef block_cols,
                                     c10::IntArrayRef blocks_per_matrix, std::string_view cost,
                                     int64_t ns_steps, int64_t precondition_frequency,
                                     int64_t max_preconditioner_dim);

// quant_layout(int[] specs, int shard_size, int world, int align)
//   -> (int slot_bytes, int[] segments, int[] rank_bytes)
// specs: 8 ints per tensor (quant::TensorSpec's fields in order); segments: 9 ints each
// (quant::Segment's fields in order), rank-major (quant/layout.h).
std::tuple<int64_t, std::vector<int64_t>, std::vector<int64_t>> quant_layout_op(
    c10::IntArrayRef specs, int64_t shard_size, int64_t world, int64_t align);

}  // namespace veragged
