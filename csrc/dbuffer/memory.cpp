// `veragged::aligned_empty`: a DBuffer's flat allocations (the shard, the sharded gradients)
// start on a 256-byte boundary and take exactly the bytes they hold ([Note: aligned buffers]
// in veragged/dbuffer/ops.py).
//
// Host memory comes from a 256-byte aligned allocator of its own (c10's CPU allocator aligns to
// 64), as a resizable storage, so `free_storage`/`alloc_storage` (storage resize) work on it as
// on any tensor. Device and pinned memory come from torch's caching allocators, which already
// align their blocks (CUDA: 512 bytes); only if a block is not aligned (a pluggable allocator)
// is it over-allocated by 256 bytes and sliced. Device-generic (CompositeExplicitAutograd, with
// no tensor argument); the fake kernel is in veragged/dbuffer/ops.py.

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>

namespace veragged::dbuffer {
namespace {

constexpr std::size_t kAlignBytes = 256;

void free_aligned(void* ptr) { std::free(ptr); }

class AlignedHostAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(std::size_t nbytes) override {
    void* ptr = nullptr;
    if (nbytes > 0) {
      const int rc = posix_memalign(&ptr, kAlignBytes, nbytes);
      TORCH_CHECK(rc == 0 && ptr != nullptr, "veragged::aligned_empty: could not allocate ",
                  nbytes, " bytes of host memory (posix_memalign returned ", rc, ")");
    }
    return {ptr, ptr, &free_aligned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_aligned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

AlignedHostAllocator* host_allocator() {
  static AlignedHostAllocator allocator;  // lives as long as the process
  return &allocator;
}

at::Tensor aligned_empty(int64_t numel, at::ScalarType dtype, at::Device device,
                         bool pin_memory) {
  TORCH_CHECK_VALUE(numel >= 0, "aligned_empty: numel must be >= 0, got ", numel);
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  if (device.is_cpu() && !pin_memory) {
    const std::size_t nbytes = static_cast<std::size_t>(numel) * c10::elementSize(dtype);
    c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, host_allocator(),
                         /*resizable=*/true);
    return at::empty({0}, options).set_(std::move(storage), 0, {numel}, {1});
  }
  at::Tensor exact = at::empty({numel}, options.pinned_memory(pin_memory));
  if (device.is_meta() || numel == 0 ||
      reinterpret_cast<std::uintptr_t>(exact.data_ptr()) % kAlignBytes == 0) {
    return exact;
  }
  exact.reset();
  const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t extra = static_cast<int64_t>(kAlignBytes) / item;
  at::Tensor raw = at::empty({numel + extra}, options.pinned_memory(pin_memory));
  const auto address = reinterpret_cast<std::uintptr_t>(raw.data_ptr());
  const int64_t skip =
      static_cast<int64_t>((kAlignBytes - address % kAlignBytes) % kAlignBytes) / item;
  return raw.narrow(0, skip, numel);
}

}  // namespace

TORCH_LIBRARY_IMPL(veragged, CompositeExplicitAutograd, m) {
  m.impl("aligned_empty", &aligned_empty);
}

}  // namespace veragged::dbuffer
