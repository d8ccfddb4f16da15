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
// key bits are resolved a digit at a time (a full key as 12, 11 and 8 bits): a histogram
// per digit, the bucket holding the k-th largest key, then the next digit within it.
//
// Fast path, one pass over the tensor. A sample of 16Ki entries of g gives three keys: L,
// which with overwhelming probability a little more than k entries reach (about 1.05k plus
// four standard deviations of the sample); U, which a little fewer than k reach (one
// standard deviation below k); and S, which fewer than k reach all but surely (three below).
// The single pass (topk_pass1.h; AVX-512 where the CPU has it) does the error-feedback add,
// the squared norm, lists the entries with key >= L as candidates (a vectorized compare;
// everything else is never looked at again), and zeroes in g the entries with key >= U,
// which are almost all kept, while the block is still in registers. The candidate records
// carry key, sign and index, so the select writes values and indices without reading g.
// The threshold is looked for only in the band [L, S) of the candidates (about a sixth of
// them, and keys that share their leading bits: often two digits instead of three); those
// at or above S are simply kept. The writing walk (topk_write.h) zeroes the kept entries
// below U: at a 10% ratio, a separate zeroing walk would touch every cache line of g a
// second time. Should U turn out to be above the threshold, the entries zeroed but not kept
// are written back from their records.
// Fallback: if the sample misled (fewer than k candidates, or more than 3k + 64Ki), or the
// tensor is small or k > n/4, g is restored from the records and the same select runs over
// all of g in a few more passes; if S was reached by k or more, over all candidates.
// Either way the result is exact, the same on every thread count, and no O(n) temporary is
// allocated (candidates are O(k)). Outputs are in ascending index order.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <memory>
#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

#include "cpu/topk_pass1.h"
#include "cpu/topk_write.h"
#include "cpu/kernels.h"

