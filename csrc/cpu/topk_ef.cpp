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
// Fast path, one pass over the tensor. A sample of 16Ki entries of g gives two keys: L,
// which with overwhelming probability a little more than k entries reach (about 1.05k plus
// four standard deviations of the sample), and U, which a little fewer than k reach (one
// standard deviation below k). The single pass (topk_pass1.h; AVX-512 where the CPU has it)
// does the error-feedback add, the squared norm, lists the entries with key >= L as
// candidates (a vectorized compare; everything else is never looked at again), and zeroes
// in g the entries with key >= U, which are almost all kept, while the block is still in
// registers. The candidate records carry key, sign and index, so
// the radix select on them (O(k) work) writes values and indices without reading g, and
// only the kept entries below U are zeroed afterwards: at a 10% ratio, a separate zeroing
// walk would touch every cache line of g a second time. Should U turn out to be above the
// threshold, the entries zeroed but not kept are written back from their records.
// Fallback: if the sample misled (fewer than k candidates, or more than 3k + 64Ki), or the
// tensor is small or k > n/4, g is restored from the records and the same select runs over
// all of g in a few more passes.
// Either way the result is exact, the same on every thread count, and no O(n) temporary is
// allocated (candidates are O(k)). Outputs are in ascending index order.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

#include "cpu/topk_pass1.h"
#include "ops.h"

namespace accordion {
namespace {

using cpu::kNoKey;
using cpu::key_of;
using cpu::record_index;
using cpu::record_key;
using cpu::record_value;

constexpr int kTopBits = 12, kMidBits = 11, kLowBits = 8;
constexpr int kTopShift = kMidBits + kLowBits;
constexpr int64_t kBlock = cpu::kPassBlock;
constexpr int64_t kMinChunk = 1 << 16;    // smallest piece of work one thread takes
// At most this many chunks, whatever the thread count, so that every result (including the
// float rounding of g_sq) is the same on any number of threads.
constexpr int64_t kMaxChunks = 64;
constexpr int64_t kSampleRuns = 128, kSampleRun = 128;  // 16Ki sampled entries
constexpr int64_t kCandidateSlack = 1 << 16;
constexpr int64_t kNarrowFrom = 1 << 18;  // candidates: below this the select walks them all

// The tensor is cut into `count` contiguous chunks, independent of the thread count;
// per-chunk counts give every chunk its output offset.
struct Chunks {
  int64_t n, count;
  int64_t begin(int64_t c) const { return c * n / count; }
  int64_t end(int64_t c) const { return (c + 1) * n / count; }
};

// The r_low-th and r_high-th largest of `keys` (1 <= r <= size): their top digits from one
// histogram, then nth_element within those buckets only.
std::pair<uint32_t, uint32_t> two_largest(const std::vector<uint32_t>& keys, int64_t r_low, int64_t r_high) {
  uint32_t hist[1u << kTopBits] = {};
  for (uint32_t key : keys) ++hist[key >> kTopShift];
  auto bucket_of = [&](int64_t& r) {
    uint32_t top = 1u << kTopBits;
    while (top-- > 0 && hist[top] < r) r -= hist[top];
    return top;
  };
  const uint32_t top_low = bucket_of(r_low), top_high = bucket_of(r_high);
  std::vector<uint32_t> low, high;
  for (uint32_t key : keys) {
    if ((key >> kTopShift) == top_low) low.push_back(key);
    if ((key >> kTopShift) == top_high) high.push_back(key);
  }
  std::nth_element(low.begin(), low.begin() + (r_low - 1), low.end(), std::greater<uint32_t>());
  std::nth_element(high.begin(), high.begin() + (r_high - 1), high.end(), std::greater<uint32_t>());
  return {low[r_low - 1], high[r_high - 1]};
}

// Keys that, judging from a sample of g = grad + residual (computed as the error-feedback add
// computes it), bracket the k-th largest: `lower`, which more than k entries reach with
// overwhelming probability (the sample's r-th largest key, r about 1.05 k/n of the sample
// plus four standard deviations), and `upper`, which somewhat fewer than k should reach (one
// standard deviation below k/n of the sample; none, kNoKey, when that rank is below 1). An
// `upper` a little too low costs only a few write-backs (see topk_ef_impl); one too high
// leaves more kept entries to zero one by one, so it sits close to the expected cut. The
// sample is kSampleRuns runs spread evenly over the tensor: short sequential streams,
// prefetched up front, rather than a miss per sampled entry.
struct KeyBounds {
  uint64_t lower;  // kNoKey: list nothing
  uint64_t upper;
};

template <typename G>
KeyBounds sampled_bounds(const G* grad, const float* residual, int64_t n, int64_t k) {
  const int64_t runs = std::min(kSampleRuns, n / kSampleRun);
  auto run_start = [&](int64_t j) { return j * (n - kSampleRun) / std::max<int64_t>(runs - 1, 1); };
  // Runs split between threads (each run has its fixed place in `keys`); within a thread,
  // every sampled cache line is asked for first, so the misses overlap instead of queueing.
  std::vector<uint32_t> keys(runs * kSampleRun);
  at::parallel_for(0, runs, 16, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      for (int64_t i = run_start(j); i < run_start(j) + kSampleRun; i += 64 / sizeof(float)) {
        __builtin_prefetch(grad + i);
        __builtin_prefetch(residual + i);
      }
    }
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t start = run_start(j);
      for (int64_t i = 0; i < kSampleRun; ++i) {
        keys[j * kSampleRun + i] = key_of(static_cast<float>(grad[start + i]) + residual[start + i]);
      }
    }
  });
  const int64_t s = static_cast<int64_t>(keys.size());
  const double expected = static_cast<double>(s) * k / n, spread = 4 * std::sqrt(expected) + 4;
  const int64_t r_low = std::min<int64_t>(s, static_cast<int64_t>(std::ceil(1.05 * expected + spread)));
  const int64_t r_high = static_cast<int64_t>(std::floor(expected - std::sqrt(expected)));
  // upper >= lower always (r_high < r_low), so every entry zeroed in pass 1 is a candidate.
  const auto [lower, upper] = two_largest(keys, r_low, std::max<int64_t>(r_high, 1));
  return {lower, r_high >= 1 ? upper : kNoKey};
}

