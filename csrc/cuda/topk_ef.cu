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
// One call handles a whole bucket of layers ("segments") with the same fixed sequence of
// launches, however many layers there are: the kernels that work per layer (sample, decide,
// pick_bucket, scan_blocks, finish_norms) run one block per layer; the ones that sweep the
// data run one grid over every layer's chunks, each block finding its layer by a binary
// search over the layers' first block numbers. The layers' table travels in the kernel
// parameters (`Table`, __grid_constant__: read in place, never copied per thread), at most
// kMaxSegments layers per launch sequence, as PyTorch's multi_tensor_apply does; a bucket with
// more layers takes one more sequence per kMaxSegments. Every layer has its own Control and
// histograms; the per-block arrays are numbered call-wide.
//
// A layer's optional finite flag (device memory, never read by the host): where it is false
// the gradient is not added. With `poison` (the bucket op) such a layer's residual is left
// exactly as it was and its values are NaN, so nothing needs undoing; without (the one-layer
// op) the selection of the residual alone is made and zeroed as usual.
//
// Memory traffic on the fast path: grad and residual read once and residual written once
// (the floor), plus about 8 bytes per candidate written and read four times (the candidates
// number ~1.05k + a few standard deviations) and the scattered zeroing of the k kept entries.
// Workspace: the candidate slices (8 bytes x (1.3 k/n + 1%) of n, + 2 KiB per block),
// histograms and per-block counters (~40 KiB).
#include <climits>
#include <cmath>
#include <type_traits>
#include <vector>
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
constexpr int kMaxSegments = 24;              // layers per launch: the table stays under 4 KiB of parameters

// Decisions passed from kernel to kernel through device memory.
struct Control {
  uint32_t lower_key;   // L: entries with key >= L are candidates
  uint32_t upper_key;   // U: entries with key >= U are (almost surely) kept: zeroed in the pass
  uint32_t overflow;    // some block's slice was too small
  uint32_t fast;        // 1: later kernels read the candidates, 0: g
  uint32_t prefix;      // key bits resolved so far (at the end: T)
  int64_t remaining;    // still to take inside the current bucket (at the end: ties to keep)
};

// One layer of a call, as every kernel sees it (built on the host).
struct Segment {
  const void* grad;        // G, n entries
  float* g;                // the residual: becomes g = grad + residual, kept entries zeroed
  float* values;           // k outputs
  int32_t* indices;
  double* g_sq;            // one double each
  double* kept_sq;
  const bool* finite;      // its finite flag (device memory), or nullptr: finite
  int64_t n, k, chunk, slice;
  int64_t cand0;           // its first candidate slot
  int32_t blocks, block0;  // its chunks, and the call-wide number of the block of its first
  int32_t index;           // its number in the call: its Control and histograms
  int32_t samples, target, target_low;
  int32_t vectorized;
};

struct Table {             // the layers of one launch sequence (a kernel parameter)
  Segment seg[kMaxSegments];
  int32_t count;
  int32_t first_block;     // the call-wide number of grid block 0 in the sweeping kernels
};

struct Workspace {         // call-wide
  Control* ctl;            // per layer
  uint32_t* hist;          // per layer: 3 levels x kBins
  uint32_t* counts;        // per block: candidates
  uint32_t* above;         // per block: entries with key > T
  uint32_t* ties;          // per block: entries with key == T
  int64_t* offset;         // per block: first output position
  int64_t* ties_kept;      // per block: how many of its ties are kept
  double* g_partial;       // per block
  double* kept_partial;    // per block
  float2* candidates;      // per layer, per block: slice entries of (value, index as bits)
};

struct Flags {             // how the finite flags apply
  bool poison;             // a non-finite layer keeps its residual and sends NaN
  __device__ __forceinline__ bool adds(const Segment& s) const { return s.finite == nullptr || *s.finite; }
  // Whether the layer's residual is updated (its kept entries zeroed).
  __device__ __forceinline__ bool touches(const Segment& s) const { return !poison || adds(s); }
};

// Kernel parameters are limited to 4 KiB (before CUDA 12.1 / Volta): the table must fit.
static_assert(sizeof(Table) + sizeof(Workspace) + sizeof(Flags) <= 4000, "Table too large for kernel parameters");