namespace accordion {
namespace {

using cpu::EntryWriter;
using cpu::kNoKey;
using cpu::Outputs;
using cpu::key_of;
using cpu::record_index;
using cpu::record_key;
using cpu::record_value;

// Radix digits of the select: the last one, counted per chunk, has at most kLowBits; the
// others at most kMaxDigitBits (8Ki bins, 64 KiB of counts). A full key (31 bits) takes
// 12 + 11 + 8, a band of candidates sharing their leading bits often two digits.
constexpr int kLowBits = 8, kMaxDigitBits = 13;
// The sample's keys are bucketed by their leading kTopBits bits.
constexpr int kTopBits = 12, kTopShift = 31 - kTopBits;
constexpr int64_t kBlock = cpu::kPassBlock;
constexpr int64_t kMinChunk = 1 << 16;    // smallest piece of work one thread takes
// At most this many chunks, whatever the thread count, so that every result (including the
// float rounding of g_sq) is the same on any number of threads.
constexpr int64_t kMaxChunks = 64;
constexpr int64_t kSampleRuns = 128, kSampleRun = 128;  // 16Ki sampled entries
constexpr int64_t kCandidateSlack = 1 << 16;
constexpr int64_t kSerialSelect = 1 << 15;  // entries: below this one thread finds the cut

// The tensor is cut into `count` contiguous chunks, independent of the thread count;
// per-chunk counts give every chunk its output offset.
struct Chunks {
  int64_t n, count;
  int64_t begin(int64_t c) const { return c * n / count; }
  int64_t end(int64_t c) const { return (c + 1) * n / count; }
};

// The r-th largest of `keys` for each r in `ranks` (1 <= r <= size): the leading digit of
// each from one histogram, then nth_element among the keys that share it. Branch-free
// throughout: the histogram is kept four times over (neighbouring keys often share a bucket,
// and one copy would make each increment wait for the last), and every key is written into
// each bucket's list, whose end only advances on a match.
template <size_t N>
std::array<uint32_t, N> largest_keys(const std::vector<uint32_t>& keys, std::array<int64_t, N> ranks) {
  constexpr uint32_t kBins = 1u << kTopBits;
  const size_t size = keys.size();
  std::vector<uint32_t> hist(4 * kBins, 0);
  size_t i = 0;
  for (; i + 4 <= size; i += 4) {
    for (uint32_t j = 0; j < 4; ++j) ++hist[j * kBins + (keys[i + j] >> kTopShift)];
  }
  for (; i < size; ++i) ++hist[keys[i] >> kTopShift];
  for (uint32_t d = 0; d < kBins; ++d) hist[d] += hist[kBins + d] + hist[2 * kBins + d] + hist[3 * kBins + d];

  std::array<uint32_t, N> top, found;
  for (size_t j = 0; j < N; ++j) {
    uint32_t t = kBins;
    while (t-- > 0 && hist[t] < ranks[j]) ranks[j] -= hist[t];
    top[j] = t;
  }
  // Bucket j's list needs room for its keys plus the one slot written past them.
  std::array<size_t, N> start, filled{};
  size_t room = 0;
  for (size_t j = 0; j < N; ++j) {
    start[j] = room;
    room += hist[top[j]] + 1;
  }
  std::vector<uint32_t> bucket(room);
  for (uint32_t key : keys) {
    for (size_t j = 0; j < N; ++j) {
      bucket[start[j] + filled[j]] = key;
      filled[j] += (key >> kTopShift) == top[j];
    }
  }
  for (size_t j = 0; j < N; ++j) {
    uint32_t* b = bucket.data() + start[j];
    std::nth_element(b, b + (ranks[j] - 1), b + filled[j], std::greater<uint32_t>());
    found[j] = b[ranks[j] - 1];
  }
  return found;
}

// Keys that, judging from a sample of g = grad + residual (computed as the error-feedback add
// computes it), bracket the k-th largest: `lower`, which more than k entries reach with
// overwhelming probability (the sample's r-th largest key, r about 1.05 k/n of the sample
// plus four standard deviations), and `upper`, which somewhat fewer than k should reach (one
// standard deviation below k/n of the sample; none, kNoKey, when that rank is below 1), and
// `sure`, which fewer than k entries reach with overwhelming probability (three standard
// deviations below; kNoKey when that rank is below 1): the select looks for the threshold
// only among the candidates below `sure`, a small band of them (see select_candidates). An
// `upper` a little too low costs only a few write-backs (see topk_ef_impl); one too high
// leaves more kept entries to zero one by one, so it sits close to the expected cut. The
// sample is kSampleRuns runs spread evenly over the tensor: short sequential streams,
// prefetched up front, rather than a miss per sampled entry.
struct KeyBounds {
  uint64_t lower;  // kNoKey: list nothing
  uint64_t upper;  // kNoKey: zero nothing
  uint64_t sure;   // kNoKey: the band is all candidates
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
  const int64_t r_sure = static_cast<int64_t>(std::floor(expected - 3 * std::sqrt(expected) - 2));
  // lower <= upper <= sure (r_low > r_high > r_sure), so every entry zeroed in pass 1 is a
  // candidate.
  const auto [lower, upper, sure] = largest_keys<3>(
      keys, {r_low, std::max<int64_t>(r_high, 1), std::max<int64_t>(r_sure, 1)});
  return {lower, r_high >= 1 ? upper : kNoKey, r_sure >= 1 ? sure : kNoKey};
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
// bounds.lower; entries with key >= bounds.upper are zeroed in g. Stops listing (and zeroing) past `max_cands` (the
// caller then falls back; `listed` counts over all chunks), but always finishes the add and
// the norm.
template <typename G>
double ef_add_norm_candidates(const G* grad, float* g, int64_t begin, int64_t end, KeyBounds bounds,
                              Records* records, std::atomic<int64_t>& listed,
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
    records->size += nh;
    listed.fetch_add(nh, std::memory_order_relaxed);
  }
  return sq;
}


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

// Where the threshold falls: the threshold key T, how many of the entries equal to T are kept
// (the first ones in index order), and per chunk how many entries are above T and equal to it.
struct Cut {
  uint32_t threshold = 0;
  int64_t ties = 0;
  std::vector<int64_t> above, equal;
};

// The cut for the k largest keys of a set of entries given per chunk, in index order:
// `for_each(c, fn)` calls fn(key, index, value) for chunk c's entries, all of whose keys lie
// in [lowest, highest]. Only the bits below the leading ones those two share are resolved,
// a digit histogram at a time, each narrowed to the bucket the previous one chose; the last
// digit is counted per chunk, together with the keys above the prefix, so the per-chunk
// counts follow without another walk. Each walk is parallel over chunks (integer counts
// merge in any order), unless `serial`: for a few thousand entries, waking the other
// threads costs more than the walks.
template <typename ForEach>
Cut find_cut(int64_t chunks, const ForEach& for_each, int64_t k, uint32_t lowest = 0,
             uint32_t highest = 0x7fffffffu, bool serial = false) {
  const int64_t grain = serial ? chunks : 1;
  // Histogram of (key >> shift) & (bins - 1) over keys with key >> (shift + bits) == prefix.
  auto histogram = [&](int shift, int bits, uint32_t prefix) {
    const uint32_t bins = 1u << bits;
    std::vector<int64_t> hist(bins, 0);
    std::mutex merge;
    at::parallel_for(0, chunks, grain, [&](int64_t c0, int64_t c1) {
      std::vector<int64_t> local(bins, 0);
      for (int64_t c = c0; c < c1; ++c) {
        for_each(c, [&](uint32_t key, int64_t, float) {
          // Branch-free: about one key in six matches, at random, which a branch mispredicts.
          local[(key >> shift) & (bins - 1)] += (static_cast<uint64_t>(key) >> (shift + bits)) == prefix;
        });
      }
      std::lock_guard<std::mutex> lock(merge);
      for (uint32_t d = 0; d < bins; ++d) hist[d] += local[d];
    });
    return hist;
  };
  const uint32_t differ = lowest ^ highest;  // keys < 2^31: at most 31 free bits
  const int free_bits = differ == 0 ? 0 : 32 - __builtin_clz(differ);
  const int low_bits = std::min(free_bits, kLowBits);
  int64_t need = k;
  uint32_t prefix = static_cast<uint32_t>(static_cast<uint64_t>(lowest) >> free_bits);
  // The bits above the last digit, in equal digits, the wider ones first.
  int shift = free_bits;
  for (int digits = (free_bits - low_bits + kMaxDigitBits - 1) / kMaxDigitBits; digits > 0; --digits) {
    const int bits = (shift - low_bits + digits - 1) / digits;
    shift -= bits;
    prefix = prefix << bits | cut(histogram(shift, bits, prefix), need);
  }

  const uint32_t low_bins = 1u << low_bits;
  Cut result;
  result.above.assign(chunks, 0);
  result.equal.assign(chunks, 0);
  std::vector<int64_t> low(chunks * low_bins, 0);
  at::parallel_for(0, chunks, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* h = low.data() + c * low_bins;
      int64_t over = 0;
      for_each(c, [&](uint32_t key, int64_t, float) {
        const uint32_t high = key >> low_bits;
        over += high > prefix;
        if (high == prefix) ++h[key & (low_bins - 1)];
      });
      result.above[c] = over;
    }
  });
  std::vector<int64_t> low_total(low_bins, 0);
  for (int64_t c = 0; c < chunks; ++c) {
    for (uint32_t d = 0; d < low_bins; ++d) low_total[d] += low[c * low_bins + d];
  }
  const uint32_t low_digit = cut(low_total, need);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t* h = low.data() + c * low_bins;
    for (uint32_t d = low_digit + 1; d < low_bins; ++d) result.above[c] += h[d];
    result.equal[c] = h[low_digit];
  }
  result.threshold = prefix << low_bits | low_digit;
  result.ties = need;
  return result;
}

