// The error-feedback add over one range of elements, shared by the CPU kernels that start
// with it (ef_add, topk_ef). Arithmetic is done in opmath (float for half/bfloat16), exactly
// as torch's own add, so results match the plain-torch reference bit for bit.
#pragma once

#include <ATen/OpMathType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define ACCORDION_HAVE_F16C_PATH 1
#endif

namespace accordion {
namespace cpu {

#ifdef ACCORDION_HAVE_F16C_PATH
// float16 -> float32 in software costs more than the memory traffic of this op (the mixed
// case, a half gradient into a float32 residual; same-dtype adds go through torch). F16C (every
// x86-64 CPU since 2012) converts 8 values per instruction; the conversions are exact one way
// and round-to-nearest-even the other, as c10::Half's, so results stay bit-identical.
// Compiled for F16C here only; used after a run-time check, so the module still loads anywhere.
inline const bool kCpuHasF16C = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");

__attribute__((target("avx,f16c"))) inline void ef_add_half_f16c(const at::Half* grad, const float* residual,
                                                                    float* out, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 g = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grad + i)));
    _mm256_storeu_ps(out + i, _mm256_add_ps(g, _mm256_loadu_ps(residual + i)));
  }
  for (; i < end; ++i) out[i] = static_cast<float>(grad[i]) + residual[i];
}
#endif

// out[i] = grad[i] + residual[i] for begin <= i < end; out may alias residual.
template <typename G, typename R>
inline void ef_add_range(const G* grad, const R* residual, R* out, int64_t begin, int64_t end) {
#ifdef ACCORDION_HAVE_F16C_PATH
  if constexpr (std::is_same_v<G, at::Half> && std::is_same_v<R, float>) {
    if (kCpuHasF16C) return ef_add_half_f16c(grad, residual, out, begin, end);
  }
#endif
  using acc_t = at::opmath_type<R>;
  for (int64_t i = begin; i < end; ++i) {
    out[i] = static_cast<R>(static_cast<acc_t>(grad[i]) + static_cast<acc_t>(residual[i]));
  }
}

}  // namespace cpu
}  // namespace accordion
