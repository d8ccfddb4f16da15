// CUDA kernel sequence of accordion::topk_ef: TopK sparsification with error feedback, fused,
// exact, with no host round-trip (see kernels.h for the contract; the CPU kernel and
// accordion_hvd/reference.py::topk_select define the same function).
//
// Selection is a radix select on the 31-bit key bits(g) & 0x7fffffff (for a non-negative
// float the IEEE bits order like the value), in the spirit of AIR top-k: digits of 11, 11
// and 9 bits, a histogram per digit, every decision made on the device. The tensor is cut
// into one contiguous chunk per block, so that everything a block writes comes out in index
// order and needs no global atomics.
//
//   sample       (one block)  the keys of 8Ki entries of g = grad + residual, spread over the
//                tensor; the key L that a little more than k entries reach, with high
//                probability (k/n of the sample plus four standard deviations), and the key
//                U that a little fewer than k reach (four standard deviations below).
//   ef_capture   (the one full pass)  g = grad + residual written back into the residual,
//                per-block sums of g^2, and every entry with key >= L copied as (value,
//                index) into its block's slice of a candidate list, in index order. Entries
//                with key >= U are written back as 0: they are kept with high probability,
//                and zeroing them here saves scattered writes later.
//   decide       (one block)  fast path if the candidates number at least k and no slice
//                overflowed; otherwise every later kernel reads g itself instead (same
//                code, the "source" switches), which is exact but makes four more passes.
//   level_hist x3, pick_bucket x3   the histogram of each digit among the source's entries
//                that match the digits found so far, and the bucket holding the k-th largest:
//                at the end the exact threshold key T and how many entries equal to T to keep.
//   count_kept, scan_blocks, write_kept   ordered compaction of the source: entries above T,
//                and entries equal to T in index order until enough are kept (ties: the lower
//                index wins); they give values and indices in ascending index order, zero the
//                kept entries of the residual, and sum kept^2 per block.
//   finish_norms (one block)  both partial sums in a fixed order: g_sq and kept_sq are the
//                same bits run after run (no floating-point atomics anywhere).
//
// The kernels pass their decisions to each other in a control block in device memory
// (`Control`, zeroed with the workspace): L (`lower_key`) and U (`upper_key`) from sample;
// `overflow` (a block's candidate slice was too small) from ef_capture; `fast` (1: the
// candidates are the source, 0: g is) from decide; `prefix` (the key bits resolved so far,
// at the end the threshold T) and `remaining` (what is still to take inside the current
// bucket, at the end how many entries equal to T are kept) from the pick_bucket kernels.
// U is why the fallback and write_kept must put values back: every entry with key >= U was
// zeroed in the residual by the one pass; write_kept restores those that end up not kept
// (key >= U but below T, or ties past the count), and on the fallback path `restore`
// puts all of them back before g is read as the source. U = 0xffffffff (above every key)
// when the sample says too few entries are sure to be kept: nothing is zeroed early then.
//
// Memory traffic on the fast path: grad and residual read once and residual written once
// (the floor), plus about 8 bytes per candidate written and read four times (the candidates
// number ~1.05k + a few standard deviations) and the scattered zeroing of the k kept entries.
// Workspace: the candidate slices (8 bytes x (1.3 k/n + 1%) of n, + 2 KiB per block),
// histograms and per-block counters (~40 KiB).
#include <climits>
#include <cmath>
#include <type_traits>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "cuda/convert.cuh"
#include "cuda/kernels.h"