// The layer that this block of a sweeping kernel works on, and the block's chunk in it.
__device__ __forceinline__ const Segment& segment_of(const Table& t, int* local) {
  const int block = t.first_block + static_cast<int>(blockIdx.x);
  int lo = 0, hi = t.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.seg[mid].block0 <= block) lo = mid;
    else hi = mid - 1;
  }
  *local = block - t.seg[lo].block0;
  return t.seg[lo];
}

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

// A call's workspace: per layer its Control and histograms (one contiguous head, zeroed by
// one memset), per block the counters and partial sums, then the candidate slices. Fills the
// layers' call-wide fields; returns the bytes needed (base == nullptr: only that).
size_t layout(char* base, const TopKLayer* layers, int count, Segment* segs, Workspace* ws) {
  size_t off = 0;
  auto take = [&](size_t bytes) { char* p = base ? base + off : nullptr; off += align_up(bytes); return p; };
  int64_t blocks = 0, candidates = 0;
  for (int i = 0; i < count; ++i) {
    const TopKLayer& l = layers[i];
    Segment& s = segs[i];
    s.grad = l.grad;
    s.g = l.residual;
    s.values = l.values;
    s.indices = l.indices;
    s.g_sq = l.g_sq;
    s.kept_sq = l.kept_sq;
    s.finite = l.finite;
    s.n = l.n;
    s.k = l.k;
    s.blocks = blocks_for(l.n);
    s.block0 = static_cast<int32_t>(blocks);
    s.index = i;
    s.chunk = chunk_for(l.n, s.blocks);
    s.slice = slice_for(l.n, l.k, s.blocks);
    s.cand0 = candidates;
    s.samples = l.n < kSample ? static_cast<int32_t>(l.n) : kSample;
    s.target = l.k > 0 ? sample_target(l.n, l.k, s.samples) : 0;
    s.target_low = l.k > 0 ? sample_target(l.n, l.k, s.samples, -1) : 0;
    blocks += s.blocks;
    candidates += static_cast<int64_t>(s.blocks) * s.slice;
  }
  Workspace w;
  w.ctl = reinterpret_cast<Control*>(take(count * sizeof(Control)));
  w.hist = reinterpret_cast<uint32_t*>(take(static_cast<size_t>(count) * 3 * kBins * sizeof(uint32_t)));
  w.counts = reinterpret_cast<uint32_t*>(take(blocks * sizeof(uint32_t)));
  w.above = reinterpret_cast<uint32_t*>(take(blocks * sizeof(uint32_t)));
  w.ties = reinterpret_cast<uint32_t*>(take(blocks * sizeof(uint32_t)));
  w.offset = reinterpret_cast<int64_t*>(take(blocks * sizeof(int64_t)));
  w.ties_kept = reinterpret_cast<int64_t*>(take(blocks * sizeof(int64_t)));
  w.g_partial = reinterpret_cast<double*>(take(blocks * sizeof(double)));
  w.kept_partial = reinterpret_cast<double*>(take(blocks * sizeof(double)));
  w.candidates = reinterpret_cast<float2*>(take(static_cast<size_t>(candidates) * sizeof(float2)));
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
// One block per layer.
template <typename G>
__global__ void __launch_bounds__(kSampleThreads) sample(const __grid_constant__ Table t, Workspace ws, Flags f) {
  __shared__ uint32_t keys[kSample];
  __shared__ uint32_t hist[kBins];
  const Segment& seg = t.seg[blockIdx.x];
  if (seg.k == 0) return;
  const G* grad = static_cast<const G*>(seg.grad);
  const bool add = f.adds(seg);
  const int64_t n = seg.n;
  const int samples = seg.samples;
  // Stratified: one entry from each of `samples` equal strata, at a hashed offset, so that
  // the sample cannot alias with a layer's row structure.
  for (int s = threadIdx.x; s < samples; s += kSampleThreads) {
    const int64_t lo = n * s / samples, hi = n * (s + 1) / samples;
    const uint32_t h = static_cast<uint32_t>(s) * 2654435761u;
    const int64_t i = lo + (hi > lo ? static_cast<int64_t>(h % static_cast<uint32_t>(hi - lo)) : 0);
    keys[s] = key_of(seg.g[i] + (add ? up(grad[i]) : 0.0f));
  }
  __syncthreads();
  const uint32_t lower = sample_bucket(keys, samples, seg.target, hist) << kShift1;
  const uint32_t upper = seg.target_low >= 1 ? (sample_bucket(keys, samples, seg.target_low, hist) + 1) << kShift1
                                             : 0xffffffffu;  // above every key (keys < 2^31)
  if (threadIdx.x == 0) {
    ws.ctl[seg.index].lower_key = lower;
    ws.ctl[seg.index].upper_key = upper;
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
__global__ void __launch_bounds__(kThreads) ef_capture(const __grid_constant__ Table t, Workspace ws, Flags f) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  int local;
  const Segment& seg = segment_of(t, &local);
  const int64_t block = seg.block0 + local;
  const G* grad = static_cast<const G*>(seg.grad);
  float* g = seg.g;
  const bool capture = seg.k > 0, vectorized = seg.vectorized, add = f.adds(seg), touch = f.touches(seg);
  Control* ctl = ws.ctl + seg.index;
  const uint32_t lower = ctl->lower_key, upper = ctl->upper_key;
  const int64_t begin = local * seg.chunk, end = begin + seg.chunk < seg.n ? begin + seg.chunk : seg.n;
  float2* mine = ws.candidates + seg.cand0 + local * seg.slice;
  const int64_t slice = seg.slice;
  int64_t recorded = 0;  // the same in every thread
  bool overflow = false;
  double sq = 0;
  for (int64_t base = begin; base < end; base += kTile) {  // uniform trip count in the block
    const int64_t i = base + threadIdx.x * kItems;
    const bool whole = vectorized && i + 3 < end;
    float v[kItems], gr[kItems];
    load4(grad, i, vectorized, end, gr);
    if (!add) {  // a non-finite gradient: g is the residual alone
#pragma unroll
      for (int j = 0; j < kItems; ++j) gr[j] = 0.0f;
    }
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
      out[j] = record && touch && key >= upper ? 0.0f : v[j];
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
    ws.g_partial[block] = block_sq;
    ws.counts[block] = static_cast<uint32_t>(recorded);
    if (overflow) atomicOr(&ctl->overflow, 1u);
  }
}

// One block per layer.
__global__ void __launch_bounds__(kMaxBlocks) decide(const __grid_constant__ Table t, Workspace ws) {
  const Segment& seg = t.seg[blockIdx.x];
  if (seg.k == 0) return;
  const int64_t c = threadIdx.x < seg.blocks ? ws.counts[seg.block0 + threadIdx.x] : 0;
  using Reduce = cub::BlockReduce<int64_t, kMaxBlocks>;
  __shared__ typename Reduce::TempStorage temp;
  const int64_t total = Reduce(temp).Sum(c);
  Control* ctl = ws.ctl + seg.index;
  if (threadIdx.x == 0) ctl->fast = !ctl->overflow && total >= seg.k;
}

// Fallback only: puts back the entries ef_capture zeroed (key >= U, all of them recorded), so
// that g is whole again for the passes that read it.
__global__ void __launch_bounds__(kThreads) restore(const __grid_constant__ Table t, Workspace ws) {
  int local;
  const Segment& seg = segment_of(t, &local);
  const Control* ctl = ws.ctl + seg.index;
  if (seg.k == 0 || ctl->fast) return;
  const uint32_t upper = ctl->upper_key;
  const float2* mine = ws.candidates + seg.cand0 + local * seg.slice;
  for (int64_t j = threadIdx.x, count = ws.counts[seg.block0 + local]; j < count; j += kThreads) {
    const float2 e = mine[j];
    if (key_of(e.x) >= upper) seg.g[__float_as_int(e.y)] = e.x;
  }
}

// The entries a block reads after `decide`: its candidate slice, or its chunk of g.
struct Source {
  const float* g;
  int64_t n, begin, chunk;
  const float2* candidates;  // this block's slice
  uint32_t count;            // ... and how many it holds

  __device__ Source(const Segment& seg, const Workspace& ws, int local)
      : g(seg.g), n(seg.n), begin(local * seg.chunk), chunk(seg.chunk),
        candidates(ws.candidates + seg.cand0 + local * seg.slice), count(ws.counts[seg.block0 + local]) {}

  __device__ __forceinline__ int64_t size(bool fast) const {
    if (fast) return count;
    return begin >= n ? 0 : (begin + chunk < n ? chunk : n - begin);
  }
  __device__ __forceinline__ float2 at(bool fast, int64_t j) const {  // (value, index bits)
    if (fast) return candidates[j];
    const int64_t i = begin + j;
    return make_float2(g[i], __int_as_float(static_cast<int>(i)));
  }
};

// --- the digits of T ---------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads) level_hist(const __grid_constant__ Table t, Workspace ws, int level) {
  __shared__ uint32_t sh[kBins];
  int local;
  const Segment& seg = segment_of(t, &local);
  if (seg.k == 0) return;
  for (int b = threadIdx.x; b < kBins; b += kThreads) sh[b] = 0;
  __syncthreads();
  const Control* ctl = ws.ctl + seg.index;
  const bool fast = ctl->fast;
  const uint32_t prefix = ctl->prefix;
  const Source src(seg, ws, local);
  const int64_t size = src.size(fast);
  for (int64_t j = threadIdx.x; j < size; j += kThreads) {
    const uint32_t key = key_of(src.at(fast, j).x);
    if (level == 0) atomicAdd(&sh[key >> kShift0], 1u);
    else if (level == 1 && (key >> kShift0) == prefix) atomicAdd(&sh[(key >> kShift1) & (kBins - 1)], 1u);
    else if (level == 2 && (key >> kShift1) == prefix) atomicAdd(&sh[key & ((1u << kShift1) - 1)], 1u);
  }
  __syncthreads();
  uint32_t* hist = ws.hist + (static_cast<int64_t>(seg.index) * 3 + level) * kBins;
  for (int b = threadIdx.x; b < kBins; b += kThreads)
    if (sh[b]) atomicAdd(&hist[b], sh[b]);
}

// One block per layer.
__global__ void __launch_bounds__(kPickThreads) pick_bucket(const __grid_constant__ Table t, Workspace ws, int level,
                                                            int bits) {
  __shared__ uint32_t bucket;
  __shared__ int64_t above, in_bucket;
  const Segment& seg = t.seg[blockIdx.x];
  if (seg.k == 0) return;
  Control* ctl = ws.ctl + seg.index;
  const int64_t want = level == 0 ? seg.k : ctl->remaining;
  const uint32_t* hist = ws.hist + (static_cast<int64_t>(seg.index) * 3 + level) * kBins;
  find_bucket(HistCount{hist}, 1 << bits, want, &bucket, &above, &in_bucket);
  __syncthreads();
  if (threadIdx.x == 0) {
    ctl->prefix = level == 0 ? bucket : (ctl->prefix << bits) | bucket;
    ctl->remaining = want - above;
  }
}

// --- ordered compaction ----------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads) count_kept(const __grid_constant__ Table t, Workspace ws) {
  int local;
  const Segment& seg = segment_of(t, &local);
  if (seg.k == 0) return;
  const Control* ctl = ws.ctl + seg.index;
  const bool fast = ctl->fast;
  const uint32_t threshold = ctl->prefix;
  const Source src(seg, ws, local);
  uint32_t a = 0, e = 0;
  for (int64_t j = threadIdx.x, size = src.size(fast); j < size; j += kThreads) {
    const uint32_t key = key_of(src.at(fast, j).x);
    a += key > threshold;
    e += key == threshold;
  }
  using Reduce = cub::BlockReduce<uint32_t, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  a = Reduce(temp).Sum(a);
  __syncthreads();
  e = Reduce(temp).Sum(e);
  if (threadIdx.x == 0) {
    ws.above[seg.block0 + local] = a;
    ws.ties[seg.block0 + local] = e;
  }
}