// A chunk's candidate records, in index order. Grown by hand: std::vector would zero-fill
// memory that is about to be written anyway.
struct Records {
  std::unique_ptr<uint64_t[]> data;
  int64_t size = 0, capacity = 0;
  void make_room(int64_t extra) {
    if (size + extra <= capacity) return;
    const int64_t grown = std::max(size + extra, 2 * capacity);
    std::unique_ptr<uint64_t[]> bigger(new uint64_t[grown]);
    std::copy(data.get(), data.get() + size, bigger.get());
    data = std::move(bigger);
    capacity = grown;
  }
  const uint64_t* begin() const { return data.get(); }
  const uint64_t* end() const { return data.get() + size; }
};

// Pass 1 over one chunk, block by block (topk_pass1.h): residual <- grad + residual, its
// squared norm, and (when `records` is given) the record of every entry with key >=
// bounds.lower, with their top-digit histogram (the select's first step); entries with
// key >= bounds.upper are zeroed in g. Stops listing (and zeroing) past `max_cands` (the
// caller then falls back; `listed` counts over all chunks), but always finishes the add and
// the norm.
template <typename G>
double ef_add_norm_candidates(const G* grad, float* g, int64_t begin, int64_t end, KeyBounds bounds,
                              Records* records, int64_t* top_hist, std::atomic<int64_t>& listed,
                              int64_t max_cands) {
  double sq = 0;
  for (int64_t b0 = begin; b0 < end; b0 += kBlock) {
    const int64_t b1 = std::min(end, b0 + kBlock);
    if (records == nullptr || listed.load(std::memory_order_relaxed) > max_cands) {
      cpu::pass1_block(grad, g, b0, b1, kNoKey, kNoKey, nullptr, sq);
      continue;
    }
    records->make_room(b1 - b0 + 8);
    uint64_t* fresh = records->data.get() + records->size;
    const int64_t nh = cpu::pass1_block(grad, g, b0, b1, bounds.lower, bounds.upper, fresh, sq);
    for (int64_t j = 0; j < nh; ++j) ++top_hist[record_key(fresh[j]) >> kTopShift];
    records->size += nh;
    listed.fetch_add(nh, std::memory_order_relaxed);
  }
  return sq;
}

// Where the selection goes. Entries of g with key >= zeroed_from were zeroed in pass 1
// (kNoKey: none were): a kept one needs no write to g, one not kept gets its value back.
struct Outputs {
  float* values;
  int32_t* indices;
  float* g;  // the residual buffer, holding g until kept entries are zeroed
  uint64_t zeroed_from = kNoKey;
  double kept_sq = 0;
};

// Sum of squares in double, four independent accumulators (one chain would be latency-bound).
inline double sum_squares(const float* x, int64_t n) {
  double s[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int j = 0; j < 4; ++j) s[j] += static_cast<double>(x[i + j]) * x[i + j];
  }
  for (; i < n; ++i) s[0] += static_cast<double>(x[i]) * x[i];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// Within one histogram: the bucket holding the need-th largest key, and how many keys still