namespace accordion {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kItems = 4;                     // entries per thread per tile (one 16-byte load)
constexpr int kTile = kThreads * kItems;
constexpr int kMaxBlocks = 1024;              // chunks: the same rounding on any GPU
constexpr int kBins = 2048;                   // 11-bit digits (the last one uses 512)
constexpr int kShift0 = 20, kShift1 = 9;
constexpr int kPickThreads = 512, kPickItems = kBins / kPickThreads;
constexpr int kSample = 8192, kSampleThreads = kPickThreads;  // find_bucket needs the whole block

// Decisions passed from kernel to kernel through device memory.
struct Control {
  uint32_t lower_key;   // L: entries with key >= L are candidates
  uint32_t upper_key;   // U: entries with key >= U are (almost surely) kept: zeroed in the pass
  uint32_t overflow;    // some block's slice was too small
  uint32_t fast;        // 1: later kernels read the candidates, 0: g
  uint32_t prefix;      // key bits resolved so far (at the end: T)
  int64_t remaining;    // still to take inside the current bucket (at the end: ties to keep)
};

struct Workspace {
  Control* ctl;
  uint32_t* hist;       // 3 levels x kBins
  uint32_t* counts;     // candidates per block
  uint32_t* above;      // per block: entries with key > T
  uint32_t* ties;       // per block: entries with key == T
  int64_t* offset;      // per block: first output position
  int64_t* ties_kept;   // per block: how many of its ties are kept
  double* g_partial;    // per block
  double* kept_partial; // per block
  float2* candidates;   // blocks x slice entries of (value, index as bits)
  int64_t slice;
};

__device__ __forceinline__ uint32_t key_of(float v) { return __float_as_uint(v) & 0x7fffffffu; }

constexpr size_t align_up(size_t x) { return (x + 255) & ~size_t(255); }

int blocks_for(int64_t n) {
  const int64_t tiles = (n + kTile - 1) / kTile;
  return static_cast<int>(tiles < 1 ? 1 : (tiles < kMaxBlocks ? tiles : kMaxBlocks));
}
// Entries per chunk: a multiple of 4, so that every chunk starts 16-byte aligned.
int64_t chunk_for(int64_t n, int blocks) { return ((n + blocks - 1) / blocks + 3) / 4 * 4; }

// Candidate slots per block: the expected share of candidates (k/n plus the sampling margin)
// with room to spare. A slice that overflows only costs speed (the fallback), never results.
int64_t slice_for(int64_t n, int64_t k, int blocks) {
  const double p = n > 0 ? static_cast<double>(k) / n : 0.0;
  const double share = std::fmin(1.0, 1.3 * p + 0.01);
  return static_cast<int64_t>(share * chunk_for(n, blocks)) + 256;
}

// Sample rank of L: k/n of the sample, plus four standard deviations and a little, so that
// fewer than k entries reach L only with negligible probability (then: the fallback).
// sign = -1: the rank of U instead, four standard deviations below (0: no U).
int sample_target(int64_t n, int64_t k, int samples, int sign = 1) {
  const double mean = static_cast<double>(k) / n * samples;
  const double t = std::ceil(mean + sign * (4.0 * std::sqrt(mean * (1.0 - static_cast<double>(k) / n)) + 8.0));
  return static_cast<int>(t < 0 ? 0 : (t < samples ? t : samples));
}

size_t layout(char* base, int64_t n, int64_t k, Workspace* ws) {
  size_t off = 0;
  auto take = [&](size_t bytes) { char* p = base ? base + off : nullptr; off += align_up(bytes); return p; };
  const int blocks = blocks_for(n);
  Workspace w;
  w.ctl = reinterpret_cast<Control*>(take(sizeof(Control)));
  w.hist = reinterpret_cast<uint32_t*>(take(3 * kBins * sizeof(uint32_t)));
  w.counts = reinterpret_cast<uint32_t*>(take(kMaxBlocks * sizeof(uint32_t)));
  w.above = reinterpret_cast<uint32_t*>(take(kMaxBlocks * sizeof(uint32_t)));
  w.ties = reinterpret_cast<uint32_t*>(take(kMaxBlocks * sizeof(uint32_t)));
  w.offset = reinterpret_cast<int64_t*>(take(kMaxBlocks * sizeof(int64_t)));
  w.ties_kept = reinterpret_cast<int64_t*>(take(kMaxBlocks * sizeof(int64_t)));
  w.g_partial = reinterpret_cast<double*>(take(kMaxBlocks * sizeof(double)));
  w.kept_partial = reinterpret_cast<double*>(take(kMaxBlocks * sizeof(double)));
  w.slice = slice_for(n, k, blocks);
  w.candidates = reinterpret_cast<float2*>(take(static_cast<size_t>(blocks) * w.slice * sizeof(float2)));
  if (ws) *ws = w;
  return off;
}

template <int Threads>
__device__ double block_sum(double v) {
  using Reduce = cub::BlockReduce<double, Threads>;
  __shared__ typename Reduce::TempStorage temp;
  return Reduce(temp).Sum(v);  // valid in thread 0
}

struct HistCount {  // a histogram in shared or global memory, read as int64 counts
  const uint32_t* hist;
  __device__ __forceinline__ int64_t operator()(int b) const { return hist[b]; }
};

// In a sorted-from-the-top histogram `count(bin)` of `bins` bins, the bin holding the
// `want`-th largest entry and how many lie above it. Block-wide (kPickThreads threads).
__device__ void find_bucket(HistCount count, int bins, int64_t want, uint32_t* bucket, int64_t* above_out,
                            int64_t* in_bucket) {
  using Scan = cub::BlockScan<int64_t, kPickThreads>;
  __shared__ typename Scan::TempStorage temp;
  int64_t counts[kPickItems], incl[kPickItems];
#pragma unroll
  for (int j = 0; j < kPickItems; ++j) {  // thread t holds bins from the top
    const int r = threadIdx.x * kPickItems + j;
    counts[j] = r < bins ? count(bins - 1 - r) : 0;
  }
  Scan(temp).InclusiveSum(counts, incl);
#pragma unroll
  for (int j = 0; j < kPickItems; ++j) {
    const int r = threadIdx.x * kPickItems + j;
    const int64_t above = incl[j] - counts[j];
    if (r < bins && counts[j] > 0 && above < want && incl[j] >= want) {
      *bucket = bins - 1 - r;
      *above_out = above;
      *in_bucket = counts[j];
    }
  }
}

// --- sample: the candidate bound L ------------------------------------------------------------

// The 22-bit bucket (top two digits) of the rank-th largest of the sample's keys.
__device__ uint32_t sample_bucket(const uint32_t* keys, int samples, int64_t rank, uint32_t* hist) {
  __shared__ uint32_t bucket0, bucket1;
  __shared__ int64_t above0, above1, in0, in1;
  for (int b = threadIdx.x; b < kBins; b += kSampleThreads) hist[b] = 0;
  __syncthreads();
  for (int s = threadIdx.x; s < samples; s += kSampleThreads) atomicAdd(&hist[keys[s] >> kShift0], 1u);
  __syncthreads();
  find_bucket(HistCount{hist}, kBins, rank, &bucket0, &above0, &in0);
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += kSampleThreads) hist[b] = 0;
  __syncthreads();
  for (int s = threadIdx.x; s < samples; s += kSampleThreads)
    if ((keys[s] >> kShift0) == bucket0) atomicAdd(&hist[(keys[s] >> kShift1) & (kBins - 1)], 1u);
  __syncthreads();
  find_bucket(HistCount{hist}, kBins, rank - above0, &bucket1, &above1, &in1);
  __syncthreads();
  return (bucket0 << (kShift0 - kShift1)) | bucket1;
}

