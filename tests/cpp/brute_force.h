// Slow, obviously-correct versions of the planner's pieces, for the tests to compare against.
#pragma once

#include <cstdint>
#include <vector>

namespace brute {

// True if a tensor at [start, start + numel) with blocks of `block` has no block cut by any
// boundary of shards of `shard` elements.
inline bool blocks_whole(int64_t start, int64_t numel, int64_t block, int64_t shard) {
  for (int64_t b = (start / shard + 1) * shard; b < start + numel; b += shard) {
    if ((b - start) % block != 0) return false;
  }
  return true;
}

// Earliest start >= pos by scanning every position of the next `2 * shard` (the rule is
// periodic in shard), or -1.
inline int64_t earliest_start(int64_t pos, int64_t numel, int64_t block, int64_t shard) {
  for (int64_t start = pos; start < pos + 2 * shard; ++start) {
    if (blocks_whole(start, numel, block, shard)) return start;
  }
  return -1;
}

// Whether the tensors fit in `world_size` shards of `shard` in this order, placing each as early
// as the scan allows.
inline bool fits_in_order(const std::vector<int64_t>& numels, const std::vector<int64_t>& blocks,
                          const std::vector<int>& order, int64_t world_size, int64_t shard) {
  int64_t pos = 0;
  for (int t : order) {
    const int64_t start = earliest_start(pos, numels[t], blocks[t], shard);
    if (start < 0) return false;
    pos = start + numels[t];
  }
  return pos <= world_size * shard;
}

}  // namespace brute