// have to come from it.
inline uint32_t cut(const std::vector<int64_t>& hist, int64_t& need) {
  for (uint32_t d = hist.size(); d-- > 0;) {
    if (hist[d] >= need) return d;
    need -= hist[d];
  }
  TORCH_INTERNAL_ASSERT(false, "accordion::topk_ef: fewer keys than requested");
  return 0u;
}

// The exact selection of the k largest keys over a set of entries given per chunk, in index
// order: `for_each(c, fn)` calls fn(key, index, value) for chunk c's entries. Three digit
// histograms find the threshold key T and how many entries equal to T are kept (the first
// ones in index order); the last one also counts per chunk, which gives each chunk its
// output offset; a last walk writes the selection. Each step is parallel over chunks.
// `top_hist`, when given, is the first digit's histogram, already counted. With `narrow`,
// one walk copies the entries of the threshold's top-digit bucket aside (per chunk, O(k)
// memory: only for candidate lists) and the next two digits are counted on those alone.
template <typename ForEach>
void select_exact(int64_t chunks, const ForEach& for_each, int64_t k, Outputs& out,
                  const std::vector<int64_t>* top_hist = nullptr, bool narrow = false) {
  // Histogram of (key >> shift) & (bins - 1) over keys with key >> (shift + bits) == prefix.
  auto histogram = [&](const auto& entries, int shift, int bits, uint32_t prefix) {
    const uint32_t bins = 1u << bits;
    std::vector<int64_t> hist(bins, 0);
    std::mutex merge;
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      std::vector<int64_t> local(bins, 0);  // one per task; integer counts merge in any order
      for (int64_t c = c0; c < c1; ++c) {
        entries(c, [&](uint32_t key, int64_t, float) {
          // Branch-free: about one key in six matches, at random, which a branch mispredicts.
          local[(key >> shift) & (bins - 1)] += (static_cast<uint64_t>(key) >> (shift + bits)) == prefix;
        });
      }
      std::lock_guard<std::mutex> lock(merge);
      for (uint32_t d = 0; d < bins; ++d) hist[d] += local[d];
    });
    return hist;
  };
  int64_t need = k;
  const uint32_t top = cut(top_hist ? *top_hist : histogram(for_each, kTopShift, kTopBits, 0), need);
  // above[c]: chunk c's keys above the threshold; counted in parts as the digits resolve.
  std::vector<int64_t> above(chunks, 0);
  std::vector<Records> bucket(narrow ? chunks : 0);
  if (narrow) {
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        Records& mine = bucket[c];
        int64_t over = 0;
        for_each(c, [&](uint32_t key, int64_t i, float v) {
          if (mine.size == mine.capacity) mine.make_room(std::max<int64_t>(1024, mine.capacity));
          mine.data[mine.size] = cpu::record(v, i);  // written always, kept if in the bucket
          mine.size += (key >> kTopShift) == top;
          over += (key >> kTopShift) > top;
        });
        above[c] = over;
      }
    });
  }
  // Over the top bucket's entries when narrowed, else over all (the filters then apply).
  auto finish = [&](const auto& entries) {
    uint32_t prefix = top << kMidBits | cut(histogram(entries, kLowBits, kMidBits, top), need);
    // The last digit is counted per chunk, together with the keys above the prefix, so the
    // per-chunk counts of keys above and equal to the threshold follow without another walk.
    constexpr uint32_t kLowBins = 1u << kLowBits;
    std::vector<int64_t> low(chunks * kLowBins, 0), equal(chunks, 0);
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        int64_t* h = low.data() + c * kLowBins;
        int64_t over = 0;
        entries(c, [&](uint32_t key, int64_t, float) {
          const uint32_t high = key >> kLowBits;
          over += high > prefix;
          if (high == prefix) ++h[key & (kLowBins - 1)];
        });
        above[c] += over;
      }
    });
    std::vector<int64_t> low_total(kLowBins, 0);
    for (int64_t c = 0; c < chunks; ++c) {
      for (uint32_t d = 0; d < kLowBins; ++d) low_total[d] += low[c * kLowBins + d];
    }
    const uint32_t low_digit = cut(low_total, need);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t* h = low.data() + c * kLowBins;
      for (uint32_t d = low_digit + 1; d < kLowBins; ++d) above[c] += h[d];
      equal[c] = h[low_digit];
    }
    return std::make_pair(prefix << kLowBits | low_digit, equal);
  };
  const auto cut_at = narrow ? finish([&](int64_t c, auto&& fn) {
    for (uint64_t e : bucket[c]) fn(record_key(e), record_index(e), record_value(e));
  }) : finish(for_each);
  bucket.clear();
  const uint32_t threshold = cut_at.first;
  const std::vector<int64_t>& equal = cut_at.second;

  const int64_t ties = need;  // of the keys equal to the threshold, the first `ties` are kept
  std::vector<int64_t> chunk_ties(chunks), offset(chunks + 1);
  int64_t ties_left = ties;
  offset[0] = 0;
  for (int64_t c = 0; c < chunks; ++c) {  // ties go to the lowest indices: the first chunks
    chunk_ties[c] = std::min(ties_left, equal[c]);
    ties_left -= chunk_ties[c];
    offset[c + 1] = offset[c] + above[c] + chunk_ties[c];
  }
  TORCH_INTERNAL_ASSERT(offset[chunks] == k, "accordion::topk_ef: selected ", offset[chunks], " entries instead of ", k);
  // The writing walk, free of data-dependent branches: every entry is written at the next
  // output slot while slots remain, and the slot only advances when the entry is kept (an
  // entry not kept is overwritten by the next kept one). g is written only where pass 1's
  // zeroing guessed wrong: a kept entry below zeroed_from, or one not kept above it.
  std::vector<double> kept(chunks, 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t pos = offset[c], taken = 0;
      const int64_t end = offset[c + 1], chunk_ties_c = chunk_ties[c];
      for_each(c, [&](uint32_t key, int64_t i, float v) {
        const bool tie = key == threshold;
        const bool keep = (key > threshold) | (tie & (taken < chunk_ties_c));
        taken += tie;
        if (pos < end) {
          out.values[pos] = v;
          out.indices[pos] = static_cast<int32_t>(i);
        }
        pos += keep;
        if (keep != (key >= out.zeroed_from)) out.g[i] = keep ? 0.0f : v;
      });
      kept[c] = sum_squares(out.values + offset[c], end - offset[c]);
    }
  });
  for (double s : kept) out.kept_sq += s;
}

