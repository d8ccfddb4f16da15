// The first pass of the CPU topk_ef kernel, over one block of at most kPassBlock entries:
//
//   g = grad + residual (written into the residual buffer), sum of g^2, a candidate record
//   for every entry with key >= lower, and g zeroed where key >= upper (entries all but
//   surely kept; see topk_ef.cpp).
//
// The key of an entry is bits(g) & 0x7fffffff (orders like |g|). A candidate record is
// key << 32 | sign << 31 | index, so the select needs nothing else from g.
//
// Two versions with identical results except for the float rounding of the sum of squares:
// a portable one (any x86-64 or other CPU: the add through ef_add_range, an SSE2 compare
// with a lane table for the listing), and an AVX-512 one chosen at run time that does it all
// in one loop over registers: add, square-accumulate, compare, compress the records, store g
// already zeroed. At a 10% ratio the portable listing spends more time per candidate than
// the memory traffic of the whole pass; the AVX-512 one does not.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/ef_add_block.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define ACCORDION_HAVE_AVX512_PASS1 1
#endif

namespace accordion {
namespace cpu {

constexpr int64_t kPassBlock = 2048;         // stays in L1 between the steps of one block
constexpr uint64_t kNoKey = uint64_t{1} << 32;  // above every key: "zero nothing"

inline uint32_t key_of(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits & 0x7fffffffu;
}
inline uint64_t record(float v, int64_t i) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return static_cast<uint64_t>(bits & 0x7fffffffu) << 32 | (bits & 0x80000000u) | static_cast<uint32_t>(i);
}
inline uint32_t record_key(uint64_t e) { return static_cast<uint32_t>(e >> 32); }
inline int64_t record_index(uint64_t e) { return static_cast<int64_t>(e & 0x7fffffffu); }
inline float record_value(uint64_t e) {
  const uint32_t bits = static_cast<uint32_t>(e >> 32) | (static_cast<uint32_t>(e) & 0x80000000u);
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// Sum of squares of a block: eight float lanes, which the compiler vectorizes, added up in
// double at the end of the block. Relative error stays below kPassBlock / 8 float roundings
// (~2e-5), plenty for the policies' gain ratio.
inline double block_sum_squares(const float* x, int64_t len) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    for (int j = 0; j < 8; ++j) lanes[j] += x[i + j] * x[i + j];
  }
  double sum = 0;
  for (; i < len; ++i) sum += static_cast<double>(x[i]) * x[i];
  for (float l : lanes) sum += l;
  return sum;
}

// For each 4-bit mask, the lanes that are set, packed to the front (a branch-free
// compaction table: the write position then simply advances by the mask's popcount).
// (The count comes from the table too: baseline x86-64 has no popcnt instruction.)
struct LaneTable {
  int32_t lanes[16][4];
  int32_t count[16];
  constexpr LaneTable() : lanes{}, count{} {
    for (int m = 0; m < 16; ++m) {
      for (int b = 0; b < 4; ++b) {
        if (m & (1 << b)) lanes[m][count[m]++] = b;
      }
    }
  }
};
constexpr LaneTable kLaneTable;

// Lists the positions in [begin, end) whose key is >= `min_key`, in order; returns how many.
// `hit` needs room for end - begin + 3 entries. Four keys per step (SSE2, part of x86-64):
// compare, take the lane mask, store the four candidate positions from the table and
// advance by the number of hits. No branch depends on the data.
inline int64_t list_hits(const float* g, int64_t begin, int64_t end, uint32_t min_key, int32_t* hit) {
  int64_t nh = 0, i = begin;
#ifdef __SSE2__
  // Keys are below 2^31, so a signed compare against min_key - 1 is exact (also for 0).
  const __m128i below = _mm_set1_epi32(static_cast<int32_t>(min_key) - 1);
  const __m128i abs_mask = _mm_set1_epi32(0x7fffffff);
  for (; i + 4 <= end; i += 4) {
    const __m128i keys = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + i)), abs_mask);
    const int mask = _mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(keys, below)));
    const __m128i lanes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kLaneTable.lanes[mask]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hit + nh), _mm_add_epi32(lanes, _mm_set1_epi32(static_cast<int32_t>(i))));
    nh += kLaneTable.count[mask];
  }
#endif
  for (; i < end; ++i) {
    hit[nh] = static_cast<int32_t>(i);
    nh += key_of(g[i]) >= min_key;
  }
  return nh;
}

