// The writing walk of the CPU topk_ef kernel: once the threshold key T is known, each chunk
// walks its entries in index order and writes the kept ones (key > T, or key == T while the
// chunk's share of ties lasts) to values and indices, from the chunk's output offset on. It
// also mends g where pass 1's zeroing guessed wrong (see Outputs).
//
// EntryWriter takes one entry at a time and has no data-dependent branch: every entry is
// written at the next output slot while slots remain, and the slot only advances when the
// entry is kept. write_records runs it over a chunk's candidate records; on AVX-512 CPUs it
// decides eight records at once and compresses the kept ones into place, leaving to
// EntryWriter only the groups holding a tie or an entry whose g needs mending (a few percent).
#pragma once

#include <cstdint>

#include "cpu/topk_pass1.h"

namespace accordion {
namespace cpu {

// Where the selection goes. Entries of g with key >= zeroed_from were zeroed in pass 1
// (kNoKey: none were): a kept one needs no write to g, one not kept gets its value back.
struct Outputs {
  float* values;
  int32_t* indices;
  float* g;  // the residual buffer, holding g until kept entries are zeroed
  uint64_t zeroed_from = kNoKey;
  double kept_sq = 0;
};

// One chunk's writing walk: output slots [pos, end), and how many of its entries equal to the
// threshold are still to be kept.
struct EntryWriter {
  const Outputs& out;
  uint32_t threshold;
  int64_t pos, end, ties_left;

  void operator()(uint32_t key, int64_t i, float v) {
    const bool tie = key == threshold;
    const bool keep = (key > threshold) | (tie & (ties_left > 0));
    ties_left -= tie;
    if (pos < end) {
      out.values[pos] = v;
      out.indices[pos] = static_cast<int32_t>(i);
    }
    pos += keep;
    if (keep != (key >= out.zeroed_from)) out.g[i] = keep ? 0.0f : v;
  }
  void operator()(uint64_t rec) { (*this)(record_key(rec), record_index(rec), record_value(rec)); }
};

inline void write_records_portable(const uint64_t* recs, int64_t count, EntryWriter& w) {
  for (int64_t j = 0; j < count; ++j) w(recs[j]);
}

#ifdef ACCORDION_HAVE_AVX512_PASS1
#define ACCORDION_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,popcnt")))

ACCORDION_AVX512 inline void write_records_avx512(const uint64_t* recs, int64_t count, EntryWriter& w) {
  // A record is key << 32 | sign << 31 | index: key > T is record >= (T + 1) << 32.
  const __m512i above = _mm512_set1_epi64(static_cast<int64_t>((uint64_t{w.threshold} + 1) << 32));
  const __m512i tie_key = _mm512_set1_epi64(w.threshold);
  const bool zeroing = w.out.zeroed_from != kNoKey;
  const __m512i zeroed_from = _mm512_set1_epi64(static_cast<int64_t>(zeroing ? w.out.zeroed_from << 32 : 0));
  const __m512i sign_mask = _mm512_set1_epi64(0x80000000), index_mask = _mm512_set1_epi64(0x7fffffff);
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    const __m512i rec = _mm512_loadu_si512(recs + j);
    const __mmask8 keep = _mm512_cmpge_epu64_mask(rec, above);
    const __mmask8 tie = _mm512_cmpeq_epi64_mask(_mm512_srli_epi64(rec, 32), tie_key);
    const __mmask8 zeroed = zeroing ? _mm512_cmpge_epu64_mask(rec, zeroed_from) : __mmask8(0);
    if (tie | (keep ^ zeroed)) {  // rare: entry by entry
      for (int l = 0; l < 8; ++l) w(recs[j + l]);
      continue;
    }
    if (keep == 0) continue;
    const __m256i bits = _mm512_cvtepi64_epi32(
        _mm512_or_si512(_mm512_srli_epi64(rec, 32), _mm512_and_si512(rec, sign_mask)));
    const __m256i index = _mm512_cvtepi64_epi32(_mm512_and_si512(rec, index_mask));
    const int kept = _mm_popcnt_u32(keep);
    // Eight lanes are stored where they fit in this chunk's slots; at its end only the kept
    // ones (the next chunk's slots belong to another thread).
    const __mmask8 lanes = w.pos + 8 <= w.end ? __mmask8(0xff) : static_cast<__mmask8>((1u << kept) - 1);
    _mm256_mask_storeu_epi32(w.out.values + w.pos, lanes, _mm256_maskz_compress_epi32(keep, bits));
    _mm256_mask_storeu_epi32(w.out.indices + w.pos, lanes, _mm256_maskz_compress_epi32(keep, index));
    w.pos += kept;
  }
  write_records_portable(recs + j, count - j, w);
}
#undef ACCORDION_AVX512
#endif

// The writing walk over candidate records, on the best version this CPU runs.
inline void write_records(const uint64_t* recs, int64_t count, EntryWriter& w) {
#ifdef ACCORDION_HAVE_AVX512_PASS1
  if (kCpuHasAvx512) return write_records_avx512(recs, count, w);
#endif
  write_records_portable(recs, count, w);
}

}  // namespace cpu
}  // namespace accordion
