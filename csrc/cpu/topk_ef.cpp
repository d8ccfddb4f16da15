// CPU kernel of accordion::topk_ef: TopK sparsification with error feedback, fused.
//
//   g = grad + residual                    (written into the residual buffer)
//   keep the k entries of largest |g|      (ties: the lower index wins)
//   values, indices <- the kept entries;   residual <- g with the kept entries zeroed
//   g_sq, kept_sq  <- squared norms of g and of the kept part (the policies use them)
//
// Selection is a radix select on the bits of |g|, never a sort. For a non-negative float
// the IEEE bit pattern, read as an unsigned integer, orders exactly like the value, so the
// key of an entry is bits(g) & 0x7fffffff and everything is integer counting. The 31 key
// bits are split into digits of 12, 11 and 8 bits.
//
// Pass 1 (streams grad and residual once): the error-feedback add, the squared norm, and a
//   histogram of the top digit, per chunk of the tensor. From the histogram: the bucket b
//   holding the k-th largest key; everything in higher buckets is kept for sure.
// Pass 2 (reads g once): entries above b are written to the outputs (each chunk at an
//   offset known from the per-chunk histograms) and zeroed in the residual; entries in b
//   are the candidates, copied aside as (key, index) pairs in index order.
// Then the remaining digits are resolved on the candidates only: a typical bucket holds
//   about k/2 entries, so this is cheap, and the tie rule (lower index first) is applied
//   by walking them in index order.
// If b holds too many entries to copy aside (e.g. a tensor of equal values: more than
//   2k + 64Ki), the digits are resolved by further passes over g instead, and one last
//   pass writes the selection in index order. No O(n) temporary is allocated either way.
//
// Entry order in the outputs: the entries above b, ascending by index, then the ones
// taken from b, ascending (on the slow path simply ascending). It is deterministic and
// does not depend on the number of threads; callers treat the outputs as a set.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#ifdef __SSE2__
#include <emmintrin.h>
#endif

#include "cpu/ef_add_block.h"
#include "ops.h"

