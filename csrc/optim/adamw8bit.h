// Block-wise 8-bit AdamW: the checks and element math shared by the CPU (adamw8bit.cpp) and
// CUDA (cuda/adamw8bit.cu) kernels of `veragged::adamw8bit_multi_step_`.
//
// [Note: AdamW8bit kernel]
// The kernel updates parameter shards, each a flat range of its parameter that starts on a
// quantisation block boundary and holds whole blocks of `block_size` elements (the last one may
// be partial: it is the tensor's last block). The moments are stored as one uint8 code per
// element plus one fp32 absmax per block:
//   m = qmap_signed[m_code] * m_absmax[block]      (signed dynamic map, 256 sorted values)
//   v = qmap_unsigned[v_code] * v_absmax[block]    (unsigned dynamic map)
// Per element, in fp32 and in torch AdamW's order (`torch.optim.AdamW(foreach=False)`):
//   p = p * (1 - lr * wd)                               decoupled weight decay first
//   m = m + (1 - b1) * (g - m)                          torch's lerp_(g, 1 - b1), weight < 0.5
//   v = b2 * v + (1 - b2) * (g * g)
//   p = p + (-lr / bc1) * (m / (sqrt(v) / sqrt(bc2) + eps)),   bc_i = 1 - b_i^step
// The scalars (1 - lr*wd, 1 - b1, lr/bc1, sqrt(bc2)) are formed in double on the host, as torch
// does in Python, and rounded to fp32 once. Then each block's new absmax is max|m| (max v),
// and every element is requantised to the nearest code of m / absmax (v / absmax): an 8-step
// binary search for the last code <= x, then the upper neighbour if strictly closer (ties go to
// the lower code). A nonzero m keeps its sign: if the nearest code is 0 it moves to the
// smallest code of m's sign, so momentum never flips or vanishes by rounding.
//
// NaN/Inf policy (as bitsandbytes): an element whose gradient is not finite is skipped: its
// parameter is left untouched (no decay, no update) and its m and v are set to 0. The block's
// absmax is taken over the other elements.
//
// Determinism: every operation is an explicit IEEE fp32 multiply, add, divide or sqrt, correctly
// rounded, with no fused multiply-add (the CPU build has no -mfma; the CUDA kernel uses the _rn
// intrinsics), and a block's absmax is a max, exact in any order. So CPU and CUDA give the same
// bits, and a block's result depends only on that block: the state is identical for any
// sharding that keeps blocks whole.

#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace veragged::optim {

constexpr int kQmapSize = 256;

// Per-call scalars, rounded to fp32 once on the host.
struct AdamW8bitScalars {
  float decay;         // 1 - lr * weight_decay
  float one_minus_b1;  // lerp weight
  float beta2;
  float one_minus_b2;
  float neg_step_size;  // -lr / (1 - beta1^step)
  float bc2_sqrt;       // sqrt(1 - beta2^step)
  float eps;
};

inline AdamW8bitScalars make_scalars(double lr, double beta1, double beta2, double eps,
                                     double weight_decay, int64_t step) {
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  return {static_cast<float>(1.0 - lr * weight_decay), static_cast<float>(1.0 - beta1),
          static_cast<float>(beta2), static_cast<float>(1.0 - beta2),
          static_cast<float>(-(lr / bc1)), static_cast<float>(std::sqrt(bc2)),
          static_cast<float>(eps)};
}

// Arithmetic without contraction: plain operators on the CPU (compiled without FMA), the _rn
// intrinsics in CUDA device code (nvcc would otherwise fuse a*b+c).
#if defined(__CUDA_ARCH__)
#define VR_MUL(a, b) __fmul_rn(a, b)
#define VR_ADD(a, b) __fadd_rn(a, b)
#define VR_SUB(a, b) __fsub_rn(a, b)
#define VR_DIV(a, b) __fdiv_rn(a, b)
#define VR_SQRT(a) __fsqrt_rn(a)
#define VR_ABS(a) fabsf(a)
#else
#define VR_MUL(a, b) ((a) * (b))
#define VR_ADD(a, b) ((a) + (b))
#define VR_SUB(a, b) ((a) - (b))
#define VR_DIV(a, b) ((a) / (b))
#define VR_SQRT(a) std::sqrt(a)
#define VR_ABS(a) std::fabs(a)
#endif

// The updated (p, m, v) of one element; a non-finite gradient leaves p and zeroes m and v.
// Branchless: both results are computed, then selected.
struct ElementUpdate {
  float p, m, v;
};