// The portable block pass. `records` needs room for b1 - b0 + 8 entries; returns how many
// were written when listing, else 0. `lower` = kNoKey lists nothing.
template <typename G>
int64_t pass1_block_portable(const G* grad, float* g, int64_t b0, int64_t b1, uint64_t lower, uint64_t upper,
                             uint64_t* records, double& sq) {
  ef_add_range(grad, g, g, b0, b1);
  sq += block_sum_squares(g + b0, b1 - b0);
  int64_t nh = 0;
  if (lower != kNoKey) {
    int32_t hit[kPassBlock + 3];
    nh = list_hits(g, b0, b1, static_cast<uint32_t>(lower), hit);
    for (int64_t j = 0; j < nh; ++j) records[j] = record(g[hit[j]], hit[j]);
  }
  if (upper != kNoKey) {
    uint32_t* bits = reinterpret_cast<uint32_t*>(g);
    for (int64_t i = b0; i < b1; ++i) bits[i] = (bits[i] & 0x7fffffffu) >= upper ? 0u : bits[i];
  }
  return nh;
}

#ifdef ACCORDION_HAVE_AVX512_PASS1
inline const bool kCpuHasAvx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");

#define ACCORDION_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,popcnt,f16c")))

// 16 gradient entries as floats, exactly as the scalar conversions do it.
ACCORDION_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
ACCORDION_AVX512 inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
ACCORDION_AVX512 inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Eight records from eight keys and the matching (sign | index) words; the kept ones are
// compressed to the front of the register and stored (all eight lanes: `out` has slack).
ACCORDION_AVX512 inline int64_t store_records(__m256i keys, __m256i sign_index, __mmask8 keep, uint64_t* out) {
  const __m512i rec = _mm512_or_si512(_mm512_slli_epi64(_mm512_cvtepu32_epi64(keys), 32),
                                      _mm512_cvtepu32_epi64(sign_index));
  _mm512_storeu_si512(out, _mm512_maskz_compress_epi64(keep, rec));
  return _mm_popcnt_u32(keep);
}

template <typename G>
ACCORDION_AVX512 int64_t pass1_block_avx512(const G* grad, float* g, int64_t b0, int64_t b1, uint64_t lower,
                                            uint64_t upper, uint64_t* records, double& sq) {
  const bool listing = lower != kNoKey, zeroing = upper != kNoKey;
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), sign_mask = _mm512_set1_epi32(int(0x80000000u));
  const __m512i lo = _mm512_set1_epi32(static_cast<int32_t>(listing ? lower : 0));
  const __m512i up = _mm512_set1_epi32(static_cast<int32_t>(zeroing ? upper : 0));
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc = _mm512_setzero_ps();
  int64_t nh = 0, i = b0;
  for (; i + 16 <= b1; i += 16) {
    const __m512 v = _mm512_add_ps(load16(grad + i), _mm512_loadu_ps(g + i));
    acc = _mm512_fmadd_ps(v, v, acc);
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i keys = _mm512_and_si512(bits, abs_mask);
    if (listing) {
      const __mmask16 hit = _mm512_cmpge_epu32_mask(keys, lo);
      if (hit) {
        const __m512i sign_index = _mm512_or_si512(_mm512_and_si512(bits, sign_mask),
                                                   _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(i)), iota));
        nh += store_records(_mm512_castsi512_si256(keys), _mm512_castsi512_si256(sign_index),
                            static_cast<__mmask8>(hit), records + nh);
        nh += store_records(_mm512_extracti64x4_epi64(keys, 1), _mm512_extracti64x4_epi64(sign_index, 1),
                            static_cast<__mmask8>(hit >> 8), records + nh);
      }
    }
    const __mmask16 keep = zeroing ? _mm512_cmplt_epu32_mask(keys, up) : __mmask16(0xffff);
    _mm512_storeu_ps(g + i, _mm512_maskz_mov_ps(keep, v));
  }
  double total = _mm512_reduce_add_ps(acc);
  // The tail, entry by entry, in the same order of operations as ef_add_range.
  for (; i < b1; ++i) {
    const float v = static_cast<float>(grad[i]) + g[i];
    total += static_cast<double>(v) * v;
    const uint32_t key = key_of(v);
    if (listing && key >= lower) records[nh++] = record(v, i);
    g[i] = zeroing && key >= upper ? 0.0f : v;
  }
  sq += total;
  return nh;
}
#undef ACCORDION_AVX512
#endif

// The block pass, on the best version this CPU runs.
template <typename G>
inline int64_t pass1_block(const G* grad, float* g, int64_t b0, int64_t b1, uint64_t lower, uint64_t upper,
                           uint64_t* records, double& sq) {
#ifdef ACCORDION_HAVE_AVX512_PASS1
  if (kCpuHasAvx512) return pass1_block_avx512(grad, g, b0, b1, lower, upper, records, sq);
#endif
  return pass1_block_portable(grad, g, b0, b1, lower, upper, records, sq);
}

}  // namespace cpu
}  // namespace accordion
