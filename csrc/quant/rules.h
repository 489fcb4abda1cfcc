// The exact block-scaling rules, one inline function each, shared by the CPU kernels (tiles.cpp)
// and the CUDA kernels (cuda/tiles.cu), so both round identically.
//
// [Note: block-scaled rules]
// x is the master value rounded to the param dtype, then widened to fp32 (so quantising the
// sharded fp32 master equals quantising the full param-dtype weight in one process). For a tile
// (its real elements only; a partial tile's missing elements are not read):
//   amax = max |x| (NaN if any x is NaN).
//   kFp32Scale: a = max(amax, 1e-12); mul = 448 / a; scale_inv = 1 / mul (both fp32 divisions,
//               round-to-nearest-even); stored: scale_inv as fp32 (4 bytes). This is torchao's
//               blockwise weight quantiser (its fp64 448/amax rounded once to fp32 equals the fp32
//               division) and DeepSeek's `weight_scale_inv`.
//   kUe8m0:     a as above; e = RCEIL(a / 448) (below); scale_inv = 2^(e - 127), mul = its
//               exact reciprocal; stored: e (1 byte). DeepSeek-V3.1's ue8m0: the power of two
//               >= a / 448.
//   kMxFloor:   e = clamp(exponent(amax) - 8, -127, 128) + 127 (exponent() the unbiased fp32
//               exponent field, 8 = floor(log2 448)); 255 if amax is not finite. torchao's FLOOR.
//   kMxRceil:   e = RCEIL(amax * fp32(1/448)). torchao's RCEIL (cuBLAS's MX scale rule).
//   RCEIL(v):   v's biased fp32 exponent, plus one if v is normal with any mantissa bit set or
//               subnormal with mantissa > 0x400000; 255 if v is not finite.
//   E8M0 e as a float: 2^(e - 127) (e = 0: 2^-127, the fp32 subnormal 0x00400000; e = 255: NaN);
//   mul = the same for 254 - e (wrapping to 255, NaN, for e = 255).
//   Data: q = E4M3(clamp(x * mul, -448, 448)), round-to-nearest-even (c10::Float8_e4m3fn; NaN
//   stays NaN). Dequantised: fp32(q) * scale_inv, then rounded to the param dtype.
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/floating_point_utils.h>

#include <cstdint>

#include "quant/layout.h"

namespace veragged {
namespace quant {

constexpr float kE4M3Max = 448.0f;
constexpr float kAmaxFloor = 1e-12f;

struct TileScale {
  float mul;        // the data are x * mul
  float scale_inv;  // the value is q * scale_inv
  uint32_t stored;  // the scale's bytes (fp32 bits, or the E8M0 byte)
};

// scale_bytes() (layout.h) for device code.
C10_HOST_DEVICE inline int64_t tile_scale_bytes(int64_t format) {
  return format == kRaw ? 0 : (format == kFp32Scale ? 4 : 1);
}

C10_HOST_DEVICE inline float abs_max(float m, float v) {
  // NaN-propagating and order-independent: the CPU loop and the CUDA tree agree.
  if (m != m) return m;
  if (v != v) return v;
  const float a = v < 0.0f ? -v : v;
  return a > m ? a : m;
}

C10_HOST_DEVICE inline float combine_max(float a, float b) {
  if (a != a) return a;
  if (b != b) return b;
  return a > b ? a : b;
}

C10_HOST_DEVICE inline uint32_t rceil_e8m0(float v) {
  const uint32_t bits = c10::detail::fp32_to_bits(v);
  const uint32_t exponent = (bits >> 23) & 0xFFu, mantissa = bits & 0x7FFFFFu;
  if (exponent == 0xFFu) return 255u;  // inf or NaN
  const bool up = exponent == 0 ? mantissa > 0x400000u : mantissa != 0;
  return exponent + (up ? 1u : 0u);
}

C10_HOST_DEVICE inline float e8m0_value(uint32_t e) {
  e &= 0xFFu;
  if (e == 255u) return c10::detail::fp32_from_bits(0x7FC00000u);
  if (e == 0u) return c10::detail::fp32_from_bits(0x00400000u);
  return c10::detail::fp32_from_bits(e << 23);
}

C10_HOST_DEVICE inline TileScale e8m0_scale(uint32_t e) {
  return {e8m0_value((254u - e) & 0xFFu), e8m0_value(e), e};
}

C10_HOST_DEVICE inline TileScale tile_scale(int64_t format, float amax) {
  if (format == kFp32Scale) {
    const float a = amax < kAmaxFloor ? kAmaxFloor : amax;
    const float mul = kE4M3Max / a;
    const float inv = 1.0f / mul;
    return {mul, inv, c10::detail::fp32_to_bits(inv)};
  }
  if (format == kUe8m0) {
    const float a = amax < kAmaxFloor ? kAmaxFloor : amax;
    return e8m0_scale(rceil_e8m0(a / kE4M3Max));
  }
  if (format == kMxRceil) return e8m0_scale(rceil_e8m0(amax * (1.0f / kE4M3Max)));
  // kMxFloor
  const uint32_t bits = c10::detail::fp32_to_bits(amax);
  if (((bits >> 23) & 0xFFu) == 0xFFu) return e8m0_scale(255u);
  int32_t e = static_cast<int32_t>((bits >> 23) & 0xFFu) - 127 - 8;
  e = e < -127 ? -127 : (e > 128 ? 128 : e);
  return e8m0_scale(static_cast<uint32_t>(e + 127));
}

C10_HOST_DEVICE inline uint8_t quantize_value(float x, float mul) {
  float y = x * mul;
  y = y > kE4M3Max ? kE4M3Max : (y < -kE4M3Max ? -kE4M3Max : y);  // NaN stays NaN
  return c10::Float8_e4m3fn(y).x;
}

C10_HOST_DEVICE inline float dequantize_value(uint8_t q, float scale_inv) {
  return static_cast<float>(c10::Float8_e4m3fn(q, c10::Float8_e4m3fn::from_bits())) * scale_inv;
}

// The scale_inv a stored scale means (4 bytes of fp32, or one E8M0 byte).
C10_HOST_DEVICE inline float stored_scale_inv(int64_t format, const uint8_t* p) {
  if (format == kFp32Scale) {
    uint32_t bits = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
                    (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
    return c10::detail::fp32_from_bits(bits);
  }
  return e8m0_value(p[0]);
}

C10_HOST_DEVICE inline void store_scale(int64_t format, uint8_t* p, uint32_t stored) {
  if (format == kFp32Scale) {
    p[0] = stored & 0xFFu;
    p[1] = (stored >> 8) & 0xFFu;
    p[2] = (stored >> 16) & 0xFFu;
    p[3] = (stored >> 24) & 0xFFu;
  } else {
    p[0] = static_cast<uint8_t>(stored);
  }
}

}  // namespace quant
}  // namespace veragged