C10_HOST_DEVICE inline ElementUpdate update_element(float p, float g, float m, float v,
                                                    const AdamW8bitScalars& s) {
  const bool ok = VR_ABS(g) <= 3.402823466e38f;  // finite: false for NaN and +-inf
  const float pd = VR_MUL(p, s.decay);
  const float mn = VR_ADD(m, VR_MUL(s.one_minus_b1, VR_SUB(g, m)));
  const float vn = VR_ADD(VR_MUL(s.beta2, v), VR_MUL(s.one_minus_b2, VR_MUL(g, g)));
  const float denom = VR_ADD(VR_DIV(VR_SQRT(vn), s.bc2_sqrt), s.eps);
  const float pn = VR_ADD(pd, VR_MUL(s.neg_step_size, VR_DIV(mn, denom)));
  return {ok ? pn : p, ok ? mn : 0.0f, ok ? vn : 0.0f};
}

// The last code whose value is <= x (0 if none): an 8-step binary search. Branchless: the
// comparisons are data-dependent and would mispredict half the time. The CPU kernel finds the
// same code faster through a bucket table (adamw8bit.cpp); every caller then rounds with
// `nearest_from_floor`, so the codes do not depend on how the floor was found.
struct SearchFloor {
  const float* qmap;
  C10_HOST_DEVICE int operator()(float x) const {
    int lo = 0;
    for (int step = kQmapSize / 2; step > 0; step >>= 1)
      lo += step & -static_cast<int>(qmap[lo + step] <= x);  // lo + step <= 255 always
    return lo;
  }
};

// Nearest code of x given its floor code `lo` (ties: the lower code).
C10_HOST_DEVICE inline int nearest_from_floor(const float* qmap, int lo, float x) {
  const int hi = lo + (lo < kQmapSize - 1);
  return lo + static_cast<int>(VR_SUB(qmap[hi], x) < VR_SUB(x, qmap[lo]));
}

// Code of value `x` (m or v) in a block with absmax `absmax`, given y = x / absmax (any value
// when absmax is 0); `zero` is the map's code of 0. `keep_sign`: a nonzero x never gets the
// zero code ([Note: AdamW8bit kernel]).
template <typename Floor>
C10_HOST_DEVICE inline uint8_t quantize_scaled(const float* qmap, const Floor& floor_code, float y,
                                               float x, float absmax, int zero, bool keep_sign) {
  if (absmax == 0.0f) return static_cast<uint8_t>(zero);
  int c = nearest_from_floor(qmap, floor_code(y), y);
  if (keep_sign && c == zero && x != 0.0f) c += x > 0.0f ? 1 : -1;
  return static_cast<uint8_t>(c);
}

template <typename Floor>
C10_HOST_DEVICE inline uint8_t quantize(const float* qmap, const Floor& floor_code, float x,
                                        float absmax, int zero, bool keep_sign) {
  const float y = absmax == 0.0f ? 0.0f : VR_DIV(x, absmax);
  return quantize_scaled(qmap, floor_code, y, x, absmax, zero, keep_sign);
}

// Checks the arguments of tensor `index` of the lists, naming them "params[index]",
// "grads[index]", ...
inline void check_adamw8bit_tensor(const char* op, int64_t index, const at::Tensor& param,
                                   const at::Tensor& grad, const at::Tensor& m_codes,
                                   const at::Tensor& v_codes, const at::Tensor& m_absmax,
                                   const at::Tensor& v_absmax, at::ScalarType dt,
                                   const at::Device& device, int64_t step, int64_t block_size) {
  const std::string at_i = "[" + std::to_string(index) + "]";
  const char* const names[] = {"params", "grads", "m_codes", "v_codes", "m_absmax", "v_absmax"};
  TORCH_CHECK_VALUE(step >= 1, op, ": steps", at_i, " must be >= 1, got ", step);
  TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op, ": ",
                    names[0], at_i, " must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK_VALUE(param.scalar_type() == dt, op, ": ", names[0], at_i, " is ",
                    param.scalar_type(), " but the first param is ", dt,
                    " (one launch takes one dtype)");
  TORCH_CHECK_VALUE(grad.scalar_type() == dt, op, ": ", names[1], at_i, " dtype ",
                    grad.scalar_type(), " differs from param dtype ", dt);
  const int64_t n = param.numel();
  const int64_t blocks = (n + block_size - 1) / block_size;
  struct Named {
    const at::Tensor& t;
    int name;
    at::ScalarType dtype;
    int64_t numel;
  };
  const Named all[] = {{param, 0, dt, n},
                       {grad, 1, dt, n},
                       {m_codes, 2, at::kByte, n},
                       {v_codes, 3, at::kByte, n},
                       {m_absmax, 4, at::kFloat, blocks},
                       {v_absmax, 5, at::kFloat, blocks}};
  for (const Named& a : all) {
    const char* name = names[a.name];
    TORCH_CHECK_VALUE(a.t.scalar_type() == a.dtype, op, ": ", name, at_i, " must be ", a.dtype,
                      ", got ", a.t.scalar_type());
    TORCH_CHECK_VALUE(a.t.numel() == a.numel, op, ": ", name, at_i, " must have ", a.numel,
                      " elements (param has ", n, ", block_size ", block_size, "), got ",
                      a.t.numel());
    TORCH_CHECK_VALUE(a.t.is_contiguous(), op, ": ", name, at_i, " must be contiguous");
    TORCH_CHECK_VALUE(a.t.device() == device, op, ": ", name, at_i, " is on ", a.t.device(),
                      " but param is on ", device);
  }
}