// L: the start of the bucket holding the sample's `target`-th largest key (a little more
// than k entries of g reach it); U: the start of the bucket above the one holding the
// `target_low`-th (a little fewer than k reach it), or no key at all when target_low < 1.
template <typename G>
__global__ void __launch_bounds__(kSampleThreads) sample(const G* __restrict__ grad, const float* __restrict__ residual,
                                                         int64_t n, int samples, int target, int target_low,
                                                         Control* ctl) {
  __shared__ uint32_t keys[kSample];
  __shared__ uint32_t hist[kBins];
  // Stratified: one entry from each of `samples` equal strata, at a hashed offset, so that
  // the sample cannot alias with a layer's row structure.
  for (int s = threadIdx.x; s < samples; s += kSampleThreads) {
    const int64_t lo = n * s / samples, hi = n * (s + 1) / samples;
    const uint32_t h = static_cast<uint32_t>(s) * 2654435761u;
    const int64_t i = lo + (hi > lo ? static_cast<int64_t>(h % static_cast<uint32_t>(hi - lo)) : 0);
    keys[s] = key_of(residual[i] + up(grad[i]));
  }
  __syncthreads();
  const uint32_t lower = sample_bucket(keys, samples, target, hist) << kShift1;
  const uint32_t upper = target_low >= 1 ? (sample_bucket(keys, samples, target_low, hist) + 1) << kShift1
                                         : 0xffffffffu;  // above every key (keys < 2^31)
  if (threadIdx.x == 0) {
    ctl->lower_key = lower;
    ctl->upper_key = upper;
  }
}

