// Group-level fused kernels of a DBuffer: the checks and element math shared by the CPU
// (group_ops.cpp) and CUDA (cuda/group_ops.cu) kernels.
//
// [Note: DBuffer group ops]
// A DBuffer keeps a whole parameter group in one flat allocation, so what FSDP does per tensor
// (zero the gradients, divide them by the world size, cast fp32 shards to the bf16 all-gather
// input, accumulate a reduced gradient into the sharded one) is one kernel launch per group over
// a flat range. Each op also fuses the steps torch would run as separate passes:
//   cast_scale_(dst, src, alpha):   dst = cast<dst>(alpha * src)        (one read, one write)
//   accumulate_(dst, src, alpha):   dst = cast<dst>(dst + alpha * src)  (src may be narrower)
//   zero_ranges_(dst, ranges):      dst[a_i:b_i] = 0 for every [a_i, b_i) in one launch
//   land_(dst, srcs, pieces, alpha): for every piece (i, s, d, n, add) of `pieces` (five ints
//                                   each): dst[d:d+n] = cast<dst>((add ? dst[d:d+n] : +0.0)
//                                   + alpha * srcs[i][s:s+n]), in one launch: a group's
//                                   gradients landing in its gradient buffer ([Note: gradient
//                                   landing] in veragged/dbuffer/grads.py). It computes in the
//                                   promoted type of dst and src (double if either is), as
//                                   torch's `torch.add(zero, g, alpha=)` and `view.add_(g,
//                                   alpha=)`; +0.0 + x is never -0.0.
// Arithmetic is done in `acc_t` (float for half/bf16/float, double for double) with an explicit
// multiply then add (no fused multiply-add), so CPU and CUDA round identically and match torch's
// `dst.add_(src.to(dst.dtype), alpha=alpha)` for float32.
//
// Dtypes (dtype_routes.cpp; the fake kernels in veragged/dbuffer/ops.py check the same): the
// fused kernels serve every pair of float, double, half and bfloat16. Complex tensors (both dst
// and src) run them on their real views, which scales and adds componentwise. Other floating
// dtypes (float8) take the same math through ATen ops (via `acc_t`; a cast is one `copy_`).
// `cast_scale_` into the same dtype with alpha = 1 is a plain copy and serves every dtype: a
// DBuffer of integer, bool or float8 parameters (never trainable) is copied with it. Any other
// combination (integers scaled or cast, complex with real) raises ValueError.

#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <type_traits>
#include <vector>

namespace veragged::dbuffer {

template <typename T>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};

// land_'s computation type: the promoted type of dst and src (double if either is).
template <typename A, typename B>
using LandAcc = std::conditional_t<std::is_same_v<A, double> || std::is_same_v<B, double>,
                                   double, float>;

inline void check_flat(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

inline void check_pair(const at::Tensor& dst, const at::Tensor& src, const char* op) {
  check_flat(dst, op, "dst");
  check_flat(src, op, "src");
  TORCH_CHECK_VALUE(dst.numel() == src.numel(), op, ": dst has ", dst.numel(),
                    " elements but src has ", src.numel());
  TORCH_CHECK_VALUE(dst.device() == src.device(), op, ": dst is on ", dst.device(),
                    " but src is on ", src.device());
}

// Validates [a0, b0, a1, b1, ...] against a buffer of `numel` elements.
inline void check_ranges(c10::IntArrayRef ranges, int64_t numel) {
  TORCH_CHECK_VALUE(ranges.size() % 2 == 0, "zero_ranges_: ranges must hold (begin, end) pairs, got ",
                    ranges.size(), " values");
  for (size_t i = 0; i < ranges.size(); i += 2) {
    TORCH_CHECK_VALUE(0 <= ranges[i] && ranges[i] <= ranges[i + 1] && ranges[i + 1] <= numel,
                      "zero_ranges_: range ", i / 2, " = [", ranges[i], ", ", ranges[i + 1],
                      ") is not inside [0, ", numel, ")");
  }
}

// Validates land_'s arguments: five ints per piece, each piece inside its source and dst,
// contiguous sources on dst's device, fused dtypes (float, double, half, bfloat16).
inline void check_land(const at::Tensor& dst, at::TensorList srcs, c10::IntArrayRef pieces) {
  check_flat(dst, "land_", "dst");
  TORCH_CHECK_VALUE(pieces.size() % 5 == 0, "land_: pieces must hold (src, src_offset, "
                    "dst_offset, count, add) tuples, got ", pieces.size(), " values");
  auto fused = [](at::ScalarType t) {
    return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
  };
  TORCH_CHECK_VALUE(fused(dst.scalar_type()), "land_: dst must be float, double, half or "
                    "bfloat16, got ", dst.scalar_type());
  for (size_t i = 0; i < srcs.size(); ++i) {
    TORCH_CHECK_VALUE(srcs[i].is_contiguous(), "land_: srcs[", i, "] must be contiguous");
    TORCH_CHECK_VALUE(srcs[i].device() == dst.device(), "land_: srcs[", i, "] is on ",
                      srcs[i].device(), " but dst is on ", dst.device());
    TORCH_CHECK_VALUE(fused(srcs[i].scalar_type()), "land_: srcs[", i, "] must be float, "
                      "double, half or bfloat16, got ", srcs[i].scalar_type());
  }
  for (size_t p = 0; p < pieces.size(); p += 5) {
    const int64_t i = pieces[p], s = pieces[p + 1], d = pieces[p + 2], n = pieces[p + 3];
    TORCH_CHECK_VALUE(0 <= i && i < static_cast<int64_t>(srcs.size()), "land_: piece ", p / 5,
                      " names srcs[", i, "] of ", srcs.size());
    TORCH_CHECK_VALUE(n >= 0 && 0 <= s && s + n <= srcs[i].numel() && 0 <= d &&
                          d + n <= dst.numel(),
                      "land_: piece ", p / 5, " = (src ", i, ", at ", s, ", dst at ", d, ", ", n,
                      " elements) is outside srcs[", i, "] (", srcs[i].numel(),
                      " elements) or dst (", dst.numel(), ")");
  }
}

// Kernels per device (group_ops.cpp, cuda/group_ops.cu).
void cast_scale_cpu(at::Tensor& dst, const at::Tensor& src, double alpha);
void accumulate_cpu(at::Tensor& dst, const at::Tensor& src, double alpha);
void zero_ranges_cpu(at::Tensor& dst, c10::IntArrayRef ranges);
void land_cpu(at::Tensor& dst, at::TensorList srcs, c10::IntArrayRef pieces, double alpha);

// One device's fused kernels. They take contiguous tensors of equal numel on the device, with
// dtypes among float, double, half and bfloat16.
struct DeviceKernels {
  void (*cast_scale)(at::Tensor& dst, const at::Tensor& src, double alpha);
  void (*accumulate)(at::Tensor& dst, const at::Tensor& src, double alpha);
};

// The ops on one device: argument checks, then the dtype routes of the Note (dtype_routes.cpp).
void cast_scale(const DeviceKernels& kernels, at::Tensor& dst, const at::Tensor& src,
                double alpha);
void accumulate(const DeviceKernels& kernels, at::Tensor& dst, const at::Tensor& src,
                double alpha);

}  // namespace veragged::dbuffer
