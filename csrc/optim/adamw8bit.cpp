// CPU kernel of `veragged::adamw8bit_step_`; see [Note: AdamW8bit kernel] in adamw8bit.h.
// Parallel over quantisation blocks: each task updates whole blocks, so blocks never share a
// write and the result does not depend on the thread count.

#include "optim/adamw8bit.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace veragged::optim {
namespace {

constexpr int64_t kGrainElements = 1 << 14;  // elements per parallel task (rounded to blocks)

template <typename scalar_t>
void step_blocks(scalar_t* p, const scalar_t* g, uint8_t* mc, uint8_t* vc, float* m_abs,
                 float* v_abs, const float* qs, const float* qu, int zs, int zu, int64_t n,
                 int64_t bs, const AdamW8bitScalars& s) {
  const int64_t blocks = (n + bs - 1) / bs;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / bs);
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> m(static_cast<size_t>(bs)), v(static_cast<size_t>(bs));
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * bs, len = std::min(bs, n - lo);
      const float old_m_abs = m_abs[b], old_v_abs = v_abs[b];
      float new_m_abs = 0.0f, new_v_abs = 0.0f;
      for (int64_t j = 0; j < len; ++j) {
        const int64_t i = lo + j;
        const ElementUpdate u = update_element(
            static_cast<float>(p[i]), static_cast<float>(g[i]), qs[mc[i]] * old_m_abs,
            qu[vc[i]] * old_v_abs, s);
        if (u.ok) p[i] = static_cast<scalar_t>(u.p);
        m[j] = u.m;
        v[j] = u.v;
        new_m_abs = std::max(new_m_abs, std::fabs(u.m));
        new_v_abs = std::max(new_v_abs, std::fabs(u.v));
      }
      for (int64_t j = 0; j < len; ++j) {
        mc[lo + j] = quantize(qs, m[j], new_m_abs, zs, /*keep_sign=*/true);
        vc[lo + j] = quantize(qu, v[j], new_v_abs, zu, /*keep_sign=*/false);
      }
      m_abs[b] = new_m_abs;
      v_abs[b] = new_v_abs;
    }
  });
}

void adamw8bit_step_cpu(at::Tensor param, const at::Tensor& grad, at::Tensor m_codes,
                        at::Tensor v_codes, at::Tensor m_absmax, at::Tensor v_absmax,
                        const at::Tensor& qmap_signed, const at::Tensor& qmap_unsigned, double lr,
                        double beta1, double beta2, double eps, double weight_decay, int64_t step,
                        int64_t block_size) {
  check_adamw8bit_args(param, grad, m_codes, v_codes, m_absmax, v_absmax, qmap_signed,
                       qmap_unsigned, step, block_size);
  const int64_t n = param.numel();
  if (n == 0) return;
  const AdamW8bitScalars s = make_scalars(lr, beta1, beta2, eps, weight_decay, step);
  const float* qs = qmap_signed.const_data_ptr<float>();
  const float* qu = qmap_unsigned.const_data_ptr<float>();
  const int zs = zero_code(qs), zu = zero_code(qu);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, param.scalar_type(), "adamw8bit", [&] {
    step_blocks<scalar_t>(param.data_ptr<scalar_t>(), grad.const_data_ptr<scalar_t>(),
                          m_codes.data_ptr<uint8_t>(), v_codes.data_ptr<uint8_t>(),
                          m_absmax.data_ptr<float>(), v_absmax.data_ptr<float>(), qs, qu, zs, zu,
                          n, block_size, s);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(veragged, CPU, m) { m.impl("adamw8bit_step_", &adamw8bit_step_cpu); }

}  // namespace veragged::optim