// --- the one full pass: error feedback, norm, candidates ---------------------------------------

template <typename G> struct Vec4;  // four gradient entries, one aligned load
template <> struct Vec4<float> { using type = float4; };
template <> struct Vec4<__half> { using type = uint2; };
template <> struct Vec4<__nv_bfloat16> { using type = uint2; };

template <typename G>
__device__ __forceinline__ void load4(const G* grad, int64_t i, bool vectorized, int64_t n, float out[4]) {
  if (vectorized && i + 3 < n) {
    const typename Vec4<G>::type v = *reinterpret_cast<const typename Vec4<G>::type*>(grad + i);
    if constexpr (std::is_same_v<G, float>) {
      out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
    } else {
      const G* h = reinterpret_cast<const G*>(&v);
#pragma unroll
      for (int j = 0; j < 4; ++j) out[j] = up(h[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = i + j < n ? up(grad[i + j]) : 0.0f;
  }
}

template <typename G>
__global__ void __launch_bounds__(kThreads) ef_capture(const G* __restrict__ grad, float* __restrict__ g, int64_t n,
                                                       int64_t chunk, bool vectorized, bool capture, Control* ctl,
                                                       float2* candidates,
                                                       int64_t slice, uint32_t* counts, double* g_partial) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  const uint32_t lower = ctl->lower_key, upper = ctl->upper_key;
  const int64_t begin = blockIdx.x * chunk, end = begin + chunk < n ? begin + chunk : n;
  float2* mine = candidates + blockIdx.x * slice;
  int64_t recorded = 0;  // the same in every thread
  bool overflow = false;
  double sq = 0;
  for (int64_t base = begin; base < end; base += kTile) {  // uniform trip count in the block
    const int64_t i = base + threadIdx.x * kItems;
    const bool whole = vectorized && i + 3 < end;
    float v[kItems], gr[kItems];
    load4(grad, i, vectorized, end, gr);
    if (whole) {
      const float4 r = *reinterpret_cast<const float4*>(g + i);
      v[0] = r.x + gr[0]; v[1] = r.y + gr[1]; v[2] = r.z + gr[2]; v[3] = r.w + gr[3];
    } else {
#pragma unroll
      for (int j = 0; j < kItems; ++j) v[j] = i + j < end ? g[i + j] + gr[j] : 0.0f;
    }
    int hits = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const bool in = i + j < end;
      sq += in ? static_cast<double>(v[j]) * v[j] : 0.0;
      hits += capture && in && key_of(v[j]) >= lower;
    }
    int pos, total;
    Scan(temp).ExclusiveSum(hits, pos, total);
    __syncthreads();  // temp is reused next tile
    // A tile's candidates are recorded whole or not at all; only recorded entries may be
    // zeroed here (the fallback restores them from their records).
    const bool record = capture && recorded + total <= slice;
    float out[kItems];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const uint32_t key = key_of(v[j]);
      out[j] = record && key >= upper ? 0.0f : v[j];
      if (record && i + j < end && key >= lower)
        mine[recorded + pos++] = make_float2(v[j], __int_as_float(static_cast<int>(i + j)));
    }
    if (whole) {
      *reinterpret_cast<float4*>(g + i) = make_float4(out[0], out[1], out[2], out[3]);
    } else {
#pragma unroll
      for (int j = 0; j < kItems; ++j)
        if (i + j < end) g[i + j] = out[j];
    }
    if (record) recorded += total;
    else overflow |= capture && total > 0;
  }
  const double block_sq = block_sum<kThreads>(sq);
  if (threadIdx.x == 0) {
    g_partial[blockIdx.x] = block_sq;
    counts[blockIdx.x] = static_cast<uint32_t>(recorded);
    if (overflow) atomicOr(&ctl->overflow, 1u);
  }
}

