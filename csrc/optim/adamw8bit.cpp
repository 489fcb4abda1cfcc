// CPU kernels of `veragged::adamw8bit_multi_step_`; see
// [Note: AdamW8bit kernel] and [Note: AdamW8bit multi-tensor launch] in adamw8bit.h. Parallel
// over quantisation blocks (of all tensors of a launch): each task updates whole blocks, so
// blocks never share a write and the result does not depend on the thread count.
//
// [Note: floor-code bucket table]
// Requantising is the costly part: two 8-step searches per element, each step a dependent load.
// The CPU kernel finds the floor code (SearchFloor's answer) through a table instead: floats are
// bucketed by sign, exponent (all exponents below 2^-kExpSpan share one bucket) and their top
// kMantBits mantissa bits; `start[b]` is the floor code of the bucket's smallest value, and the
// floor code of any value of the bucket is at most `steps` codes above it (measured when the
// table is built: 2 for the bitsandbytes maps). Since the floor code is monotone in the value,
// `steps` branchless compares from `start[b]` give exactly SearchFloor's answer; the rounding
// that follows is the shared `nearest_from_floor`. Tables are cached by map contents.

#include "optim/adamw8bit.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

namespace veragged::optim {
namespace {

constexpr int64_t kGrainElements = 1 << 14;  // elements per parallel task (rounded to blocks)

class FloorTable {
 public:
  static constexpr int kMantBits = 7, kExpSpan = 40;
  static constexpr uint32_t kMinExp = 127 - kExpSpan;  // biased exponent of 2^-kExpSpan
  static constexpr int kExps = kExpSpan + 2;           // the underflow bucket, then 2^-40 .. 2^0

  explicit FloorTable(const float* qmap) : start_(2 * kExps << kMantBits) {
    std::memcpy(qmap_, qmap, sizeof(float) * kQmapSize);
    qmap_[kQmapSize] = std::numeric_limits<float>::infinity();  // so lo + 1 is always readable
    const SearchFloor search{qmap_};
    for (uint32_t sign = 0; sign < 2; ++sign) {
      for (int ei = 0; ei < kExps; ++ei) {
        for (uint32_t m = 0; m < (1u << kMantBits); ++m) {
          uint32_t lo_bits = 0, hi_bits = ((kMinExp << 23) - 1);  // the underflow bucket
          if (ei > 0) {
            lo_bits = ((kMinExp + ei - 1) << 23) | (m << (23 - kMantBits));
            hi_bits = lo_bits | ((1u << (23 - kMantBits)) - 1);
          } else if (m > 0) {
            continue;  // the underflow bucket uses m = 0 only
          }
          const float mag_lo = from_bits(lo_bits), mag_hi = from_bits(hi_bits);
          const float xmin = sign ? -mag_hi : mag_lo, xmax = sign ? -mag_lo : mag_hi;
          const int first = search(xmin);
          start_[index(sign, ei, m)] = static_cast<uint8_t>(first);
          steps_ = std::max(steps_, search(xmax) - first);
        }
      }
    }
  }

  bool same_map(const float* qmap) const {
    return std::memcmp(qmap_, qmap, sizeof(float) * kQmapSize) == 0;
  }

  int operator()(float y) const {
    uint32_t bits;
    std::memcpy(&bits, &y, sizeof bits);
    const uint32_t e = (bits >> 23) & 0xFF;
    if (e > 127) return SearchFloor{qmap_}(y);  // |y| >= 2, inf, NaN: not an absmax-scaled value
    const int ei = e < kMinExp ? 0 : static_cast<int>(e - kMinExp) + 1;
    const uint32_t m = ei ? (bits >> (23 - kMantBits)) & ((1u << kMantBits) - 1) : 0;
    int lo = start_[index(bits >> 31, ei, m)];
    for (int i = 0; i < steps_; ++i) lo += static_cast<int>(qmap_[lo + 1] <= y);
    return lo;
  }

 private:
  static size_t index(uint32_t sign, int ei, uint32_t m) {
    return ((static_cast<size_t>(sign) * kExps + ei) << kMantBits) | m;
  }
  static float from_bits(uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }

  float qmap_[kQmapSize + 1];
  std::vector<uint8_t> start_;
  int steps_ = 0;
};

// The table of `qmap`, from a small cache keyed by the map's values.
std::shared_ptr<const FloorTable> floor_table(const float* qmap) {
  static std::mutex mutex;
  static std::vector<std::shared_ptr<const FloorTable>> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  for (const auto& t : cache)
    if (t->same_map(qmap)) return t;
  if (cache.size() >= 8) cache.erase(cache.begin());
  cache.push_back(std::make_shared<const FloorTable>(qmap));
  return cache.back();
}

constexpr int kLanes = 8;

// Scratch of one task: the dequantised moments and their scaled values, for one block.
struct Scratch {
  explicit Scratch(int64_t bs) : buf(static_cast<size_t>(4 * bs)) {}
  std::vector<float> buf;
};

// Block `b` (counted from the tensor's start) of tensor `t`: the whole update of
// [Note: AdamW8bit kernel], in place.
template <typename scalar_t>
void step_block(const AdamW8bitTensor& t, int64_t b, int64_t bs, const float* qs,
                const float* qu, const FloorTable& fs, const FloorTable& fu, int zs, int zu,
                Scratch& scratch) {
  scalar_t* p = static_cast<scalar_t*>(t.p);
  const scalar_t* g = static_cast<const scalar_t*>(t.g);
  uint8_t* mc = t.mc;
  uint8_t* vc = t.vc;
  const AdamW8bitScalars& s = t.s;
  float* m = scratch.buf.data();
  float* v = m + bs;
  float* ym = v + bs;  // m and v divided by the block's new absmax
  float* yv = ym + bs;
  const int64_t lo = b * bs, len = std::min(bs, t.n - lo);
  const float old_m_abs = t.m_abs[b], old_v_abs = t.v_abs[b];
  for (int64_t j = 0; j < len; ++j) {  // dequantise: table lookups
    m[j] = qs[mc[lo + j]] * old_m_abs;
    v[j] = qu[vc[lo + j]] * old_v_abs;
  }
  for (int64_t j = 0; j < len; ++j) {  // the element math (vectorised: no lookups)
    const ElementUpdate u = update_element(static_cast<float>(p[lo + j]),
                                           static_cast<float>(g[lo + j]), m[j], v[j], s);
    p[lo + j] = static_cast<scalar_t>(u.p);  // u.p == p for a non-finite gradient
    m[j] = u.m;
    v[j] = u.v;
  }
  // Block absmax in kLanes independent lanes (vectorisable; a max of finite values is exact in
  // any order, so the result is the sequential one).
  float lane_m[kLanes] = {}, lane_v[kLanes] = {};
  for (int64_t j = 0; j < len; ++j) {
    const float am = std::fabs(m[j]);
    lane_m[j % kLanes] = lane_m[j % kLanes] < am ? am : lane_m[j % kLanes];
    lane_v[j % kLanes] = lane_v[j % kLanes] < v[j] ? v[j] : lane_v[j % kLanes];  // v >= 0
  }
  float new_m_abs = 0.0f, new_v_abs = 0.0f;
  for (int k = 0; k < kLanes; ++k) {
    new_m_abs = std::max(new_m_abs, lane_m[k]);
    new_v_abs = std::max(new_v_abs, lane_v[k]);
  }
  // Scale into the maps' [-1, 1] range (divisions, vectorised), then look the codes up.
  const float dm = new_m_abs == 0.0f ? 1.0f : new_m_abs;
  const float dv = new_v_abs == 0.0f ? 1.0f : new_v_abs;
  for (int64_t j = 0; j < len; ++j) {
    ym[j] = m[j] / dm;
    yv[j] = v[j] / dv;
  }
  for (int64_t j = 0; j < len; ++j) {
    mc[lo + j] = quantize_scaled(qs, fs, ym[j], m[j], new_m_abs, zs, /*keep_sign=*/true);
    vc[lo + j] = quantize_scaled(qu, fu, yv[j], v[j], new_v_abs, zu, /*keep_sign=*/false);
  }
  t.m_abs[b] = new_m_abs;
  t.v_abs[b] = new_v_abs;
}

// Every block of every tensor, in parallel over the launch's block numbering
// ([Note: AdamW8bit multi-tensor launch]): a task finds the tensor of its first block by binary
// search and walks on from there.
void step_tensors(const std::vector<AdamW8bitTensor>& tensors, int64_t total_blocks, int64_t bs,
                  at::ScalarType dtype, const at::Tensor& qmap_signed,
                  const at::Tensor& qmap_unsigned) {
  if (tensors.empty()) return;
  const float* qs = qmap_signed.const_data_ptr<float>();
  const float* qu = qmap_unsigned.const_data_ptr<float>();
  const int zs = zero_code(qs), zu = zero_code(qu);
  const auto fs = floor_table(qs), fu = floor_table(qu);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / bs);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "adamw8bit", [&] {
    at::parallel_for(0, total_blocks, grain, [&](int64_t b0, int64_t b1) {
      Scratch scratch(bs);
      auto it = std::upper_bound(
          tensors.begin(), tensors.end(), b0,
          [](int64_t b, const AdamW8bitTensor& t) { return b < t.first_block; });
      size_t i = static_cast<size_t>(it - tensors.begin()) - 1;  // first_block <= b0
      for (int64_t b = b0; b < b1; ++b) {
        while (i + 1 < tensors.size() && tensors[i + 1].first_block <= b) ++i;
        step_block<scalar_t>(tensors[i], b - tensors[i].first_block, bs, qs, qu, *fs, *fu, zs,
                             zu, scratch);
      }
    });
  });
}

void adamw8bit_multi_step_cpu(at::TensorList params, at::TensorList grads,
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
  step_tensors(tensors, total_blocks, block_size, params[0].scalar_type(), qmap_signed,
               qmap_unsigned);
}

}  // namespace

TORCH_LIBRARY_IMPL(veragged, CPU, m) {
  m.impl("adamw8bit_multi_step_", &adamw8bit_multi_step_cpu);
}

}  // namespace veragged::optim
