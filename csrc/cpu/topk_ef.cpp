// CPU kernel of accordion::topk_ef: TopK sparsification with error feedback, fused.
//
//   g = grad + residual                    (written into the residual buffer)
//   keep the k entries of largest |g|      (ties: the lower index wins)
//   values, indices <- the kept entries;   residual <- g with the kept entries zeroed
//   g_sq, kept_sq  <- squared norms of g and of the kept part (the policies use them)
//
// Selection is an exact radix select on the bits of |g|, never a sort. For a non-negative
// float the IEEE bit pattern, read as an unsigned integer, orders exactly like the value,
// so the key of an entry is bits(g) & 0x7fffffff and everything is integer counting. The
// 31 key bits are resolved as digits of 12, 11 and 8 bits: a histogram per digit, the
// bucket holding the k-th largest key, then the next digit within that bucket.
//
// Fast path, one pass over the tensor. A sample of 16Ki entries of g gives a key L
// that, with overwhelming probability, a little more than k entries reach (about 1.05k plus
// four standard deviations of the sample). The single pass then does the error-feedback
// add, the squared norm, and lists the entries with key >= L as candidates (a vectorized
// compare; everything else is never looked at again). The radix select runs on the
// candidates only, O(k) work, and writes the selection in index order.
// Fallback: if the sample misled (fewer than k candidates, or more than 3k + 64Ki), or the
// tensor is small or k > n/4, the same select runs over all of g in a few more passes.
// Either way the result is exact, the same on every thread count, and no O(n) temporary is
// allocated (candidates are O(k)). Outputs are in ascending index order.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

#ifdef __SSE2__
#include <emmintrin.h>
#endif

#include "cpu/ef_add_block.h"
#include "ops.h"