namespace accordion {
namespace {

// Digit widths: the top digit as wide as two histograms in L1 allow (2 x 16 KiB), so the
// bucket of candidates left after pass 1 is small.
constexpr int kMidBits = 11, kLowBits = 8;
constexpr int kMidShift = kLowBits;               // digit 2: key bits 18..8
constexpr int kTopShift = kMidBits + kLowBits;    // digit 1: key bits 30..19
constexpr uint32_t kTopBins = 1u << (31 - kTopShift);
constexpr uint32_t kMidBins = 1u << kMidBits;
constexpr uint32_t kLowBins = 1u << kLowBits;     // digit 3: key bits 7..0
constexpr int64_t kBlock = 2048;              // pass-1 block: stays in L1 between its loops
constexpr int64_t kMinChunk = 1 << 16;        // smallest piece of work one thread takes
// At most this many chunks, whatever the thread count, so that every result (including the
// float rounding of g_sq) is the same on any number of threads.
constexpr int64_t kMaxChunks = 64;
constexpr int64_t kCandidateSlack = 1 << 16;

inline uint32_t key_of(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits & 0x7fffffffu;
}

// The tensor is cut into `count` contiguous chunks, independent of the thread count;
// per-chunk counts give every chunk its output offset.
struct Chunks {
  int64_t n, count;
  int64_t begin(int64_t c) const { return c * n / count; }
  int64_t end(int64_t c) const { return (c + 1) * n / count; }
};

// In a histogram over one digit, the bucket holding the `need`-th largest key (1-based) and
// how many keys must still be taken from it; buckets above it are taken whole.
struct Cut {
  uint32_t digit;
  int64_t need;
};
template <typename Count>
Cut find_cut(const Count* hist, uint32_t bins, int64_t need) {
  for (uint32_t d = bins; d-- > 0;) {
    if (static_cast<int64_t>(hist[d]) >= need) return {d, need};
    need -= static_cast<int64_t>(hist[d]);
  }
  TORCH_INTERNAL_ASSERT(false, "accordion::topk_ef: histogram holds fewer keys than requested");
}

// Sum of squares of a pass-1 block (at most kBlock entries): eight float lanes, which the
// compiler vectorizes, added up in double at the end of the block. Relative error stays
// below kBlock / 8 float roundings (~2e-5), plenty for the policies' gain ratio.
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

// Pass 1 over one chunk: residual <- grad + residual, its squared norm, top-digit histogram.
template <typename G>
double ef_add_norm_histogram(const G* grad, float* g, int64_t begin, int64_t end, uint32_t* hist) {
  // Two interleaved histograms: runs of keys in one bucket (common: magnitudes cluster)
  // would otherwise serialize on the same counter.
  std::array<uint32_t, 2 * kTopBins> local{};
  double sq = 0;
  for (int64_t b0 = begin; b0 < end; b0 += kBlock) {
    const int64_t b1 = std::min(end, b0 + kBlock);
    cpu::ef_add_range(grad, g, g, b0, b1);
    sq += block_sum_squares(g + b0, b1 - b0);
    int64_t i = b0;
    for (; i + 2 <= b1; i += 2) {
      ++local[key_of(g[i]) >> kTopShift];
      ++local[kTopBins + (key_of(g[i + 1]) >> kTopShift)];
    }
    if (i < b1) ++local[key_of(g[i]) >> kTopShift];
  }
  for (uint32_t d = 0; d < kTopBins; ++d) hist[d] = local[d] + local[kTopBins + d];
  return sq;
}

struct Outputs {
  float* values;
  int32_t* indices;
  float* g;  // the residual buffer, holding g until kept entries are zeroed
  int64_t pos = 0;
  double kept_sq = 0;
  void keep(int64_t i) {
    const float v = g[i];
    values[pos] = v;
    indices[pos] = static_cast<int32_t>(i);
    ++pos;
    kept_sq += static_cast<double>(v) * v;
    g[i] = 0.0f;
  }
};

// For each 4-bit mask, the lanes that are set, packed to the front (a branch-free
// compaction table: the write position then simply advances by the mask's popcount).
struct LaneTable {
  int32_t lanes[16][4];
  constexpr LaneTable() : lanes{} {
    for (int m = 0; m < 16; ++m) {
      int n = 0;
      for (int b = 0; b < 4; ++b) {
        if (m & (1 << b)) lanes[m][n++] = b;
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
    nh += __builtin_popcount(mask);
  }
#endif
  for (; i < end; ++i) {
    hit[nh] = static_cast<int32_t>(i);
    nh += key_of(g[i]) >= min_key;
  }
  return nh;
}

// Pass 2 over one chunk: entries whose top digit is above `top` are kept (written to
// values/indices and zeroed in g), entries in `top` are copied to the candidate arrays.
// Per block, a vectorized filter first lists the positions at or above `top`, then only
// those few are sorted into kept and candidates, branch-free (every entry is written, the
// write position advances only where it belongs) into block-local buffers that are copied
// out. Returns the squared norm of what was kept.
double split_chunk(float* g, int64_t begin, int64_t end, uint32_t top, float* values, int32_t* indices,
                   uint32_t* cand_keys, int32_t* cand_idx) {
  constexpr int64_t kSplitBlock = 1024;
  int32_t hit[kSplitBlock + 3], ki[kSplitBlock], ci[kSplitBlock];
  float kv[kSplitBlock];
  uint32_t ck[kSplitBlock];
  double kept_sq = 0;
  for (int64_t b0 = begin; b0 < end; b0 += kSplitBlock) {
    const int64_t b1 = std::min(end, b0 + kSplitBlock);
    const int64_t nh = list_hits(g, b0, b1, top << kTopShift, hit);
    int64_t nk = 0, nc = 0;
    for (int64_t j = 0; j < nh; ++j) {
      const int32_t i = hit[j];
      const float v = g[i];
      const uint32_t key = key_of(v);
      const bool above = (key >> kTopShift) > top;
      kv[nk] = v;
      ki[nk] = i;
      nk += above;
      ck[nc] = key;
      ci[nc] = i;
      nc += !above;
    }
    for (int64_t j = 0; j < nk; ++j) {
      g[ki[j]] = 0.0f;
      kept_sq += static_cast<double>(kv[j]) * kv[j];
    }
    std::memcpy(values, kv, nk * sizeof(float));
    std::memcpy(indices, ki, nk * sizeof(int32_t));
    std::memcpy(cand_keys, ck, nc * sizeof(uint32_t));
    std::memcpy(cand_idx, ci, nc * sizeof(int32_t));
    values += nk;
    indices += nk;
    cand_keys += nc;
    cand_idx += nc;
  }
  return kept_sq;
}

// Selection by the exact threshold key T: keys above T are kept, and of the keys equal to
// T the first `ties` in index order.
struct Threshold {
  uint32_t key;
  int64_t ties;
};

// Resolves the lower two digits on the candidates (all in top bucket `top`, `need` of them
// to take) and keeps the chosen ones, walking them in index order.
void select_candidates(const std::vector<uint32_t>& keys, const std::vector<int32_t>& idx, uint32_t top,
                       int64_t need, Outputs& out) {
  std::vector<int64_t> hist(kMidBins, 0);
  for (uint32_t k : keys) ++hist[(k >> kMidShift) & (kMidBins - 1)];
  const Cut mid = find_cut(hist.data(), kMidBins, need);
  std::fill(hist.begin(), hist.end(), 0);
  const uint32_t prefix = (top << kMidBits) | mid.digit;  // key >> kMidShift of the mid bucket
  for (uint32_t k : keys) {
    if ((k >> kMidShift) == prefix) ++hist[k & (kLowBins - 1)];
  }
  const Cut low = find_cut(hist.data(), kLowBins, mid.need);
  const Threshold t{(prefix << kMidShift) | low.digit, low.need};
  int64_t ties = 0;
  for (size_t j = 0; j < keys.size(); ++j) {
    if (keys[j] > t.key || (keys[j] == t.key && ties++ < t.ties)) out.keep(idx[j]);
  }
}

// The slow path's digit passes: a histogram of (key >> shift) & (bins-1) over the entries
// whose key >> (shift + width) equals `prefix`.
std::vector<int64_t> masked_histogram(const float* g, const Chunks& chunks, int shift, uint32_t bins,
                                      uint32_t prefix, int width) {
  std::vector<int64_t> per_chunk(chunks.count * bins, 0);
  at::parallel_for(0, chunks.count, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* h = per_chunk.data() + c * bins;
      for (int64_t i = chunks.begin(c), end = chunks.end(c); i < end; ++i) {
        const uint32_t k = key_of(g[i]);
        if ((k >> (shift + width)) == prefix) ++h[(k >> shift) & (bins - 1)];
      }
    }
  });
  std::vector<int64_t> hist(bins, 0);
  for (int64_t c = 0; c < chunks.count; ++c) {
    for (uint32_t d = 0; d < bins; ++d) hist[d] += per_chunk[c * bins + d];
  }
  return hist;
}

// Slow path: the top bucket is too large to copy aside. Two more digit passes find the
// exact threshold; then each chunk counts what it keeps, and one pass writes the selection
// in index order.
void select_by_scanning(float* g, const Chunks& chunks, uint32_t top, int64_t need, Outputs& out) {
  const auto mid_hist = masked_histogram(g, chunks, kMidShift, kMidBins, top, kMidBits);
  const Cut mid = find_cut(mid_hist.data(), kMidBins, need);
  const uint32_t prefix = (top << kMidBits) | mid.digit;
  const auto low_hist = masked_histogram(g, chunks, 0, kLowBins, prefix, kMidShift);
  const Cut low = find_cut(low_hist.data(), kLowBins, mid.need);
  const uint32_t threshold = (prefix << kMidShift) | low.digit;

  std::vector<int64_t> above(chunks.count, 0), equal(chunks.count, 0);
  at::parallel_for(0, chunks.count, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t a = 0, e = 0;
      for (int64_t i = chunks.begin(c), end = chunks.end(c); i < end; ++i) {
        const uint32_t k = key_of(g[i]);
        a += k > threshold;
        e += k == threshold;
      }
      above[c] = a;
      equal[c] = e;
    }
  });
  // Ties go to the lowest indices: to the first chunks, in order.
  std::vector<int64_t> ties(chunks.count), offset(chunks.count);
  int64_t ties_left = low.need, pos = out.pos;
  for (int64_t c = 0; c < chunks.count; ++c) {
    ties[c] = std::min(ties_left, equal[c]);
    ties_left -= ties[c];
    offset[c] = pos;
    pos += above[c] + ties[c];
  }
  std::vector<double> kept(chunks.count, 0.0);
  at::parallel_for(0, chunks.count, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      Outputs part{out.values, out.indices, g, offset[c]};
      int64_t taken = 0;
      for (int64_t i = chunks.begin(c), end = chunks.end(c); i < end; ++i) {
        const uint32_t k = key_of(g[i]);
        if (k > threshold || (k == threshold && taken++ < ties[c])) part.keep(i);
      }
      kept[c] = part.kept_sq;
    }
  });
  for (double k : kept) out.kept_sq += k;
  out.pos = pos;
}

