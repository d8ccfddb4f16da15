// CPU kernels of accordion::flush_whole and accordion::settle_sent_: a layer (or a front end's
// flat buffer) sent whole in a wire dtype, its rounding kept in error feedback (float32).
// Each is one pass where the plain-torch form (reference.py) takes three to five: flushing,
// e += grad and e rounded to the wire dtype; settling, e -= round(e).
//
// Work goes in tiles of kTile elements through a float buffer on the stack (in L1): the 16-bit
// conversions of a tile in one loop each (F16C for float16, 8 per instruction; bit operations
// the compiler vectorizes for bfloat16), the float arithmetic in another. c10's scalar
// conversions, one element at a time, cost more than the memory traffic (measured: 4x slower
// than torch's three passes for a float32 gradient). Rounding is round-to-nearest-even, as
// torch's casts, so results match the reference bit for bit.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "cpu/ef_add_block.h"
#include "cpu/kernels.h"

namespace accordion {
namespace {

constexpr int64_t kGrain = 1 << 15;  // elements per task
constexpr int64_t kTile = 512;       // elements per tile (2 KiB of float)

// --- bfloat16: the top half of a float; rounding as c10::BFloat16's round_to_nearest_even ----
inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t rounded_bf16_bits(float f) {  // as a float's bits, the low half zero; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + (((u >> 16) & 1u) + 0x7FFFu)) & 0xFFFF0000u;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : rounded;
}

// --- float16: F16C where the CPU has it (every x86-64 since 2012), c10's conversion else -----
#ifdef ACCORDION_HAVE_F16C_PATH
__attribute__((target("avx,f16c"))) void half_to_float_f16c(const at::Half* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  for (; i < n; ++i) out[i] = static_cast<float>(in[i]);
}

__attribute__((target("avx,f16c"))) void float_to_half_f16c(const float* in, at::Half* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) out[i] = static_cast<at::Half>(in[i]);
}
#endif

// The bfloat16 loops, compiled twice: for AVX2 (picked at load time where the CPU has it;
// baseline x86-64 lacks the 32-to-16-bit pack) and for any x86-64.
__attribute__((target_clones("avx2", "default"))) void bf16_to_float_n(const uint16_t* bits, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(bits[i]);
}

__attribute__((target_clones("avx2", "default"))) void float_to_bf16_n(const float* in, uint16_t* bits, int64_t n) {
  for (int64_t i = 0; i < n; ++i) bits[i] = static_cast<uint16_t>(rounded_bf16_bits(in[i]) >> 16);
}

__attribute__((target_clones("avx2", "default"))) void round_trip_bf16_n(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = rounded_bf16_bits(x[i]);
    std::memcpy(x + i, &u, sizeof u);
  }
}

template <typename T>
void to_float(const T* in, float* out, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(out, in, n * sizeof(float));
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    bf16_to_float_n(reinterpret_cast<const uint16_t*>(in), out, n);
  } else {
#ifdef ACCORDION_HAVE_F16C_PATH
    if (cpu::kCpuHasF16C) return half_to_float_f16c(in, out, n);
#endif
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]);
  }
}

template <typename T>
void from_float(const float* in, T* out, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(out, in, n * sizeof(float));
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    float_to_bf16_n(in, reinterpret_cast<uint16_t*>(out), n);
  } else {
#ifdef ACCORDION_HAVE_F16C_PATH
    if (cpu::kCpuHasF16C) return float_to_half_f16c(in, out, n);
#endif
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<at::Half>(in[i]);
  }
}

// in place: x = x rounded to T and back
template <typename T>
void round_trip(float* x, int64_t n) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    round_trip_bf16_n(x, n);
  } else {
    at::Half tile[kTile];
    from_float(x, tile, n);
    to_float(tile, x, n);
  }
}

template <typename G, typename O>
void flush_range(const G* grad, float* e, O* out, int64_t begin, int64_t end) {
  float g[kTile];
  for (int64_t t = begin; t < end; t += kTile) {
    const int64_t n = std::min(kTile, end - t);
    to_float(grad + t, g, n);
    float* et = e + t;
    for (int64_t i = 0; i < n; ++i) {
      g[i] += et[i];
      et[i] = g[i];
    }
    from_float(g, out + t, n);
  }
}

template <typename S>
void settle_range(float* e, int64_t begin, int64_t end) {
  float sent[kTile];
  for (int64_t t = begin; t < end; t += kTile) {
    const int64_t n = std::min(kTile, end - t);
    std::memcpy(sent, e + t, n * sizeof(float));
    round_trip<S>(sent, n);
    float* et = e + t;
    for (int64_t i = 0; i < n; ++i) et[i] -= sent[i];
  }
}

// Calls f(T{}) with T the storage type of `dtype`: float, at::Half or at::BFloat16 (checked).
template <typename F>
void with_type(at::ScalarType dtype, F f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kHalf: return f(at::Half{});
    case at::kBFloat16: return f(at::BFloat16{});
    default: TORCH_CHECK(false, "accordion::flush_whole: unsupported dtype ", dtype);
  }
}

}  // namespace

void flush_whole_cpu(const at::Tensor& grad, const at::Tensor& residual, at::Tensor& out) {
  const int64_t n = residual.numel();
  float* e = residual.mutable_data_ptr<float>();
  with_type(grad.scalar_type(), [&](auto grad_type) {
    using G = decltype(grad_type);
    const G* g = static_cast<const G*>(grad.const_data_ptr());
    with_type(out.scalar_type(), [&](auto out_type) {
      using O = decltype(out_type);
      O* o = static_cast<O*>(out.mutable_data_ptr());
      at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) { flush_range(g, e, o, begin, end); });
    });
  });
}

void settle_sent_cpu(const at::Tensor& residual, at::ScalarType sent) {
  const int64_t n = residual.numel();
  float* e = residual.mutable_data_ptr<float>();
  if (sent == at::kFloat) {  // nothing rounded away
    residual.zero_();
    return;
  }
  AT_DISPATCH_REDUCED_FLOATING_TYPES(sent, "settle_sent_cpu", [&] {
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) { settle_range<scalar_t>(e, begin, end); });
  });
}

}  // namespace accordion