// One block per layer, one thread per chunk: where each chunk's kept entries go, and how many
// of its ties are kept (the first `remaining` ties in index order over all chunks).
__global__ void __launch_bounds__(kMaxBlocks) scan_blocks(const __grid_constant__ Table t, Workspace ws) {
  using Scan = cub::BlockScan<int64_t, kMaxBlocks>;
  __shared__ typename Scan::TempStorage temp;
  const Segment& seg = t.seg[blockIdx.x];
  if (seg.k == 0) return;
  const int b = threadIdx.x;
  const bool mine = b < seg.blocks;
  const int64_t e = mine ? ws.ties[seg.block0 + b] : 0;
  int64_t ties_before;
  Scan(temp).ExclusiveSum(e, ties_before);
  const int64_t want = ws.ctl[seg.index].remaining;
  const int64_t kept_ties = want - ties_before <= 0 ? 0 : (want - ties_before < e ? want - ties_before : e);
  const int64_t kept = (mine ? ws.above[seg.block0 + b] : 0) + kept_ties;
  int64_t before;
  __syncthreads();
  Scan(temp).ExclusiveSum(kept, before);
  if (mine) {
    ws.offset[seg.block0 + b] = before;
    ws.ties_kept[seg.block0 + b] = kept_ties;
  }
}