__global__ void __launch_bounds__(kMaxBlocks) decide(const uint32_t* counts, int blocks, int64_t k, Control* ctl) {
  const int64_t c = threadIdx.x < blocks ? counts[threadIdx.x] : 0;
  using Reduce = cub::BlockReduce<int64_t, kMaxBlocks>;
  __shared__ typename Reduce::TempStorage temp;
  const int64_t total = Reduce(temp).Sum(c);
  if (threadIdx.x == 0) ctl->fast = !ctl->overflow && total >= k;
}

// Fallback only: puts back the entries ef_capture zeroed (key >= U, all of them recorded), so
// that g is whole again for the passes that read it.
__global__ void __launch_bounds__(kThreads) restore(float* g, const float2* candidates, int64_t slice,
                                                    const uint32_t* counts, const Control* ctl) {
  if (ctl->fast) return;
  const uint32_t upper = ctl->upper_key;
  const float2* mine = candidates + blockIdx.x * slice;
  for (int64_t j = threadIdx.x, count = counts[blockIdx.x]; j < count; j += kThreads) {
    const float2 e = mine[j];
    if (key_of(e.x) >= upper) g[__float_as_int(e.y)] = e.x;
  }
}

// The entries a block reads after `decide`: its candidate slice, or its chunk of g.
struct Source {
  const float* g;
  int64_t n, chunk;
  const float2* candidates;
  int64_t slice;
  const uint32_t* counts;

  __device__ __forceinline__ int64_t size(bool fast) const {
    if (fast) return counts[blockIdx.x];
    const int64_t begin = blockIdx.x * chunk;
    return begin >= n ? 0 : (begin + chunk < n ? chunk : n - begin);
  }
  __device__ __forceinline__ float2 at(bool fast, int64_t j) const {  // (value, index bits)
    if (fast) return candidates[blockIdx.x * slice + j];
    const int64_t i = blockIdx.x * chunk + j;
    return make_float2(g[i], __int_as_float(static_cast<int>(i)));
  }
};

// --- the digits of T ---------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads) level_hist(Source src, int level, const Control* ctl, uint32_t* hist) {
  __shared__ uint32_t sh[kBins];
  for (int b = threadIdx.x; b < kBins; b += kThreads) sh[b] = 0;
  __syncthreads();
  const bool fast = ctl->fast;
  const uint32_t prefix = ctl->prefix;
  const int64_t size = src.size(fast);
  for (int64_t j = threadIdx.x; j < size; j += kThreads) {
    const uint32_t key = key_of(src.at(fast, j).x);
    if (level == 0) atomicAdd(&sh[key >> kShift0], 1u);
    else if (level == 1 && (key >> kShift0) == prefix) atomicAdd(&sh[(key >> kShift1) & (kBins - 1)], 1u);
    else if (level == 2 && (key >> kShift1) == prefix) atomicAdd(&sh[key & ((1u << kShift1) - 1)], 1u);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += kThreads)
    if (sh[b]) atomicAdd(&hist[b], sh[b]);
}

__global__ void __launch_bounds__(kPickThreads) pick_bucket(const uint32_t* hist, int level, int bits, int64_t k,
                                                            Control* ctl) {
  __shared__ uint32_t bucket;
  __shared__ int64_t above, in_bucket;
  const int64_t want = level == 0 ? k : ctl->remaining;
  find_bucket(HistCount{hist}, 1 << bits, want, &bucket, &above, &in_bucket);
  __syncthreads();
  if (threadIdx.x == 0) {
    ctl->prefix = level == 0 ? bucket : (ctl->prefix << bits) | bucket;
    ctl->remaining = want - above;
  }
}

// --- ordered compaction ----------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads) count_kept(Source src, const Control* ctl, uint32_t* above, uint32_t* ties) {
  const bool fast = ctl->fast;
  const uint32_t t = ctl->prefix;
  uint32_t a = 0, e = 0;
  for (int64_t j = threadIdx.x, size = src.size(fast); j < size; j += kThreads) {
    const uint32_t key = key_of(src.at(fast, j).x);
    a += key > t;
    e += key == t;
  }
  using Reduce = cub::BlockReduce<uint32_t, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  a = Reduce(temp).Sum(a);
  __syncthreads();
  e = Reduce(temp).Sum(e);
  if (threadIdx.x == 0) {
    above[blockIdx.x] = a;
    ties[blockIdx.x] = e;
  }
}

