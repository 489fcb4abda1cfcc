// CUDA kernels of the DBuffer group ops; see [Note: DBuffer group ops] in ../group_ops.h.
// One launch per call, grid-stride loops, on the current stream. Multiplies and adds use the
// _rn intrinsics so nvcc does not contract them into an FMA (the CPU kernels round the same way).

#include "dbuffer/group_ops.h"

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace veragged::dbuffer {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxRanges = 64;  // ranges passed by value per launch

__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }

int blocks_for(int64_t n) {
  const int64_t want = (n + kThreads - 1) / kThreads;
  const int cap = at::cuda::getCurrentDeviceProperties()->multiProcessorCount * 32;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, cap)));
}

template <typename dst_t, typename src_t>
__global__ void cast_scale_kernel(dst_t* d, const src_t* s, int64_t n, double alpha) {
  using acc_t = typename AccType<dst_t>::type;
  const acc_t a = static_cast<acc_t>(alpha);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    d[i] = static_cast<dst_t>(mul(a, static_cast<acc_t>(s[i])));
}

template <typename dst_t, typename src_t>
__global__ void accumulate_kernel(dst_t* d, const src_t* s, int64_t n, double alpha) {
  using acc_t = typename AccType<dst_t>::type;
  const acc_t a = static_cast<acc_t>(alpha);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const acc_t scaled = mul(a, static_cast<acc_t>(static_cast<dst_t>(s[i])));
    d[i] = static_cast<dst_t>(add(static_cast<acc_t>(d[i]), scaled));
  }
}

struct Ranges {
  int64_t begin[kMaxRanges];
  int64_t end[kMaxRanges];
};

// blockIdx.y picks the range; x blocks stride over it. Zero is written as bytes (+0.0 is all
// zero bits in every floating type).
__global__ void zero_ranges_kernel(unsigned char* base, int64_t item, Ranges r) {
  const int64_t lo = r.begin[blockIdx.y] * item, hi = r.end[blockIdx.y] * item;
  for (int64_t i = lo + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < hi; i += int64_t(gridDim.x) * blockDim.x)
    base[i] = 0;
}

// land_: one task per block, each at most kLandChunk elements of one piece, described by four
// int64s (source address, dst offset, count, add) that reach the device in one non-blocking
// copy from pinned memory (the caching host allocator keeps the host buffer until it ran).
constexpr int64_t kLandChunk = 1 << 14;

template <typename dst_t, typename src_t>
__global__ void land_kernel(dst_t* d, const int64_t* tasks, double alpha) {
  using acc_t = LandAcc<dst_t, src_t>;
  const acc_t a = static_cast<acc_t>(alpha);
  const int64_t* t = tasks + 4 * int64_t(blockIdx.x);
  const src_t* s = reinterpret_cast<const src_t*>(t[0]);
  dst_t* out = d + t[1];
  const int64_t n = t[2];
  const bool add_to = t[3] != 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const acc_t base = add_to ? static_cast<acc_t>(out[i]) : acc_t(0);
    out[i] = static_cast<dst_t>(add(base, mul(a, static_cast<acc_t>(s[i]))));
  }
}