namespace accordion {
namespace {

constexpr int kTopBits = 12, kMidBits = 11, kLowBits = 8;
constexpr int kTopShift = kMidBits + kLowBits;
constexpr int64_t kBlock = 2048;          // pass block: stays in L1 between its loops
constexpr int64_t kMinChunk = 1 << 16;    // smallest piece of work one thread takes
// At most this many chunks, whatever the thread count, so that every result (including the
// float rounding of g_sq) is the same on any number of threads.
constexpr int64_t kMaxChunks = 64;
constexpr int64_t kSampleRuns = 512, kSampleRun = 32;  // 16Ki sampled entries
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

// Sum of squares of a block (at most kBlock entries): eight float lanes, which the compiler
// vectorizes, added up in double at the end of the block. Relative error stays below
// kBlock / 8 float roundings (~2e-5), plenty for the policies' gain ratio.
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

// A key below which, judging from a sample of g = grad + residual (computed as the
// error-feedback add computes it), fewer than k entries should fall short: the sample's
// r-th largest key, r about 1.05 k/n of the sample plus four standard deviations. The
// sample is kSampleRuns short runs spread evenly over the tensor, so it costs a few
// hundred cache lines rather than one miss per sampled entry.
template <typename G>
uint32_t sampled_min_key(const G* grad, const float* residual, int64_t n, int64_t k) {
  const int64_t runs = std::min(kSampleRuns, n / kSampleRun);
  std::vector<uint32_t> keys;
  keys.reserve(runs * kSampleRun);
  for (int64_t j = 0; j < runs; ++j) {
    const int64_t start = j * (n - kSampleRun) / std::max<int64_t>(runs - 1, 1);
    for (int64_t i = start; i < start + kSampleRun; ++i) {
      keys.push_back(key_of(static_cast<float>(grad[i]) + residual[i]));
    }
  }
  const int64_t s = static_cast<int64_t>(keys.size());
  const double expected = static_cast<double>(s) * k / n;
  const int64_t r = std::min<int64_t>(s, static_cast<int64_t>(std::ceil(1.05 * expected + 4 * std::sqrt(expected) + 4)));
  // The r-th largest sample key: its top digit by a histogram, then within that bucket.
  std::vector<int64_t> hist(1u << kTopBits, 0);
  for (uint32_t key : keys) ++hist[key >> kTopShift];
  int64_t need = r;
  uint32_t top = hist.size();
  while (top-- > 0 && hist[top] < need) need -= hist[top];
  std::vector<uint32_t> bucket;
  for (uint32_t key : keys) {
    if ((key >> kTopShift) == top) bucket.push_back(key);
  }
  std::nth_element(bucket.begin(), bucket.begin() + (need - 1), bucket.end(), std::greater<uint32_t>());
  return bucket[need - 1];
}

// Pass 1 over one chunk: residual <- grad + residual, its squared norm, and (when `cands`
// is given) the (key, index) of every entry with key >= min_key, packed as key << 32 | index
// so they sort and compare by key, and their top-digit histogram (the select's first step).
// Stops listing past `max_cands` (the caller then falls back; `listed` counts over all
// chunks), but always finishes the add and the norm.
template <typename G>
double ef_add_norm_candidates(const G* grad, float* g, int64_t begin, int64_t end, uint32_t min_key,
                              std::vector<uint64_t>* cands, int64_t* top_hist, std::atomic<int64_t>& listed,
                              int64_t max_cands) {
  int32_t hit[kBlock + 3];
  double sq = 0;
  for (int64_t b0 = begin; b0 < end; b0 += kBlock) {
    const int64_t b1 = std::min(end, b0 + kBlock);
    cpu::ef_add_range(grad, g, g, b0, b1);
    sq += block_sum_squares(g + b0, b1 - b0);
    if (cands == nullptr || listed.load(std::memory_order_relaxed) > max_cands) continue;
    const int64_t nh = list_hits(g, b0, b1, min_key, hit);
    listed.fetch_add(nh, std::memory_order_relaxed);
    for (int64_t j = 0; j < nh; ++j) {
      const uint32_t key = key_of(g[hit[j]]);
      ++top_hist[key >> kTopShift];
      cands->push_back(static_cast<uint64_t>(key) << 32 | static_cast<uint32_t>(hit[j]));
    }
  }
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

// The exact selection of the k largest keys over a set of entries given per chunk, in index
// order: `for_each(c, fn)` calls fn(key, index) for chunk c's entries. Three digit
// histograms find the threshold key T and how many entries equal to T are kept (the first
// ones in index order); the last one also counts per chunk, which gives each chunk its
// output offset; a last walk writes the selection. Each step is parallel over chunks.
// `top_hist`, when given, is the first digit's histogram, already counted.
template <typename ForEach>
void select_exact(int64_t chunks, const ForEach& for_each, int64_t k, Outputs& out,
                  const std::vector<int64_t>* top_hist = nullptr) {
  // Histogram of (key >> shift) & (bins - 1) over keys with key >> (shift + bits) == prefix.
  auto histogram = [&](int shift, int bits, uint32_t prefix) {
    const uint32_t bins = 1u << bits;
    std::vector<int64_t> hist(bins, 0);
    std::mutex merge;
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      std::vector<int64_t> local(bins, 0);  // one per task; integer counts merge in any order
      for (int64_t c = c0; c < c1; ++c) {
        for_each(c, [&](uint32_t key, int64_t) {
          if ((static_cast<uint64_t>(key) >> (shift + bits)) == prefix) ++local[(key >> shift) & (bins - 1)];
        });
      }
      std::lock_guard<std::mutex> lock(merge);
      for (uint32_t d = 0; d < bins; ++d) hist[d] += local[d];
    });
    return hist;
  };
  // Within one histogram: the bucket holding the need-th largest key, and how many keys
  // still have to come from it.
  auto cut = [](const std::vector<int64_t>& hist, int64_t& need) -> uint32_t {
    for (uint32_t d = hist.size(); d-- > 0;) {
      if (hist[d] >= need) return d;
      need -= hist[d];
    }
    TORCH_INTERNAL_ASSERT(false, "accordion::topk_ef: fewer keys than requested");
    return 0u;
  };
  int64_t need = k;
  uint32_t prefix = cut(top_hist ? *top_hist : histogram(kTopShift, kTopBits, 0), need);
  prefix = prefix << kMidBits | cut(histogram(kLowBits, kMidBits, prefix), need);
  // The last digit is counted per chunk, together with the keys above the prefix, so the
  // per-chunk counts of keys above and equal to the threshold follow without another walk.
  constexpr uint32_t kLowBins = 1u << kLowBits;
  std::vector<int64_t> low(chunks * kLowBins, 0), above(chunks, 0), equal(chunks, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* h = low.data() + c * kLowBins;
      int64_t over = 0;
      for_each(c, [&](uint32_t key, int64_t) {
        const uint32_t high = key >> kLowBits;
        over += high > prefix;
        if (high == prefix) ++h[key & (kLowBins - 1)];
      });
      above[c] = over;
    }
  });
  std::vector<int64_t> low_total(kLowBins, 0);
  for (int64_t c = 0; c < chunks; ++c) {
    for (uint32_t d = 0; d < kLowBins; ++d) low_total[d] += low[c * kLowBins + d];
  }
  const uint32_t low_digit = cut(low_total, need);
  const uint32_t threshold = prefix << kLowBits | low_digit;
  const int64_t ties = need;  // of the keys equal to the threshold, the first `ties` are kept
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t* h = low.data() + c * kLowBins;
    for (uint32_t d = low_digit + 1; d < kLowBins; ++d) above[c] += h[d];
    equal[c] = h[low_digit];
  }
  std::vector<int64_t> chunk_ties(chunks), offset(chunks);
  int64_t ties_left = ties, pos = 0;
  for (int64_t c = 0; c < chunks; ++c) {  // ties go to the lowest indices: the first chunks
    chunk_ties[c] = std::min(ties_left, equal[c]);
    ties_left -= chunk_ties[c];
    offset[c] = pos;
    pos += above[c] + chunk_ties[c];
  }
  TORCH_INTERNAL_ASSERT(pos == k, "accordion::topk_ef: selected ", pos, " entries instead of ", k);
  std::vector<double> kept(chunks, 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      Outputs part{out.values, out.indices, out.g, offset[c]};
      int64_t taken = 0;
      for_each(c, [&](uint32_t key, int64_t i) {
        if (key > threshold || (key == threshold && taken++ < chunk_ties[c])) part.keep(i);
      });
      kept[c] = part.kept_sq;
    }
  });
  for (double s : kept) out.kept_sq += s;
  out.pos = k;
}