// One block, one thread per chunk: where each chunk's kept entries go, and how many of its
// ties are kept (the first `remaining` ties in index order over all chunks).
__global__ void __launch_bounds__(kMaxBlocks) scan_blocks(const uint32_t* above, const uint32_t* ties, int blocks,
                                                          const Control* ctl, int64_t* offset, int64_t* ties_kept) {
  using Scan = cub::BlockScan<int64_t, kMaxBlocks>;
  __shared__ typename Scan::TempStorage temp;
  const int b = threadIdx.x;
  const int64_t e = b < blocks ? ties[b] : 0;
  int64_t ties_before;
  Scan(temp).ExclusiveSum(e, ties_before);
  const int64_t want = ctl->remaining;
  const int64_t kept_ties = want - ties_before <= 0 ? 0 : (want - ties_before < e ? want - ties_before : e);
  const int64_t kept = (b < blocks ? above[b] : 0) + kept_ties;
  int64_t before;
  __syncthreads();
  Scan(temp).ExclusiveSum(kept, before);
  if (b < blocks) {
    offset[b] = before;
    ties_kept[b] = kept_ties;
  }
}

__global__ void __launch_bounds__(kThreads) write_kept(Source src, const Control* ctl, const int64_t* offset,
                                                       const int64_t* ties_kept, float* g, float* values,
                                                       int32_t* indices, double* kept_partial) {
  using Scan = cub::BlockScan<unsigned long long, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  const bool fast = ctl->fast;
  const uint32_t t = ctl->prefix, upper = ctl->upper_key;
  const int64_t out0 = offset[blockIdx.x], tk = ties_kept[blockIdx.x];
  uint64_t done = 0;  // (ties << 32 | above) before this tile, in this block
  double sq = 0;
  const int64_t size = src.size(fast);
  for (int64_t base = 0; base < size; base += kThreads) {  // uniform trip count
    const int64_t j = base + threadIdx.x;
    float2 e = make_float2(0.0f, 0.0f);
    uint32_t key = 0;
    if (j < size) {
      e = src.at(fast, j);
      key = key_of(e.x);
    }
    const bool is_above = j < size && key > t, is_tie = j < size && key == t;
    const unsigned long long mine = (static_cast<unsigned long long>(is_tie) << 32) | is_above;
    unsigned long long before, total;
    Scan(temp).ExclusiveSum(mine, before, total);
    __syncthreads();
    before += done;
    const int64_t above_before = before & 0xffffffffu, tie_rank = before >> 32;
    const bool kept = is_above || (is_tie && tie_rank < tk);
    const int32_t i = __float_as_int(e.y);
    if (kept) {
      const int64_t pos = out0 + above_before + (tie_rank < tk ? tie_rank : tk);
      values[pos] = e.x;
      indices[pos] = i;
      sq += static_cast<double>(e.x) * e.x;
    }
    // The fast path's g already has the entries >= U zeroed (ef_capture): zero the kept ones
    // below U, and put back the few >= U that were not kept. The fallback's g is whole.
    if (kept && (!fast || key < upper)) g[i] = 0.0f;
    if (fast && j < size && !kept && key >= upper) g[i] = e.x;
    done += total;
  }
  const double block_sq = block_sum<kThreads>(sq);
  if (threadIdx.x == 0) kept_partial[blockIdx.x] = block_sq;
}

__global__ void __launch_bounds__(kMaxBlocks) finish_norms(const double* g_partial, const double* kept_partial,
                                                           int blocks, bool any_kept, double* g_sq, double* kept_sq) {
  const double a = threadIdx.x < blocks ? g_partial[threadIdx.x] : 0.0;
  const double ga = block_sum<kMaxBlocks>(a);
  __syncthreads();
  const double b = any_kept && threadIdx.x < blocks ? kept_partial[threadIdx.x] : 0.0;
  const double kb = block_sum<kMaxBlocks>(b);
  if (threadIdx.x == 0) {
    *g_sq = ga;
    *kept_sq = kb;
  }
}