void land_cuda(at::Tensor& dst, at::TensorList srcs, c10::IntArrayRef pieces, double alpha) {
  const c10::cuda::CUDAGuard guard(dst.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // One launch per source dtype (a group's gradients share one, so usually one launch).
  std::vector<at::ScalarType> dtypes;
  for (const at::Tensor& t : srcs)
    if (std::find(dtypes.begin(), dtypes.end(), t.scalar_type()) == dtypes.end())
      dtypes.push_back(t.scalar_type());
  for (at::ScalarType dtype : dtypes) {
    std::vector<int64_t> tasks;
    for (size_t p = 0; p < pieces.size(); p += 5) {
      const at::Tensor& src = srcs[pieces[p]];
      if (src.scalar_type() != dtype) continue;
      const int64_t item = src.element_size();
      const auto base = reinterpret_cast<int64_t>(src.const_data_ptr());
      for (int64_t k = 0; k < pieces[p + 3]; k += kLandChunk) {
        tasks.push_back(base + (pieces[p + 1] + k) * item);
        tasks.push_back(pieces[p + 2] + k);
        tasks.push_back(std::min(kLandChunk, pieces[p + 3] - k));
        tasks.push_back(pieces[p + 4]);
      }
    }
    const int64_t count = static_cast<int64_t>(tasks.size() / 4);
    if (count == 0) continue;
    at::Tensor host = at::empty({static_cast<int64_t>(tasks.size())},
                                at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    std::memcpy(host.data_ptr(), tasks.data(), tasks.size() * sizeof(int64_t));
    const at::Tensor table = host.to(dst.device(), /*non_blocking=*/true);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dst.scalar_type(), "land_", [&] {
      using dst_t = scalar_t;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "land_", [&] {
        land_kernel<dst_t, scalar_t><<<static_cast<unsigned>(count), kThreads, 0, stream>>>(
            dst.data_ptr<dst_t>(), table.const_data_ptr<int64_t>(), alpha);
      });
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename Launch>
void dispatch_pair(at::Tensor& dst, const at::Tensor& src, Launch launch) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dst.scalar_type(), "dbuffer_pair", [&] {
    using dst_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src.scalar_type(), "dbuffer_pair", [&] {
      launch(dst.data_ptr<dst_t>(), src.const_data_ptr<scalar_t>());
    });
  });
}

// Device guard, stream, dtype dispatch and launch check shared by the two-tensor kernels (the
// checks and dtype routes are dtype_routes.cpp's).
template <typename Launch>
void pair_launch(at::Tensor& dst, const at::Tensor& src, Launch launch) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(dst.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_pair(dst, src, [&](auto* d, const auto* s) { launch(d, s, n, stream); });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void cast_scale_cuda(at::Tensor& dst, const at::Tensor& src, double alpha) {
  pair_launch(dst, src, [alpha](auto* d, const auto* s, int64_t n, cudaStream_t st) {
    cast_scale_kernel<<<blocks_for(n), kThreads, 0, st>>>(d, s, n, alpha);
  });
}

void accumulate_cuda(at::Tensor& dst, const at::Tensor& src, double alpha) {
  pair_launch(dst, src, [alpha](auto* d, const auto* s, int64_t n, cudaStream_t st) {
    accumulate_kernel<<<blocks_for(n), kThreads, 0, st>>>(d, s, n, alpha);
  });
}

constexpr DeviceKernels kCudaKernels{&cast_scale_cuda, &accumulate_cuda};

void cast_scale_op(at::Tensor dst, const at::Tensor& src, double alpha) {
  cast_scale(kCudaKernels, dst, src, alpha);
}

void accumulate_op(at::Tensor dst, const at::Tensor& src, double alpha) {
  accumulate(kCudaKernels, dst, src, alpha);
}

void zero_ranges_op(at::Tensor dst, c10::IntArrayRef ranges) {
  TORCH_CHECK_VALUE(dst.is_contiguous(), "zero_ranges_: dst must be contiguous");
  check_ranges(ranges, dst.numel());
  const c10::cuda::CUDAGuard guard(dst.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  auto* base = static_cast<unsigned char*>(dst.data_ptr());
  const int64_t count = static_cast<int64_t>(ranges.size() / 2);
  for (int64_t first = 0; first < count; first += kMaxRanges) {  // one launch per 64 ranges
    Ranges r{};
    int64_t longest = 0, used = std::min<int64_t>(kMaxRanges, count - first);
    for (int64_t i = 0; i < used; ++i) {
      r.begin[i] = ranges[2 * (first + i)];
      r.end[i] = ranges[2 * (first + i) + 1];
      longest = std::max(longest, r.end[i] - r.begin[i]);
    }
    if (longest == 0) continue;
    const dim3 grid(blocks_for(longest * dst.element_size()), static_cast<unsigned>(used));
    zero_ranges_kernel<<<grid, kThreads, 0, stream>>>(base, dst.element_size(), r);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void land_op(at::Tensor dst, at::TensorList srcs, c10::IntArrayRef pieces, double alpha) {
  check_land(dst, srcs, pieces);
  land_cuda(dst, srcs, pieces, alpha);
}

}  // namespace

TORCH_LIBRARY_IMPL(veragged, CUDA, m) {
  m.impl("cast_scale_", &cast_scale_op);
  m.impl("accumulate_", &accumulate_op);
  m.impl("zero_ranges_", &zero_ranges_op);
  m.impl("land_", &land_op);
}

}  // namespace veragged::dbuffer