// Writes the k entries the cut keeps (values, indices, ascending) and their squared norm, and
// mends g (topk_write.h). Ties go to the lowest indices, so to the first chunks; per-chunk
// counts give every chunk its output offset. `walk(c, writer)` feeds chunk c's entries, in
// index order, to the EntryWriter.
template <typename Walk>
void write_selection(int64_t chunks, const Walk& walk, int64_t k, const Cut& cut, Outputs& out) {
  std::vector<int64_t> chunk_ties(chunks), offset(chunks + 1);
  int64_t ties_left = cut.ties;
  offset[0] = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    chunk_ties[c] = std::min(ties_left, cut.equal[c]);
    ties_left -= chunk_ties[c];
    offset[c + 1] = offset[c] + cut.above[c] + chunk_ties[c];
  }
  TORCH_INTERNAL_ASSERT(offset[chunks] == k, "accordion::topk_ef: selected ", offset[chunks], " entries instead of ", k);
  std::vector<double> kept(chunks, 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      EntryWriter writer{out, cut.threshold, offset[c], offset[c + 1], chunk_ties[c]};
      walk(c, writer);
      kept[c] = sum_squares(out.values + offset[c], offset[c + 1] - offset[c]);
    }
  });
  for (double s : kept) out.kept_sq += s;
}