inline void check_qmaps(const char* op, const at::Tensor& qmap_signed,
                        const at::Tensor& qmap_unsigned, const at::Device& device) {
  const at::Tensor* maps[] = {&qmap_signed, &qmap_unsigned};
  const char* names[] = {"qmap_signed", "qmap_unsigned"};
  for (int i = 0; i < 2; ++i) {
    const at::Tensor& q = *maps[i];
    TORCH_CHECK_VALUE(q.scalar_type() == at::kFloat, op, ": ", names[i], " must be Float, got ",
                      q.scalar_type());
    TORCH_CHECK_VALUE(q.numel() == kQmapSize, op, ": ", names[i], " must have ", kQmapSize,
                      " elements, got ", q.numel());
    TORCH_CHECK_VALUE(q.is_contiguous(), op, ": ", names[i], " must be contiguous");
    TORCH_CHECK_VALUE(q.device() == device, op, ": ", names[i], " is on ", q.device(),
                      " but param is on ", device);
  }
}

// [Note: AdamW8bit multi-tensor launch]
// `adamw8bit_multi_step_` updates a list of shards (one optimizer param group and dtype: every
// 8-bit parameter of a DBuffer group) in one launch. Each tensor keeps its own quantisation
// blocks, counted from its own start ([Note: AdamW8bit on RaggedShard]); the launch numbers the
// blocks of all tensors consecutively (tensor t owns blocks [first_block, first_block + blocks))
// and each worker (a CPU task, a CUDA thread block) runs the same per-block code on the blocks
// it is given, with that tensor's scalars (its own step count). A block's result depends only on
// that block, so the results are bitwise those of one call per tensor.
struct AdamW8bitTensor {
  void* p;  // scalar_t* of the launch's dtype
  const void* g;
  uint8_t* mc;
  uint8_t* vc;
  float* m_abs;
  float* v_abs;
  int64_t n;            // elements
  int64_t first_block;  // in the launch's block numbering
  AdamW8bitScalars s;
};

// Checks every list and returns the descriptors of the non-empty tensors (and the total block
// count in `total_blocks`). Raises ValueError naming the list, the index and the values.
inline std::vector<AdamW8bitTensor> adamw8bit_descriptors(
    at::TensorList params, at::TensorList grads, at::TensorList m_codes, at::TensorList v_codes,
    at::TensorList m_absmax, at::TensorList v_absmax, const at::Tensor& qmap_signed,
    const at::Tensor& qmap_unsigned, double lr, double beta1, double beta2, double eps,
    double weight_decay, c10::IntArrayRef steps, int64_t block_size, int64_t& total_blocks) {
  const char* op = "adamw8bit_multi_step_";
  TORCH_CHECK_VALUE(block_size > 0, op, ": block_size must be > 0, got ", block_size);
  const size_t count = params.size();
  const size_t sizes[] = {grads.size(), m_codes.size(), v_codes.size(),
                          m_absmax.size(), v_absmax.size(), steps.size()};
  const char* names[] = {"grads", "m_codes", "v_codes", "m_absmax", "v_absmax", "steps"};
  for (int i = 0; i < 6; ++i)
    TORCH_CHECK_VALUE(sizes[i] == count, op, ": ", names[i], " has ", sizes[i],
                      " entries but params has ", count);
  std::vector<AdamW8bitTensor> out;
  total_blocks = 0;
  if (count == 0) return out;
  const at::ScalarType dt = params[0].scalar_type();
  const at::Device device = params[0].device();
  check_qmaps(op, qmap_signed, qmap_unsigned, device);
  out.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    check_adamw8bit_tensor(op, static_cast<int64_t>(i), params[i], grads[i], m_codes[i],
                           v_codes[i], m_absmax[i], v_absmax[i], dt, device, steps[i],
                           block_size);
    const int64_t n = params[i].numel();
    if (n == 0) continue;
    out.push_back({params[i].data_ptr(), grads[i].const_data_ptr(),
                   m_codes[i].data_ptr<uint8_t>(), v_codes[i].data_ptr<uint8_t>(),
                   m_absmax[i].data_ptr<float>(), v_absmax[i].data_ptr<float>(), n, total_blocks,
                   make_scalars(lr, beta1, beta2, eps, weight_decay, steps[i])});
    total_blocks += (n + block_size - 1) / block_size;
  }
  return out;
}

// The map's code of 0.0 (host side; the CUDA kernel finds it in shared memory).
inline int zero_code(const float* qmap) {
  for (int i = 0; i < kQmapSize; ++i)
    if (qmap[i] == 0.0f) return i;
  TORCH_CHECK_VALUE(false, "adamw8bit_multi_step_: a quantisation map must contain 0.0");
  return 0;
}

}  // namespace veragged::optim
