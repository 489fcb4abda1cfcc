// Adapter from the quant_layout schema to the torch-free packed-slot layout in csrc/quant.

#include <c10/util/Exception.h>

#include <stdexcept>
#include <string>

#include "bindings/ops.h"
#include "quant/layout.h"

namespace veragged {

std::tuple<int64_t, std::vector<int64_t>, std::vector<int64_t>> quant_layout_op(
    c10::IntArrayRef specs, int64_t shard_size, int64_t world, int64_t align) {
  constexpr std::size_t kSpecInts = 8;
  TORCH_CHECK_VALUE(specs.size() % kSpecInts == 0, "quant_layout: specs has ", specs.size(),
                    " ints, not a multiple of ", kSpecInts);
  std::vector<quant::TensorSpec> tensors(specs.size() / kSpecInts);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const int64_t* s = specs.data() + i * kSpecInts;
    tensors[i] = {s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]};
  }
  quant::PackedLayout layout;
  try {
    layout = quant::pack_layout(tensors, shard_size, world, align);
  } catch (const std::invalid_argument& error) {
    TORCH_CHECK_VALUE(false, "quant_layout: ", error.what());  // ValueError in Python
  }
  std::vector<int64_t> flat;
  flat.reserve(layout.segments.size() * quant::kSegmentInts);
  for (const quant::Segment& s : layout.segments) {
    flat.insert(flat.end(), {s.rank, s.format, s.elem_off, s.rows, s.cols, s.tile_rows,
                             s.tile_cols, s.data_off, s.scale_off});
  }
  return {layout.slot_bytes, std::move(flat), std::move(layout.rank_bytes)};
}

}  // namespace veragged