__global__ void __launch_bounds__(kThreads) write_kept(const __grid_constant__ Table t, Workspace ws, Flags f) {
  using Scan = cub::BlockScan<unsigned long long, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  int local;
  const Segment& seg = segment_of(t, &local);
  if (seg.k == 0) return;
  const Control* ctl = ws.ctl + seg.index;
  const bool fast = ctl->fast, touch = f.touches(seg);
  const uint32_t threshold = ctl->prefix, upper = ctl->upper_key;
  const int64_t block = seg.block0 + local;
  const int64_t out0 = ws.offset[block], tk = ws.ties_kept[block];
  float* g = seg.g;
  const Source src(seg, ws, local);
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
    const bool is_above = j < size && key > threshold, is_tie = j < size && key == threshold;
    const unsigned long long bits = (static_cast<unsigned long long>(is_tie) << 32) | is_above;
    unsigned long long before, total;
    Scan(temp).ExclusiveSum(bits, before, total);
    __syncthreads();
    before += done;
    const int64_t above_before = before & 0xffffffffu, tie_rank = before >> 32;
    const bool kept = is_above || (is_tie && tie_rank < tk);
    const int32_t i = __float_as_int(e.y);
    if (kept) {
      const int64_t pos = out0 + above_before + (tie_rank < tk ? tie_rank : tk);
      seg.values[pos] = touch ? e.x : __int_as_float(0x7fc00000);  // a poisoned layer sends NaN
      seg.indices[pos] = i;
      sq += static_cast<double>(e.x) * e.x;
    }
    // The fast path's g already has the entries >= U zeroed (ef_capture): zero the kept ones
    // below U, and put back the few >= U that were not kept. The fallback's g is whole. A
    // layer that keeps its residual (poisoned) was never zeroed.
    if (touch && kept && (!fast || key < upper)) g[i] = 0.0f;
    if (touch && fast && j < size && !kept && key >= upper) g[i] = e.x;
    done += total;
  }
  const double block_sq = block_sum<kThreads>(sq);
  if (threadIdx.x == 0) ws.kept_partial[block] = block_sq;
}

