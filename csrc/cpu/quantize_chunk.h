// One chunk of Quantize's arithmetic on the CPU, shared by quantize.cpp (every chunk of a
// layer) and quantize_chunks.cpp (the chosen chunks only), so that both round alike: s = max|g|
// / qmax (NaN if an entry is NaN), q = g / s rounded half to even and clamped to +-qmax, a chunk
// of zeros (s = 0) divided by 1 and sent as zeros. The references: reference.quantize_ef and
// reference.quantize_chunks_ef.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace accordion {
namespace cpu {

// Round half to even of |x| < 2^22 in float arithmetic: adding 1.5 * 2^23 rounds x to an
// integer by the addition's own nearest-even rounding, and subtracting it is exact. Unlike
// nearbyint (a libm call), the loop around it vectorizes. Here |g / s| <= qmax.
inline float round_half_even(float x) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23 (IEEE arithmetic: built without -ffast-math)
  return (x + kMagic) - kMagic;
}

// The scale of a chunk whose max |g| is amax (nan: some entry was NaN).
inline float chunk_scale(float amax, bool nan, float qmax) {
  return nan ? std::numeric_limits<float>::quiet_NaN() : amax / qmax;
}

// The scale of g[0, len).
inline float chunk_scale(const float* g, int64_t len, float qmax) {
  float amax = 0.f;
  bool nan = false;
  for (int64_t j = 0; j < len; ++j) {
    const float a = std::abs(g[j]);
    nan |= std::isnan(a);
    amax = a > amax ? a : amax;
  }
  return chunk_scale(amax, nan, qmax);
}

// g[0, len) at scale s into q[0, len).
template <typename Q>
inline void round_chunk(const float* g, int64_t len, float s, float qmax, Q* q) {
  const float safe = s > 0.f ? s : 1.f;  // as torch.where(s > 0, s, 1): a NaN scale divides by 1
  for (int64_t j = 0; j < len; ++j) q[j] = static_cast<Q>(std::min(std::max(round_half_even(g[j] / safe), -qmax), qmax));
}

}  // namespace cpu
}  // namespace accordion
