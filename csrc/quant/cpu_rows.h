// Row kernels of the CPU tile ops (tiles.cpp): the per-element work of [Note: block-scaled
// rules] (rules.h) on contiguous runs of fp32 values, written as plain loops the compiler
// vectorises, built once per x86 ISA level (baseline, AVX2, AVX-512) and picked at run time.
//
// Every kernel gives exactly what the scalar rules give, bit for bit (NaNs included), on every
// ISA level: the E4M3 conversion is c10's (c10::Float8_e4m3fn) rewritten without branches, its
// one float operation (the subnormal rounding's fp32 addition) kept, and the clamp folded in
// (e4m3_from_product in cpu_rows_impl.h); x * mul and q * scale_inv are the same single fp32
// multiplications as in rules.h; bf16 rounding is c10's integer rounding and the fp16
// conversions are c10's own inline functions. tests/quant/test_tile_ops.py checks every level.
//
// VERAGGED_CPU_ISA=default|avx2|avx512 (read once, at the first call) forces a level no higher
// than the CPU has, for tests; unset: the highest the CPU has.
#pragma once

#include <cstdint>

namespace veragged {
namespace quant {
namespace cpu {

// Runs of `n` values cut into tiles of `tile` values (the last one partial): tile j is
// [j * tile, min(n, (j + 1) * tile)).
struct RowKernels {
  const char* isa;
  // amax[j] = max(amax[j], the largest |x| bits of tile j): the fp32 bits of max |x| when no x
  // is NaN; above 0x7F800000 when one is (the caller then finds the first NaN itself).
  void (*amax_bits)(uint32_t* amax, const float* x, int64_t n, int64_t tile);
  // q = E4M3(clamp(x * mul[j], -448, 448)) (rules.h quantize_value) for x in tile j.
  void (*quantize)(uint8_t* q, const float* x, int64_t n, int64_t tile, const float* mul);
  // y = fp32(q) * inv[j] (rules.h dequantize_value), then rounded to the output dtype.
  void (*dequantize_f32)(float* y, const uint8_t* q, int64_t n, int64_t tile, const float* inv);
  void (*dequantize_bf16)(uint16_t* y, const uint8_t* q, int64_t n, int64_t tile,
                          const float* inv);
  void (*dequantize_f16)(uint16_t* y, const uint8_t* q, int64_t n, int64_t tile,
                         const float* inv);
  // Dtype conversions (bits of c10::BFloat16 / c10::Half); `out` may equal `in` for the
  // float-to-float ones.
  void (*bf16_to_f32)(float* out, const uint16_t* in, int64_t n);
  void (*f16_to_f32)(float* out, const uint16_t* in, int64_t n);
  void (*f32_to_bf16)(uint16_t* out, const float* in, int64_t n);
  void (*f32_to_f16)(uint16_t* out, const float* in, int64_t n);
  void (*round_bf16)(float* out, const float* in, int64_t n);  // fp32(bf16(x))
  void (*round_f16)(float* out, const float* in, int64_t n);   // fp32(half(x))
};

// The kernels of the chosen ISA level (see above).
const RowKernels& row_kernels();

}  // namespace cpu
}  // namespace quant
}  // namespace veragged