template <typename G>
void topk_ef_impl(const G* grad, float* g, int64_t n, int64_t k, float* values, int32_t* indices,
                  double& g_sq, double& kept_sq) {
  const Chunks chunks{n, std::clamp<int64_t>((n + kMinChunk - 1) / kMinChunk, 1, kMaxChunks)};

  // Pass 1.
  std::vector<uint32_t> hist(chunks.count * kTopBins);
  std::vector<double> sq(chunks.count, 0.0);
  at::parallel_for(0, chunks.count, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      sq[c] = ef_add_norm_histogram(grad, g, chunks.begin(c), chunks.end(c), hist.data() + c * kTopBins);
    }
  });
  g_sq = 0;
  for (double s : sq) g_sq += s;
  Outputs out{values, indices, g};
  if (k == 0) return;
  if (k == n) {  // everything is kept: no selection to make
    for (int64_t i = 0; i < n; ++i) out.keep(i);
    kept_sq = out.kept_sq;
    return;
  }
  std::vector<int64_t> total(kTopBins, 0);
  for (int64_t c = 0; c < chunks.count; ++c) {
    for (uint32_t d = 0; d < kTopBins; ++d) total[d] += hist[c * kTopBins + d];
  }
  const Cut top = find_cut(total.data(), kTopBins, k);
  const int64_t in_bucket = total[top.digit];

  if (in_bucket > 2 * k + kCandidateSlack) {  // too many to copy aside: the slow path
    select_by_scanning(g, chunks, top.digit, top.need, out);
  } else {
    // Pass 2: per chunk, entries above the bucket go straight to the outputs; the bucket's
    // entries are copied aside, in index order.
    std::vector<int64_t> out_offset(chunks.count), cand_offset(chunks.count);
    int64_t above_total = 0, cand_total = 0;
    for (int64_t c = 0; c < chunks.count; ++c) {
      out_offset[c] = above_total;
      cand_offset[c] = cand_total;
      const uint32_t* h = hist.data() + c * kTopBins;
      for (uint32_t d = top.digit + 1; d < kTopBins; ++d) above_total += h[d];
      cand_total += h[top.digit];
    }
    std::vector<uint32_t> cand_keys(in_bucket);
    std::vector<int32_t> cand_idx(in_bucket);
    std::vector<double> kept(chunks.count, 0.0);
    at::parallel_for(0, chunks.count, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        kept[c] = split_chunk(g, chunks.begin(c), chunks.end(c), top.digit, values + out_offset[c],
                              indices + out_offset[c], cand_keys.data() + cand_offset[c],
                              cand_idx.data() + cand_offset[c]);
      }
    });
    for (double s : kept) out.kept_sq += s;
    out.pos = above_total;
    select_candidates(cand_keys, cand_idx, top.digit, top.need, out);
  }
  TORCH_INTERNAL_ASSERT(out.pos == k, "accordion::topk_ef: selected ", out.pos, " entries instead of ", k);
  kept_sq = out.kept_sq;
}

}  // namespace

void topk_ef_cpu(const at::Tensor& grad, const at::Tensor& residual, int64_t k, at::Tensor& values,
                 at::Tensor& indices, double& g_sq, double& kept_sq) {
  const int64_t n = residual.numel();
  g_sq = kept_sq = 0;
  if (n == 0) return;
  float* g = residual.mutable_data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "topk_ef_cpu", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_INTERNAL_ASSERT(false, "accordion::topk_ef: float64 grads are rejected by the argument checks");
    } else {
      topk_ef_impl(grad.const_data_ptr<scalar_t>(), g, n, k, values.mutable_data_ptr<float>(),
                   indices.mutable_data_ptr<int32_t>(), g_sq, kept_sq);
    }
  });
}

}  // namespace accordion