template <typename G>
void topk_ef_impl(const G* grad, float* g, int64_t n, int64_t k, float* values, int32_t* indices,
                  double& g_sq, double& kept_sq) {
  const Chunks chunks{n, std::clamp<int64_t>((n + kMinChunk - 1) / kMinChunk, 1, kMaxChunks)};
  const bool sample = k > 0 && k <= n / 4 && n >= kMinChunk;
  const uint32_t min_key = sample ? sampled_min_key(grad, g, n, k) : 0;
  const int64_t max_cands = 3 * k + kCandidateSlack;
  std::atomic<int64_t> listed{0};

  // The one pass over the tensor.
  std::vector<std::vector<uint64_t>> cands(chunks.count);
  std::vector<double> sq(chunks.count, 0.0);
  std::vector<int64_t> top_hist(1u << kTopBits, 0);
  std::mutex merge;
  at::parallel_for(0, chunks.count, 1, [&](int64_t c0, int64_t c1) {
    std::vector<int64_t> local(sample ? top_hist.size() : 0, 0);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b = chunks.begin(c), e = chunks.end(c);
      if (sample) cands[c].reserve(static_cast<size_t>(1.5 * k * (e - b) / n) + 64);
      sq[c] = ef_add_norm_candidates(grad, g, b, e, min_key, sample ? &cands[c] : nullptr, local.data(), listed,
                                     max_cands);
    }
    std::lock_guard<std::mutex> lock(merge);
    for (size_t d = 0; d < local.size(); ++d) top_hist[d] += local[d];
  });
  g_sq = 0;
  for (double s : sq) g_sq += s;
  Outputs out{values, indices, g};
  if (k == n) {  // everything is kept: no selection to make
    for (int64_t i = 0; i < n; ++i) out.keep(i);
  } else if (k > 0) {
    const int64_t total = listed.load();
    if (sample && total >= k && total <= max_cands) {
      select_exact(chunks.count, [&](int64_t c, auto&& fn) {
        for (uint64_t e : cands[c]) fn(static_cast<uint32_t>(e >> 32), static_cast<int64_t>(e & 0xffffffffu));
      }, k, out, &top_hist);
    } else {  // all of g: more passes, no candidate storage
      select_exact(chunks.count, [&](int64_t c, auto&& fn) {
        for (int64_t i = chunks.begin(c), end = chunks.end(c); i < end; ++i) fn(key_of(g[i]), i);
      }, k, out);
    }
  }
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