// One block per layer: both partial sums in a fixed order.
__global__ void __launch_bounds__(kMaxBlocks) finish_norms(const __grid_constant__ Table t, Workspace ws) {
  const Segment& seg = t.seg[blockIdx.x];
  const bool mine = threadIdx.x < seg.blocks;
  const double a = mine ? ws.g_partial[seg.block0 + threadIdx.x] : 0.0;
  const double ga = block_sum<kMaxBlocks>(a);
  __syncthreads();
  const double b = seg.k > 0 && mine ? ws.kept_partial[seg.block0 + threadIdx.x] : 0.0;
  const double kb = block_sum<kMaxBlocks>(b);
  if (threadIdx.x == 0) {
    *seg.g_sq = ga;
    *seg.kept_sq = kb;
  }
}

// One launch sequence: the layers of `t` (all of dtype G).
template <typename G>
cudaError_t run(const Table& t, int blocks, const Workspace& ws, Flags f, cudaStream_t stream) {
  const int layers = t.count;
  sample<G><<<layers, kSampleThreads, 0, stream>>>(t, ws, f);
  ef_capture<G><<<blocks, kThreads, 0, stream>>>(t, ws, f);
  decide<<<layers, kMaxBlocks, 0, stream>>>(t, ws);
  restore<<<blocks, kThreads, 0, stream>>>(t, ws);
  const int bits[3] = {11, 11, 9};
  for (int level = 0; level < 3; ++level) {
    level_hist<<<blocks, kThreads, 0, stream>>>(t, ws, level);
    pick_bucket<<<layers, kPickThreads, 0, stream>>>(t, ws, level, bits[level]);
  }
  count_kept<<<blocks, kThreads, 0, stream>>>(t, ws);
  scan_blocks<<<layers, kMaxBlocks, 0, stream>>>(t, ws);
  write_kept<<<blocks, kThreads, 0, stream>>>(t, ws, f);
  finish_norms<<<layers, kMaxBlocks, 0, stream>>>(t, ws);
  return cudaGetLastError();
}

