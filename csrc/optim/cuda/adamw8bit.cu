// CUDA kernel of `veragged::adamw8bit_step_`; see [Note: AdamW8bit kernel] in ../adamw8bit.h.
// One thread block per quantisation block (grid-stride over blocks), 256 threads striding over
// its elements. Pass 1 computes every element's new m and v and reduces the block's absmax;
// pass 2 recomputes them from the untouched old codes (same thread, same element, same bits),
// then writes the parameter and the new codes. So no per-element scratch memory is needed and
// any block_size works. The arithmetic is the header's, with _rn intrinsics: bitwise the CPU's.

#include "optim/adamw8bit.h"

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

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

template <typename scalar_t>
__global__ void adamw8bit_kernel(scalar_t* p, const scalar_t* g, uint8_t* mc, uint8_t* vc,
                                 float* m_abs, float* v_abs, const float* qmap_s,
                                 const float* qmap_u, int64_t n, int64_t bs, int64_t blocks,
                                 AdamW8bitScalars s) {
  __shared__ float qs[kQmapSize], qu[kQmapSize], scratch[kThreads];
  __shared__ int zero[2];
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

  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const int64_t lo = b * bs, hi = lo + bs < n ? lo + bs : n;
    const float old_m_abs = m_abs[b], old_v_abs = v_abs[b];
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
      m_abs[b] = new_m_abs;
      v_abs[b] = new_v_abs;
    }
  }
}

void adamw8bit_step_cuda(at::Tensor param, const at::Tensor& grad, at::Tensor m_codes,
                         at::Tensor v_codes, at::Tensor m_absmax, at::Tensor v_absmax,
                         const at::Tensor& qmap_signed, const at::Tensor& qmap_unsigned, double lr,
                         double beta1, double beta2, double eps, double weight_decay,
                         int64_t step, int64_t block_size) {
  check_adamw8bit_args(param, grad, m_codes, v_codes, m_absmax, v_absmax, qmap_signed,
                       qmap_unsigned, step, block_size);
  const int64_t n = param.numel();
  if (n == 0) return;
  const int64_t blocks = (n + block_size - 1) / block_size;
  const AdamW8bitScalars s = make_scalars(lr, beta1, beta2, eps, weight_decay, step);
  const c10::cuda::CUDAGuard guard(param.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t cap = int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 64;
  const unsigned grid = static_cast<unsigned>(std::min(blocks, cap));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, param.scalar_type(), "adamw8bit", [&] {
    adamw8bit_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
        param.data_ptr<scalar_t>(), grad.const_data_ptr<scalar_t>(), m_codes.data_ptr<uint8_t>(),
        v_codes.data_ptr<uint8_t>(), m_absmax.data_ptr<float>(), v_absmax.data_ptr<float>(),
        qmap_signed.const_data_ptr<float>(), qmap_unsigned.const_data_ptr<float>(), n,
        block_size, blocks, s);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(veragged, CUDA, m) { m.impl("adamw8bit_step_", &adamw8bit_step_cuda); }

}  // namespace veragged::optim
