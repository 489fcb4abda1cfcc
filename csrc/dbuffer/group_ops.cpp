// CPU kernels of the DBuffer group ops; see [Note: DBuffer group ops] in group_ops.h.

#include "dbuffer/group_ops.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

namespace veragged::dbuffer {
namespace {

constexpr int64_t kGrain = 1 << 15;  // elements per parallel task

// Runs `body(dst_ptr, src_ptr, begin, end)` over [0, numel) with dst/src element types resolved.
template <typename Body>
void for_pair(at::Tensor& dst, const at::Tensor& src, Body body) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dst.scalar_type(), "dbuffer_pair", [&] {
    using dst_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src.scalar_type(), "dbuffer_pair", [&] {
      using src_t = scalar_t;
      dst_t* d = dst.data_ptr<dst_t>();
      const src_t* s = src.const_data_ptr<src_t>();
      at::parallel_for(0, dst.numel(), kGrain, [&](int64_t b, int64_t e) { body(d, s, b, e); });
    });
  });
}

}  // namespace

void cast_scale_cpu(at::Tensor& dst, const at::Tensor& src, double alpha) {
  for_pair(dst, src, [alpha](auto* d, const auto* s, int64_t b, int64_t e) {
    using dst_t = std::remove_pointer_t<decltype(d)>;
    using acc_t = typename AccType<dst_t>::type;
    const acc_t a = static_cast<acc_t>(alpha);
    for (int64_t i = b; i < e; ++i) d[i] = static_cast<dst_t>(a * static_cast<acc_t>(s[i]));
  });
}

void accumulate_cpu(at::Tensor& dst, const at::Tensor& src, double alpha) {
  for_pair(dst, src, [alpha](auto* d, const auto* s, int64_t b, int64_t e) {
    using dst_t = std::remove_pointer_t<decltype(d)>;
    using acc_t = typename AccType<dst_t>::type;
    const acc_t a = static_cast<acc_t>(alpha);
    for (int64_t i = b; i < e; ++i) {
      const acc_t scaled = a * static_cast<acc_t>(static_cast<dst_t>(s[i]));
      d[i] = static_cast<dst_t>(static_cast<acc_t>(d[i]) + scaled);
    }
  });
}

void zero_ranges_cpu(at::Tensor& dst, c10::IntArrayRef ranges) {
  char* base = static_cast<char*>(dst.data_ptr());
  const int64_t item = dst.element_size();
  const int64_t n = static_cast<int64_t>(ranges.size() / 2);
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t lo = ranges[2 * r], hi = ranges[2 * r + 1];
      std::memset(base + lo * item, 0, static_cast<size_t>((hi - lo) * item));  // +0.0 is all zero bits
    }
  });
}

void land_cpu(at::Tensor& dst, at::TensorList srcs, c10::IntArrayRef pieces, double alpha) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dst.scalar_type(), "land_", [&] {
    using dst_t = scalar_t;
    dst_t* d = dst.data_ptr<dst_t>();
    for (size_t p = 0; p < pieces.size(); p += 5) {
      const at::Tensor& src = srcs[pieces[p]];
      const int64_t s0 = pieces[p + 1], d0 = pieces[p + 2], n = pieces[p + 3];
      const bool add = pieces[p + 4] != 0;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src.scalar_type(), "land_", [&] {
        using acc_t = LandAcc<dst_t, scalar_t>;
        const acc_t a = static_cast<acc_t>(alpha);
        const scalar_t* s = src.const_data_ptr<scalar_t>() + s0;
        dst_t* out = d + d0;
        at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) {
            const acc_t base = add ? static_cast<acc_t>(out[i]) : acc_t(0);
            out[i] = static_cast<dst_t>(base + a * static_cast<acc_t>(s[i]));
          }
        });
      });
    }
  });
}

namespace {

constexpr DeviceKernels kCpuKernels{&cast_scale_cpu, &accumulate_cpu};

void cast_scale_op(at::Tensor dst, const at::Tensor& src, double alpha) {
  cast_scale(kCpuKernels, dst, src, alpha);
}
void accumulate_op(at::Tensor dst, const at::Tensor& src, double alpha) {
  accumulate(kCpuKernels, dst, src, alpha);
}
void zero_ranges_op(at::Tensor dst, c10::IntArrayRef ranges) {
  TORCH_CHECK_VALUE(dst.is_contiguous(), "zero_ranges_: dst must be contiguous");
  check_ranges(ranges, dst.numel());
  zero_ranges_cpu(dst, ranges);
}

void land_op(at::Tensor dst, at::TensorList srcs, c10::IntArrayRef pieces, double alpha) {
  check_land(dst, srcs, pieces);
  land_cpu(dst, srcs, pieces, alpha);
}

}  // namespace

TORCH_LIBRARY_IMPL(veragged, CPU, m) {
  m.impl("cast_scale_", &cast_scale_op);
  m.impl("accumulate_", &accumulate_op);
  m.impl("zero_ranges_", &zero_ranges_op);
  m.impl("land_", &land_op);
}

}  // namespace veragged::dbuffer
