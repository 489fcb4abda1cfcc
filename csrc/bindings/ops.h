// Declarations of the op entry points that registration.cpp binds to schemas.
#pragma once

#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace veragged {

// plan_layout(int[] numels, int[] block_sizes, int world_size, int align)
//   -> (int shard_size, int[] starts, int[] permutation, int order)
std::tuple<int64_t, std::vector<int64_t>, std::vector<int64_t>, int64_t> plan_layout_op(
    c10::IntArrayRef numels, c10::IntArrayRef block_sizes, int64_t world_size, int64_t align);

}  // namespace veragged