template <typename G>
cudaError_t run_all(const TopKLayer* layers, int count, bool poison, char* workspace,
                    size_t workspace_bytes, cudaStream_t stream) {
  std::vector<Segment> segs(count);
  Workspace ws;
  if (layout(workspace, layers, count, segs.data(), &ws) > workspace_bytes) return cudaErrorInvalidValue;
  for (Segment& s : segs)
    s.vectorized = reinterpret_cast<uintptr_t>(s.g) % 16 == 0 && reinterpret_cast<uintptr_t>(s.grad) % (4 * sizeof(G)) == 0;
  // Every layer's Control and histograms start at zero: one memset over the head.
  cudaError_t err = cudaMemsetAsync(ws.ctl, 0, reinterpret_cast<char*>(ws.counts) - reinterpret_cast<char*>(ws.ctl),
                                    stream);
  if (err) return err;
  const Flags f{poison};
  for (int first = 0; first < count; first += kMaxSegments) {
    Table t;
    t.count = count - first < kMaxSegments ? count - first : kMaxSegments;
    t.first_block = segs[first].block0;
    for (int i = 0; i < t.count; ++i) t.seg[i] = segs[first + i];
    const Segment& last = t.seg[t.count - 1];
    if ((err = run<G>(t, last.block0 + last.blocks - t.first_block, ws, f, stream))) return err;
  }
  return cudaSuccess;
}

// --- undoing a call (topk_restore) ------------------------------------------------------------

constexpr int kMaxRestoreLayers = 64;  // per launch: the table stays under 4 KiB of parameters

struct RestoreTable {
  RestoreLayer layer[kMaxRestoreLayers];
  int64_t first[kMaxRestoreLayers + 1];  // each layer's first entry in this launch's numbering
  int32_t count;
};

static_assert(sizeof(RestoreTable) <= 4000, "RestoreTable too large for kernel parameters");

// One thread per kept entry of the launch's layers: residual[index] = value where the layer's
// flag is set. (Each layer's indices are distinct: no two threads write one entry.)
__global__ void __launch_bounds__(kThreads) restore_kept(const __grid_constant__ RestoreTable t) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  if (j >= t.first[t.count]) return;
  int lo = 0, hi = t.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.first[mid] <= j) lo = mid;
    else hi = mid - 1;
  }
  const RestoreLayer& l = t.layer[lo];
  if (!*l.flag) return;
  const int64_t e = j - t.first[lo];
  const int32_t i = l.indices[e];
  if (i >= 0 && i < l.n) l.residual[i] = l.values[e];
}

}  // namespace

size_t topk_ef_workspace_bytes(const TopKLayer* layers, int count) {
  std::vector<Segment> segs(count);
  return layout(nullptr, layers, count, segs.data(), nullptr);
}

cudaError_t topk_ef(const TopKLayer* layers, int count, DType grad_dtype, bool poison, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream) {
  if (count < 1) return cudaErrorInvalidValue;
  for (int i = 0; i < count; ++i)
    if (layers[i].n < 0 || layers[i].n > INT_MAX || layers[i].k < 0 || layers[i].k > layers[i].n)
      return cudaErrorInvalidValue;
  char* base = static_cast<char*>(workspace);
  switch (grad_dtype) {
    case DType::kFloat32: return run_all<float>(layers, count, poison, base, workspace_bytes, stream);
    case DType::kFloat16: return run_all<__half>(layers, count, poison, base, workspace_bytes, stream);
    case DType::kBFloat16: return run_all<__nv_bfloat16>(layers, count, poison, base, workspace_bytes, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t topk_restore(const RestoreLayer* layers, int count, cudaStream_t stream) {
  for (int first = 0; first < count; first += kMaxRestoreLayers) {
    RestoreTable t;
    t.count = count - first < kMaxRestoreLayers ? count - first : kMaxRestoreLayers;
    t.first[0] = 0;
    for (int i = 0; i < t.count; ++i) {
      t.layer[i] = layers[first + i];
      t.first[i + 1] = t.first[i] + t.layer[i].k;
    }
    const int64_t entries = t.first[t.count];
    if (entries == 0) continue;
    restore_kept<<<static_cast<unsigned>((entries + kThreads - 1) / kThreads), kThreads, 0, stream>>>(t);
    if (const cudaError_t err = cudaGetLastError()) return err;
  }
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace accordion