template <typename G>
void topk_ef_impl(const G* grad, float* g, int64_t n, int64_t k, float* values, int32_t* indices,
                  double& g_sq, double& kept_sq) {
  const Chunks chunks{n, std::clamp<int64_t>((n + kMinChunk - 1) / kMinChunk, 1, kMaxChunks)};
  const bool sample = k > 0 && k <= n / 4 && n >= kMinChunk;
  const KeyBounds bounds = sample ? sampled_bounds(grad, g, n, k) : KeyBounds{kNoKey, kNoKey};
  const int64_t max_cands = 3 * k + kCandidateSlack;
  std::atomic<int64_t> listed{0};

  // The one pass over the tensor.
  std::vector<Records> cands(chunks.count);
  std::vector<double> sq(chunks.count, 0.0);
  std::vector<int64_t> top_hist(1u << kTopBits, 0);
  std::mutex merge;
  at::parallel_for(0, chunks.count, 1, [&](int64_t c0, int64_t c1) {
    std::vector<int64_t> local(sample ? top_hist.size() : 0, 0);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b = chunks.begin(c), e = chunks.end(c);
      if (sample) cands[c].make_room(static_cast<int64_t>(1.5 * k * (e - b) / n) + kBlock + 8);
      sq[c] = ef_add_norm_candidates(grad, g, b, e, bounds, sample ? &cands[c] : nullptr, local.data(), listed,
                                     max_cands);
    }
    std::lock_guard<std::mutex> lock(merge);
    for (size_t d = 0; d < local.size(); ++d) top_hist[d] += local[d];
  });
  g_sq = 0;
  for (double s : sq) g_sq += s;
  Outputs out{values, indices, g};
  if (k == n) {  // everything is kept: no selection to make (never sampled, nothing zeroed)
    for (int64_t i = 0; i < n; ++i) {
      values[i] = g[i];
      indices[i] = static_cast<int32_t>(i);
      g[i] = 0.0f;
    }
    out.kept_sq = sum_squares(values, n);
  } else if (k > 0) {
    const int64_t total = listed.load();
    if (sample && total >= k && total <= max_cands) {
      out.zeroed_from = bounds.upper;
      select_exact(chunks.count, [&](int64_t c, auto&& fn) {
        for (uint64_t e : cands[c]) fn(record_key(e), record_index(e), record_value(e));
      }, k, out, &top_hist, /*narrow=*/total > kNarrowFrom);
    } else {  // all of g: more passes, no candidate storage
      if (sample && bounds.upper != kNoKey) {  // put back what pass 1 zeroed (all listed)
        at::parallel_for(0, chunks.count, 1, [&](int64_t c0, int64_t c1) {
          for (int64_t c = c0; c < c1; ++c) {
            for (uint64_t e : cands[c]) {
              if (record_key(e) >= bounds.upper) g[record_index(e)] = record_value(e);
            }
          }
        });
      }
      select_exact(chunks.count, [&](int64_t c, auto&& fn) {
        for (int64_t i = chunks.begin(c), end = chunks.end(c); i < end; ++i) fn(key_of(g[i]), i, g[i]);
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
