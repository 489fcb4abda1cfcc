// The bodies of the row kernels (cpu_rows.h), included by cpu_rows.cpp once per ISA level with
// VERAGGED_ISA_NS (a namespace) and VERAGGED_ISA_TARGET (the function attribute, possibly empty)
// defined. No include guard: it is meant to be included several times.
//
// The loops are plain element-wise code over fp32/uint32 values (selects, shifts, integer max),
// which GCC and Clang vectorise at -O3 for the target ISA; the results are the same on every
// level because each element's value is computed by the same IEEE operations, none contracted
// into an FMA (cpu_rows.cpp turns GCC's contraction off).

namespace VERAGGED_ISA_NS {

using c10::detail::fp32_from_bits;
using c10::detail::fp32_to_bits;

// a * b, but a itself when a is NaN: the NaN the scalar rules.h code gets on x86 (mulss a, b
// returns a NaN a, quietened, whatever b is). Which NaN of two a vector multiply returns depends
// on the operand order the compiler picks, and a NaN's sign decides between the E4M3 bytes 0x7F
// and 0xFF (a NaN's payload is kept by fp32 dequantisation).
VERAGGED_ALWAYS_INLINE float product(float a, float b) {
  const float p = a * b;
  return a != a ? a : p;
}

// rules.h's quantize_value(x, mul) given y = x * mul: clamp to +-448, then
// c10::Float8_e4m3fn(y) (c10::detail::fp8e4m3fn_from_fp32_value), without branches.
//   NaN (|bits| > inf's): 0x7F, the sign kept (the clamp keeps NaN; c10 maps NaN to 0x7F).
//   |y| > 448, inf included: the clamp gives +-448, which is 0x7E.
//   |y| < 2^-6 (fp32 bits < 121 << 23): c10's subnormal path, the same fp32 addition of 2^14,
//     which rounds |y| * 2^9 to an integer (0..8) to nearest even.
//   else: c10's normal path, the exponent rebiased with the round-to-nearest-even bias.
VERAGGED_ALWAYS_INLINE uint8_t e4m3_from_product(float y) {
  const uint32_t bits = fp32_to_bits(y);
  const uint32_t a = bits & 0x7FFFFFFFu;
  const uint32_t sign = (bits >> 24) & 0x80u;
  constexpr uint32_t kDenormMask = UINT32_C(141) << 23;  // 2^14
  const uint32_t sub =
      fp32_to_bits(fp32_from_bits(a) + fp32_from_bits(kDenormMask)) - kDenormMask;
  const uint32_t norm = (a + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
  uint32_t r = a < (UINT32_C(121) << 23) ? sub : norm;
  r = a > UINT32_C(0x43E00000) ? 0x7Eu : r;  // 448.0f
  r = a > UINT32_C(0x7F800000) ? 0x7Fu : r;
  return static_cast<uint8_t>(r | sign);
}

// c10::BFloat16(float) (c10::detail::round_to_nearest_even), NaN tested on the bits.
VERAGGED_ALWAYS_INLINE uint16_t bf16_bits(float x) {
  const uint32_t u = fp32_to_bits(x);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}

VERAGGED_ISA_TARGET void amax_bits(uint32_t* amax, const float* x, int64_t n, int64_t tile) {
  for (int64_t j = 0, t = 0; j < n; j += tile, ++t) {
    const int64_t len = n - j < tile ? n - j : tile;
    const float* xs = x + j;
    uint32_t m = amax[t];
    for (int64_t i = 0; i < len; ++i) {
      const uint32_t b = fp32_to_bits(xs[i]) & 0x7FFFFFFFu;
      m = b > m ? b : m;
    }
    amax[t] = m;
  }
}

VERAGGED_ISA_TARGET void quantize(uint8_t* q, const float* x, int64_t n, int64_t tile,
                                  const float* mul) {
  for (int64_t j = 0, t = 0; j < n; j += tile, ++t) {
    const int64_t len = n - j < tile ? n - j : tile;
    const float m = mul[t];
    const float* xs = x + j;
    uint8_t* qs = q + j;
    for (int64_t i = 0; i < len; ++i) qs[i] = e4m3_from_product(product(xs[i], m));
  }
}

VERAGGED_ISA_TARGET void dequantize_f32(float* y, const uint8_t* q, int64_t n, int64_t tile,
                                        const float* inv) {
  for (int64_t j = 0, t = 0; j < n; j += tile, ++t) {
    const int64_t end = n - j < tile ? n : j + tile;
    const float s = inv[t];
    for (int64_t i = j; i < end; ++i) y[i] = product(e4m3_values[q[i]], s);
  }
}

VERAGGED_ISA_TARGET void dequantize_bf16(uint16_t* y, const uint8_t* q, int64_t n, int64_t tile,
                                         const float* inv) {
  for (int64_t j = 0, t = 0; j < n; j += tile, ++t) {
    const int64_t end = n - j < tile ? n : j + tile;
    const float s = inv[t];
    for (int64_t i = j; i < end; ++i) y[i] = bf16_bits(product(e4m3_values[q[i]], s));
  }
}

VERAGGED_ISA_TARGET void dequantize_f16(uint16_t* y, const uint8_t* q, int64_t n, int64_t tile,
                                        const float* inv) {
  for (int64_t j = 0, t = 0; j < n; j += tile, ++t) {
    const int64_t end = n - j < tile ? n : j + tile;
    const float s = inv[t];
    for (int64_t i = j; i < end; ++i)
      y[i] = c10::detail::fp16_ieee_from_fp32_value(product(e4m3_values[q[i]], s));
  }
}

VERAGGED_ISA_TARGET void bf16_to_f32(float* out, const uint16_t* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = fp32_from_bits(static_cast<uint32_t>(in[i]) << 16);
}

VERAGGED_ISA_TARGET void f16_to_f32(float* out, const uint16_t* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = c10::detail::fp16_ieee_to_fp32_value(in[i]);
}

VERAGGED_ISA_TARGET void f32_to_bf16(uint16_t* out, const float* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits(in[i]);
}

VERAGGED_ISA_TARGET void f32_to_f16(uint16_t* out, const float* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = c10::detail::fp16_ieee_from_fp32_value(in[i]);
}

VERAGGED_ISA_TARGET void round_bf16(float* out, const float* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = fp32_from_bits(static_cast<uint32_t>(bf16_bits(in[i])) << 16);
}

VERAGGED_ISA_TARGET void round_f16(float* out, const float* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = c10::detail::fp16_ieee_to_fp32_value(c10::detail::fp16_ieee_from_fp32_value(in[i]));
}

const RowKernels kKernels = {
    VERAGGED_ISA_NAME, amax_bits,  quantize,    dequantize_f32, dequantize_bf16, dequantize_f16,
    bf16_to_f32,       f16_to_f32, f32_to_bf16, f32_to_f16,     round_bf16,      round_f16,
};

}  // namespace VERAGGED_ISA_NS
