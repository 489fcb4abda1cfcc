// CUDA kernels of `veragged::adamw8bit_multi_step_`; see
// [Note: AdamW8bit kernel] and [Note: AdamW8bit multi-tensor launch] in ../adamw8bit.h.
// One launch per call, whatever the number of tensors: one thread block per quantisation block
// of the launch (grid-stride over the blocks of all tensors; thread 0 finds the block's tensor
// by binary search over the descriptors), 256 threads striding over its elements. Pass 1
// computes every element's new m and v and reduces the block's absmax; pass 2 recomputes them
// from the untouched old codes (same thread, same element, same bits), then writes the
// parameter and the new codes. So no per-element scratch memory is needed and any block_size
// works. The arithmetic is the header's, with _rn intrinsics: bitwise the CPU's.

#include "optim/adamw8bit.h"

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace veragged::optim {
namespace {

constexpr int kThreads = 256;

// Max over the thread block of `x` (exact in any order); every thread gets the result.
__device__ float block_max(float x, float* scratch) {
  scratch[threadIdx.x] = x;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half >>= 1) {
    if (threadIdx.x < half) scratch[threadIdx.x] = fmaxf(scratch[threadIdx.x], scratch[threadIdx.x + half]);
    __syncthreads();
  }
  const float out = scratch[0];
  __syncthreads();  // scratch is reused by the next call
  return out;
}

// The tensor owning launch block `b`: the last descriptor whose first_block <= b (descriptors
// are sorted by first_block, and none is empty).
__device__ int64_t find_tensor(const AdamW8bitTensor* tensors, int64_t count, int64_t b) {
  int64_t lo = 0, hi = count - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (tensors[mid].first_block <= b) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <typename scalar_t>
__global__ void adamw8bit_kernel(const AdamW8bitTensor* tensors, int64_t count,
                                 const float* qmap_s, const float* qmap_u, int64_t bs,
                                 int64_t total_blocks) {
  __shared__ float qs[kQmapSize], qu[kQmapSize], scratch[kThreads];
  __shared__ int zero[2];
  __shared__ int64_t owner;
  for (int i = threadIdx.x; i < kQmapSize; i += kThreads) {
    qs[i] = qmap_s[i];
    qu[i] = qmap_u[i];
  }
  if (threadIdx.x == 0) zero[0] = zero[1] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < kQmapSize; i += kThreads) {
    if (qs[i] == 0.0f) zero[0] = i;
    if (qu[i] == 0.0f) zero[1] = i;
  }
  __syncthreads();
  const int zs = zero[0], zu = zero[1];

  for (int64_t gb = blockIdx.x; gb < total_blocks; gb += gridDim.x) {
    if (threadIdx.x == 0) owner = find_tensor(tensors, count, gb);
    __syncthreads();
    const AdamW8bitTensor& t = tensors[owner];
    __syncthreads();  // every thread has read `owner` before thread 0 writes the next one
    scalar_t* p = static_cast<scalar_t*>(t.p);
    const scalar_t* g = static_cast<const scalar_t*>(t.g);
    uint8_t* mc = t.mc;
    uint8_t* vc = t.vc;
    const AdamW8bitScalars s = t.s;
    const int64_t b = gb - t.first_block;  // the block within its tensor
    const int64_t lo = b * bs, hi = lo + bs < t.n ? lo + bs : t.n;
    const float old_m_abs = t.m_abs[b], old_v_abs = t.v_abs[b];
    float my_m = 0.0f, my_v = 0.0f;
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
      const ElementUpdate u =
          update_element(static_cast<float>(p[i]), static_cast<float>(g[i]),
                         __fmul_rn(qs[mc[i]], old_m_abs), __fmul_rn(qu[vc[i]], old_v_abs), s);
      my_m = fmaxf(my_m, fabsf(u.m));
      my_v = fmaxf(my_v, fabsf(u.v));
    }
    const float new_m_abs = block_max(my_m, scratch);
    const float new_v_abs = block_max(my_v, scratch);
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
      const ElementUpdate u =
          update_element(static_cast<float>(p[i]), static_cast<float>(g[i]),
                         __fmul_rn(qs[mc[i]], old_m_abs), __fmul_rn(qu[vc[i]], old_v_abs), s);
      p[i] = static_cast<scalar_t>(u.p);  // u.p == p[i] for a non-finite gradient
      mc[i] = quantize(qs, SearchFloor{qs}, u.m, new_m_abs, zs, /*keep_sign=*/true);
      vc[i] = quantize(qu, SearchFloor{qu}, u.v, new_v_abs, zu, /*keep_sign=*/false);
    }
    if (threadIdx.x == 0) {  // every thread read the old absmax before block_max's barriers
      t.m_abs[b] = new_m_abs;
      t.v_abs[b] = new_v_abs;
    }
  }
}

// One launch over `tensors` (host descriptors): they travel to the device in one
// non-blocking copy from pinned memory (the caching host allocator keeps the host buffer
// until the copy has run), so the launch never waits on the host.
void launch(const std::vector<AdamW8bitTensor>& tensors, int64_t total_blocks, int64_t bs,
            at::ScalarType dtype, const at::Device& device, const at::Tensor& qmap_signed,
            const at::Tensor& qmap_unsigned) {
  if (tensors.empty()) return;
  const c10::cuda::CUDAGuard guard(device);
  const int64_t bytes = static_cast<int64_t>(tensors.size() * sizeof(AdamW8bitTensor));
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), tensors.data(), static_cast<size_t>(bytes));
  const at::Tensor meta = host.to(device, /*non_blocking=*/true);
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t cap = int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 64;
  const unsigned grid = static_cast<unsigned>(std::min(total_blocks, cap));
  const auto* descriptors = reinterpret_cast<const AdamW8bitTensor*>(meta.const_data_ptr());
  const int64_t count = static_cast<int64_t>(tensors.size());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "adamw8bit", [&] {
    adamw8bit_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
        descriptors, count, qmap_signed.const_data_ptr<float>(),
        qmap_unsigned.const_data_ptr<float>(), bs, total_blocks);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void adamw8bit_multi_step_cuda(at::TensorList params, at::TensorList grads,
                               at::TensorList m_codes, at::TensorList v_codes,
                               at::TensorList m_absmax, at::TensorList v_absmax,
                               const at::Tensor& qmap_signed, const at::Tensor& qmap_unsigned,
                               double lr, double beta1, double beta2, double eps,
                               double weight_decay, c10::IntArrayRef steps, int64_t block_size) {
  int64_t total_blocks = 0;
  const std::vector<AdamW8bitTensor> tensors = adamw8bit_descriptors(
      params, grads, m_codes, v_codes, m_absmax, v_absmax, qmap_signed, qmap_unsigned, lr, beta1,
      beta2, eps, weight_decay, steps, block_size, total_blocks);
  if (tensors.empty()) return;
  launch(tensors, total_blocks, block_size, params[0].scalar_type(), params[0].device(),
         qmap_signed, qmap_unsigned);
}

}  // namespace

TORCH_LIBRARY_IMPL(veragged, CUDA, m) {
  m.impl("adamw8bit_multi_step_", &adamw8bit_multi_step_cuda);
}

}  // namespace veragged::optim