template <typename G>
cudaError_t run(const G* grad, float* g, int64_t n, int64_t k, float* values, int32_t* indices, double* g_sq,
                double* kept_sq, const Workspace& ws, cudaStream_t stream) {
  // Control and histograms start at zero: one memset over the head of the workspace.
  cudaError_t err = cudaMemsetAsync(ws.ctl, 0, reinterpret_cast<char*>(ws.counts) - reinterpret_cast<char*>(ws.ctl),
                                    stream);
  if (err) return err;
  const int blocks = blocks_for(n);
  const int64_t chunk = chunk_for(n, blocks);
  const bool vec = reinterpret_cast<uintptr_t>(g) % 16 == 0 && reinterpret_cast<uintptr_t>(grad) % (4 * sizeof(G)) == 0;
  const int samples = n < kSample ? static_cast<int>(n) : kSample;
  if (k > 0)
    sample<G><<<1, kSampleThreads, 0, stream>>>(grad, g, n, samples, sample_target(n, k, samples),
                                                sample_target(n, k, samples, -1), ws.ctl);
  ef_capture<G><<<blocks, kThreads, 0, stream>>>(grad, g, n, chunk, vec, k > 0, ws.ctl, ws.candidates, ws.slice,
                                                 ws.counts, ws.g_partial);
  if ((err = cudaGetLastError())) return err;
  if (k > 0) {
    const Source src{g, n, chunk, ws.candidates, ws.slice, ws.counts};
    decide<<<1, kMaxBlocks, 0, stream>>>(ws.counts, blocks, k, ws.ctl);
    restore<<<blocks, kThreads, 0, stream>>>(g, ws.candidates, ws.slice, ws.counts, ws.ctl);
    const int bits[3] = {11, 11, 9};
    for (int level = 0; level < 3; ++level) {
      level_hist<<<blocks, kThreads, 0, stream>>>(src, level, ws.ctl, ws.hist + level * kBins);
      pick_bucket<<<1, kPickThreads, 0, stream>>>(ws.hist + level * kBins, level, bits[level], k, ws.ctl);
    }
    count_kept<<<blocks, kThreads, 0, stream>>>(src, ws.ctl, ws.above, ws.ties);
    scan_blocks<<<1, kMaxBlocks, 0, stream>>>(ws.above, ws.ties, blocks, ws.ctl, ws.offset, ws.ties_kept);
    write_kept<<<blocks, kThreads, 0, stream>>>(src, ws.ctl, ws.offset, ws.ties_kept, g, values, indices,
                                                ws.kept_partial);
    if ((err = cudaGetLastError())) return err;
  }
  finish_norms<<<1, kMaxBlocks, 0, stream>>>(ws.g_partial, ws.kept_partial, blocks, k > 0, g_sq, kept_sq);
  return cudaGetLastError();
}

}  // namespace

size_t topk_ef_workspace_bytes(int64_t n, int64_t k) { return layout(nullptr, n, k, nullptr); }

cudaError_t topk_ef(const void* grad, DType grad_dtype, float* residual, int64_t n, int64_t k, float* values,
                    int32_t* indices, double* g_sq, double* kept_sq, void* workspace, size_t workspace_bytes,
                    cudaStream_t stream) {
  if (n < 0 || n > INT_MAX || k < 0 || k > n) return cudaErrorInvalidValue;
  Workspace ws;
  if (layout(static_cast<char*>(workspace), n, k, &ws) > workspace_bytes) return cudaErrorInvalidValue;
  switch (grad_dtype) {
    case DType::kFloat32:
      return run(static_cast<const float*>(grad), residual, n, k, values, indices, g_sq, kept_sq, ws, stream);
    case DType::kFloat16:
      return run(static_cast<const __half*>(grad), residual, n, k, values, indices, g_sq, kept_sq, ws, stream);
    case DType::kBFloat16:
      return run(static_cast<const __nv_bfloat16*>(grad), residual, n, k, values, indices, g_sq, kept_sq, ws,
                 stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace accordion
