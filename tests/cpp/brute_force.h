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

// Like blocks_whole, but a tensor may cross more than one boundary only if `may_span` (the
// case-3 restriction of P_L in [Note: shard-size search]).
inline bool blocks_whole_spanning(int64_t start, int64_t numel, int64_t block, int64_t shard,
                                  bool may_span) {
  int64_t crossed = 0;
  for (int64_t b = (start / shard + 1) * shard; b < start + numel; b += shard) {
    if ((b - start) % block != 0 || (++crossed > 1 && !may_span)) return false;
  }
  return true;
}

// P_L(shard) for one order: the tensors fit in `world_size` shards, each placed at the first
// scanned start where its blocks are whole and it crosses several boundaries only if its block
// divides `unit`.
inline bool fits_on_lattice(const std::vector<int64_t>& numels, const std::vector<int64_t>& blocks,
                            const std::vector<int>& order, int64_t world_size, int64_t shard,
                            int64_t unit) {
  int64_t pos = 0;
  for (int t : order) {
    int64_t start = pos;
    while (start < pos + 2 * shard &&
           !blocks_whole_spanning(start, numels[t], blocks[t], shard, unit % blocks[t] == 0)) {
      ++start;
    }
    if (start == pos + 2 * shard) return false;
    pos = start + numels[t];
  }
  return pos <= world_size * shard;
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
