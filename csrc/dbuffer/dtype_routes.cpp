// Which code runs a DBuffer group op for which dtypes; see "Dtypes" in [Note: DBuffer group ops]
// (group_ops.h). Device independent: the fused kernels come in a DeviceKernels table, the rest is
// ATen ops, which run on the tensors' device and current stream.

#include "dbuffer/group_ops.h"

namespace veragged::dbuffer {
namespace {

// The dtypes the fused kernels are instantiated for.
bool fused(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// The kernels' `acc_t` for a destination dtype.
at::ScalarType acc_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// A flat complex tensor as the flat real tensor of its (re, im) components.
at::Tensor real_view(const at::Tensor& t) { return at::view_as_real(t).view(-1); }

}  // namespace

void cast_scale(const DeviceKernels& kernels, at::Tensor& dst, const at::Tensor& src,
                double alpha) {
  check_pair(dst, src, "cast_scale_");
  const at::ScalarType d = dst.scalar_type(), s = src.scalar_type();
  if (d == s && alpha == 1.0) {  // a copy: every dtype, bits unchanged
    dst.copy_(src);
    return;
  }
  if (dst.is_complex() && src.is_complex()) {
    at::Tensor real = real_view(dst);
    cast_scale(kernels, real, real_view(src), alpha);
    return;
  }
  TORCH_CHECK_VALUE(dst.is_floating_point() && src.is_floating_point(), "cast_scale_: cannot cast ",
                    s, " to ", d, " with alpha=", alpha,
                    ": only floating (or only complex) tensors are cast and scaled; other dtypes "
                    "are copied, into the same dtype with alpha=1");
  if (fused(d) && fused(s)) {
    kernels.cast_scale(dst, src, alpha);
  } else {  // float8: the kernel's math, one multiply in acc_t then the cast
    dst.copy_(alpha == 1.0 ? src : src.to(acc_type(d), false, /*copy=*/true).mul_(alpha));
  }
}

void accumulate(const DeviceKernels& kernels, at::Tensor& dst, const at::Tensor& src,
                double alpha) {
  check_pair(dst, src, "accumulate_");
  if (dst.is_complex() && src.is_complex()) {
    at::Tensor real = real_view(dst);
    accumulate(kernels, real, real_view(src), alpha);
    return;
  }
  const at::ScalarType d = dst.scalar_type(), s = src.scalar_type();
  TORCH_CHECK_VALUE(dst.is_floating_point() && src.is_floating_point(),
                    "accumulate_: dst and src must both be floating or both complex tensors, got ",
                    d, " and ", s);
  if (fused(d) && fused(s)) {
    kernels.accumulate(dst, src, alpha);
  } else {  // float8: cast src to dst's dtype, then multiply and add in acc_t (two roundings)
    const at::ScalarType acc = acc_type(d);
    at::Tensor sum = dst.to(acc);
    sum.add_(src.to(d).to(acc, false, /*copy=*/true).mul_(alpha));
    dst.copy_(sum);
  }
}

}  // namespace veragged::dbuffer