// The exact selection of the k largest keys over a set of entries given per chunk.
template <typename ForEach>
void select_exact(int64_t chunks, const ForEach& for_each, int64_t k, Outputs& out) {
  const auto walk = [&](int64_t c, EntryWriter& writer) { for_each(c, writer); };
  write_selection(chunks, walk, k, find_cut(chunks, for_each, k), out);
}

inline auto each_record(const std::vector<Records>& records) {
  return [&records](int64_t c, auto&& fn) {
    for (uint64_t e : records[c]) fn(record_key(e), record_index(e), record_value(e));
  };
}

// The selection from pass 1's candidates. Those with key >= `sure` are kept (fewer than k
// reach it, all but surely); the threshold is looked for only among the others, the band
// [lower, sure), a small part of the candidates (about a sixth at a 10% ratio): one walk
// copies the band aside and counts the sure ones per chunk, the digit histograms run over
// the band, and one walk over all candidates writes the selection. If `sure` was reached by
// k or more entries after all, the digits run over all candidates instead.
void select_candidates(const std::vector<Records>& cands, int64_t k, uint32_t lowest, uint64_t sure, Outputs& out) {
  const int64_t chunks = static_cast<int64_t>(cands.size());
  std::vector<Records> band(chunks);
  std::vector<int64_t> sure_count(chunks, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      band[c].make_room(cands[c].size);
      uint64_t* to = band[c].data.get();
      int64_t size = 0, above = 0;
      for (uint64_t e : cands[c]) {  // branch-free: every record is written, kept if below `sure`
        const bool in_band = record_key(e) < sure;
        to[size] = e;
        size += in_band;
        above += !in_band;
      }
      band[c].size = size;
      sure_count[c] = above;
    }
  });
  int64_t sure_total = 0;
  for (int64_t s : sure_count) sure_total += s;
  if (sure_total >= k) {
    select_exact(chunks, each_record(cands), k, out);
    return;
  }
  const uint32_t highest = sure == kNoKey ? 0x7fffffffu : static_cast<uint32_t>(sure) - 1;
  int64_t band_total = 0;
  for (const Records& b : band) band_total += b.size;
  Cut cut = find_cut(chunks, each_record(band), k - sure_total, lowest, highest, band_total < kSerialSelect);
  for (int64_t c = 0; c < chunks; ++c) cut.above[c] += sure_count[c];  // all above T < sure
  band.clear();
  const auto walk = [&](int64_t c, EntryWriter& writer) {
    cpu::write_records(cands[c].begin(), cands[c].size, writer);
  };
  write_selection(chunks, walk, k, cut, out);
}

template <typename G>
void topk_ef_impl(const G* grad, float* g, int64_t n, int64_t k, float* values, int32_t* indices,
                  double& g_sq, double& kept_sq) {
  const Chunks chunks{n, std::clamp<int64_t>((n + kMinChunk - 1) / kMinChunk, 1, kMaxChunks)};
  const bool sample = k > 0 && k <= n / 4 && n >= kMinChunk;
  const KeyBounds bounds = sample ? sampled_bounds(grad, g, n, k) : KeyBounds{kNoKey, kNoKey, kNoKey};
  const int64_t max_cands = 3 * k + kCandidateSlack;
  std::atomic<int64_t> listed{0};

  // The one pass over the tensor.
  std::vector<Records> cands(chunks.count);
  std::vector<double> sq(chunks.count, 0.0);
  at::parallel_for(0, chunks.count, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b = chunks.begin(c), e = chunks.end(c);
      if (sample) cands[c].make_room(static_cast<int64_t>(1.5 * k * (e - b) / n) + kBlock + 8);
      sq[c] = ef_add_norm_candidates(grad, g, b, e, bounds, sample ? &cands[c] : nullptr, listed, max_cands);
    }
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
      select_candidates(cands, k, static_cast<uint32_t>(bounds.lower), bounds.sure, out);
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
