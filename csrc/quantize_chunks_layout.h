// Quantize's sparse chunks: the numbers every backend shares (quantize_chunks.h says what they
// mean). No torch here: the CUDA kernels include it too (scripts/cuda_check.sh).
#pragma once

#include <cstdint>

namespace accordion {

constexpr int64_t kSumBlock = 1024;  // chunks per block of the running sum (codecs/quantize_chunks.py BLOCK)

inline int64_t quantize_chunks_payload_bytes(int64_t k, int64_t chunk, int64_t bits) {
  return 4 + 8 * k + (k * chunk * bits + 31) / 32 * 4;
}

inline int64_t pow2_at_least(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

}  // namespace accordion
