// The row kernels (cpu_rows.h) built for each x86 ISA level from cpu_rows_impl.h, and the
// run-time choice among them.

// GCC, for every function of this file (c10's inline conversions included, which the row
// kernels must inline): no FP contraction (GCC's avx512f brings FMA, and GCC contracts a * b + c
// into one FMA by default in C++, which would change c10's fp16 conversion: a multiply, then an
// add), and no trapping math, which lets GCC compute both arms of a select, as a vector loop
// must (it changes no value). Clang contracts within one expression only (c10's multiply and add
// are separate statements) and ignores FP exceptions by default.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off", "no-trapping-math")
#endif

#include "quant/cpu_rows.h"

#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <c10/util/floating_point_utils.h>

#include <cstdlib>
#include <string>

namespace veragged {
namespace quant {
namespace cpu {
namespace {

// fp32 of every E4M3 byte (c10::Float8_e4m3fn's conversion), filled by row_kernels().
float e4m3_values[256];

#define VERAGGED_ALWAYS_INLINE static inline __attribute__((always_inline))

#define VERAGGED_ISA_NS isa_default
#define VERAGGED_ISA_NAME "default"
#define VERAGGED_ISA_TARGET
#include "quant/cpu_rows_impl.h"
#undef VERAGGED_ISA_NS
#undef VERAGGED_ISA_NAME
#undef VERAGGED_ISA_TARGET

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define VERAGGED_X86_LEVELS 1
#define VERAGGED_ISA_NS isa_avx2
#define VERAGGED_ISA_NAME "avx2"
#define VERAGGED_ISA_TARGET __attribute__((target("avx2")))
#include "quant/cpu_rows_impl.h"
#undef VERAGGED_ISA_NS
#undef VERAGGED_ISA_NAME
#undef VERAGGED_ISA_TARGET

#define VERAGGED_ISA_NS isa_avx512
#define VERAGGED_ISA_NAME "avx512"
#define VERAGGED_ISA_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))
#include "quant/cpu_rows_impl.h"
#undef VERAGGED_ISA_NS
#undef VERAGGED_ISA_NAME
#undef VERAGGED_ISA_TARGET
#endif

const RowKernels& choose() {
  for (int i = 0; i < 256; ++i)
    e4m3_values[i] = c10::detail::fp8e4m3fn_to_fp32_value(static_cast<uint8_t>(i));
  const char* env = std::getenv("VERAGGED_CPU_ISA");
  const std::string forced = env ? env : "";
  TORCH_CHECK_VALUE(forced.empty() || forced == "default" || forced == "avx2" ||
                        forced == "avx512",
                    "VERAGGED_CPU_ISA must be default, avx2 or avx512, got '", forced, "'");
#ifdef VERAGGED_X86_LEVELS
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  TORCH_CHECK_VALUE(forced != "avx512" || avx512, "VERAGGED_CPU_ISA=avx512: this CPU lacks it");
  TORCH_CHECK_VALUE(forced != "avx2" || avx2, "VERAGGED_CPU_ISA=avx2: this CPU lacks it");
  if (forced == "default") return isa_default::kKernels;
  if (forced == "avx2") return isa_avx2::kKernels;
  if (avx512) return isa_avx512::kKernels;
  if (avx2) return isa_avx2::kKernels;
#else
  TORCH_CHECK_VALUE(forced.empty() || forced == "default", "VERAGGED_CPU_ISA=", forced,
                    ": not an x86-64 build");
#endif
  return isa_default::kKernels;
}

}  // namespace

const RowKernels& row_kernels() {
  static const RowKernels& chosen = choose();
  return chosen;
}

}  // namespace cpu
}  // namespace quant
}  // namespace veragged
