// CPU kernel of accordion::ef_add: out = grad + residual, in the residual's dtype.
// A memory-bound stream: one read of each input and one write, split across threads with
// at::parallel_for; the arithmetic is done in opmath (float for half/bfloat16), exactly as
// torch's own add, so results match the plain-torch reference bit for bit.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <type_traits>

#include "ops.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define ACCORDION_HAVE_F16C_PATH 1
#endif

namespace accordion {
namespace {

constexpr int64_t kGrain = 1 << 15;  // elements per task: large enough to amortize scheduling

#ifdef ACCORDION_HAVE_F16C_PATH
// float16 <-> float32 in software costs more than the memory traffic of this op. F16C (every
// x86-64 CPU since 2012) converts 8 values per instruction; the conversions are exact one way
// and round-to-nearest-even the other, as c10::Half's, so results stay bit-identical.
// Compiled for F16C here only; used after a run-time check, so the module still loads anywhere.
const bool kCpuHasF16C = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");

template <typename R>
__attribute__((target("avx,f16c"))) void ef_add_half_f16c(const at::Half* grad, const R* residual,
                                                             R* out, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 g = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grad + i)));
    if constexpr (std::is_same_v<R, float>) {
      _mm256_storeu_ps(out + i, _mm256_add_ps(g, _mm256_loadu_ps(residual + i)));
    } else {  // half residual: add in float, round back to half
      const __m256 r = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(residual + i)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                       _mm256_cvtps_ph(_mm256_add_ps(g, r), _MM_FROUND_TO_NEAREST_INT));
    }
  }
  for (; i < end; ++i) out[i] = static_cast<R>(static_cast<float>(grad[i]) + static_cast<float>(residual[i]));
}
#endif

template <typename G, typename R>
void ef_add_loop(const G* grad, const R* residual, R* out, int64_t n) {
  using acc_t = at::opmath_type<R>;
#ifdef ACCORDION_HAVE_F16C_PATH
  if constexpr (std::is_same_v<G, at::Half> && (std::is_same_v<R, float> || std::is_same_v<R, at::Half>)) {
    if (kCpuHasF16C) {
      at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
        ef_add_half_f16c<R>(grad, residual, out, begin, end);
      });
      return;
    }
  }
#endif
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      out[i] = static_cast<R>(static_cast<acc_t>(grad[i]) + static_cast<acc_t>(residual[i]));
    }
  });
}

}  // namespace

void ef_add_out_cpu(const at::Tensor& grad, const at::Tensor& residual, at::Tensor& out) {
  const int64_t n = residual.numel();
  if (n == 0) return;
  if (grad.scalar_type() == residual.scalar_type()) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, residual.scalar_type(), "ef_add_cpu", [&] {
      ef_add_loop(grad.const_data_ptr<scalar_t>(), residual.const_data_ptr<scalar_t>(),
                  out.mutable_data_ptr<scalar_t>(), n);
    });
  } else {  // half/bfloat16 gradient into a float32 residual (checked by check_ef_add_args)
    AT_DISPATCH_REDUCED_FLOATING_TYPES(grad.scalar_type(), "ef_add_cpu_mixed", [&] {
      ef_add_loop(grad.const_data_ptr<scalar_t>(), residual.const_data_ptr<float>(),
                  out.mutable_data_ptr<float>(), n);
    });
  }
}

}  // namespace accordion
