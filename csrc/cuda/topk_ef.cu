// CUDA kernel sequence of accordion::topk_ef: TopK sparsification with error feedback, fused,
// exact, with no host round-trip (see kernels.h for the contract; the CPU kernel and
// accordion_hvd/reference.py::topk_select define the same function).
//
// Selection is a radix select on the 31-bit key bits(g) & 0x7fffffff (for a non-negative
// float the IEEE bits order like the value), in the spirit of AIR top-k: digits of 11, 11
// and 9 bits, one histogram per digit, every decision made on the device.
//
//   1. ef_add_histogram  (one pass over the tensor)  g = grad + residual written back into
//      the residual, sum of g^2 (per-block partials), histogram of the top 11 key bits.
//   2. pick_bucket       (one block)  the bucket holding the k-th largest key.
//   3. filter_level1     (one pass, reads g)  histogram of the next 11 bits inside that
//      bucket; the bucket's keys are also copied to a candidate list when it is small
//      (it usually is: a few % of n), so that
//   4. filter_level2     runs over the candidates only (or over g when the bucket was too
//      large for the list, e.g. a tensor of many equal values).
//   5. pick_bucket x2    give the exact threshold key T and how many entries with key == T
//      must be kept (ties).
//   6. tie_count/tie_cut (only when fewer entries with key == T are kept than exist; exit at
//      once otherwise)  the index of the last kept tie, found in index order, so that the
//      lower index wins as in the reference.
//   7. cub::DeviceSelect (one pass, reads g)  the kept indices, in ascending order: a
//      single-pass ordered compaction with decoupled look-back.
//   8. gather_zero       values = g[indices], g[indices] = 0, sum of kept^2 (partials).
//   9. finish_norms      (one block)  both partial sums in a fixed order: g_sq and kept_sq
//      are the same bits run after run (no floating-point atomics anywhere).
//
// Memory traffic: the floor is reading grad and residual and writing residual once, plus
// the 8k output bytes. This sequence adds two reads of g (filter_level1 and the selection)
// and the scattered reads and zeroing writes of the kept entries. Workspace: the
// histograms, per-block partials and CUB's scratch (O(1) in n apart from CUB's per-tile
// state) plus the candidate list, n/8 + 1024 uint32 keys.
#include <cooperative_groups.h>

#include <climits>
#include <type_traits>
#include <cub/cub.cuh>
#include <thrust/iterator/counting_iterator.h>

#include "cuda/convert.cuh"
#include "cuda/kernels.h"

namespace accordion {
namespace cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;   // fixed partial-sum count: the same rounding on any GPU
constexpr int kBins = 2048;        // 11-bit digits (the last digit uses 512 of them)
constexpr int kShift0 = 20, kShift1 = 9;
constexpr int kPickThreads = 512, kPickItems = kBins / kPickThreads;
constexpr int kTieChunks = 1024;   // tie search: per-chunk counts, then one chunk scanned
constexpr int kTieThreads = 1024;

// Decisions passed from kernel to kernel through device memory.
struct Control {
  uint32_t prefix;          // key bits resolved so far
  uint32_t use_candidates;  // level-2 input: the candidate list (1) or g (0)
  uint32_t candidate_count;
  uint32_t threshold;       // T: the k-th largest key
  int64_t remaining;        // still to take inside the current bucket
  int64_t bucket_count;     // entries in the current bucket
  int64_t tie_count;        // entries with key == T (after the last level)
  int32_t cut_index;        // entries with key == T are kept iff index <= cut_index
  int32_t num_selected;     // written by the selection (== k)
};

struct Workspace {
  Control* ctl;
  uint32_t* hist;           // 3 levels x kBins
  double* g_partial;        // kMaxBlocks
  double* kept_partial;     // kMaxBlocks
  uint32_t* tie_counts;     // kTieChunks
  uint32_t* candidates;     // capacity entries
  int64_t capacity;
  void* cub_temp;
  size_t cub_bytes;
};

__device__ __forceinline__ uint32_t key_of(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// Keep the entries above T, and those equal to T up to the cut index.
struct Keep {
  const float* g;
  const Control* ctl;
  __device__ __forceinline__ bool operator()(int i) const {
    const uint32_t key = key_of(g[i]), t = ctl->threshold;
    return key > t || (key == t && i <= ctl->cut_index);
  }
};

using Indices = thrust::counting_iterator<int>;

size_t cub_select_bytes(int64_t n) {
  size_t bytes = 0;
  cub::DeviceSelect::If(nullptr, bytes, Indices(0), static_cast<int32_t*>(nullptr),
                        static_cast<int32_t*>(nullptr), static_cast<int>(n), Keep{nullptr, nullptr});
  return bytes;
}

constexpr size_t align_up(size_t x) { return (x + 255) & ~size_t(255); }
int64_t candidate_capacity(int64_t n) { return n / 8 + 1024; }

// The workspace is carved in this order; `layout(nullptr, ...)` gives the total size.
size_t layout(char* base, int64_t n, Workspace* ws) {
  size_t off = 0;
  auto take = [&](size_t bytes) { char* p = base ? base + off : nullptr; off += align_up(bytes); return p; };
  Workspace w;
  w.ctl = reinterpret_cast<Control*>(take(sizeof(Control)));
  w.hist = reinterpret_cast<uint32_t*>(take(3 * kBins * sizeof(uint32_t)));
  w.g_partial = reinterpret_cast<double*>(take(kMaxBlocks * sizeof(double)));
  w.kept_partial = reinterpret_cast<double*>(take(kMaxBlocks * sizeof(double)));
  w.tie_counts = reinterpret_cast<uint32_t*>(take(kTieChunks * sizeof(uint32_t)));
  w.capacity = candidate_capacity(n);
  w.candidates = reinterpret_cast<uint32_t*>(take(w.capacity * sizeof(uint32_t)));
  w.cub_bytes = cub_select_bytes(n);
  w.cub_temp = take(w.cub_bytes);
  if (ws) *ws = w;
  return off;
}

// --- block-wide helpers ------------------------------------------------------------------

template <int Threads>
__device__ double block_sum(double v) {
  using Reduce = cub::BlockReduce<double, Threads>;
  __shared__ typename Reduce::TempStorage temp;
  return Reduce(temp).Sum(v);  // valid in thread 0
}

__device__ __forceinline__ void zero_shared_hist(uint32_t* sh) {
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) sh[b] = 0;
  __syncthreads();
}

__device__ __forceinline__ void flush_shared_hist(const uint32_t* sh, uint32_t* hist) {
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += blockDim.x)
    if (sh[b]) atomicAdd(&hist[b], sh[b]);
}

// --- 1. error-feedback add, squared norm and the first histogram, in one pass --------------

template <typename G> struct Vec4;  // four gradient entries, one aligned load
template <> struct Vec4<float> { using type = float4; };
template <> struct Vec4<__half> { using type = uint2; };
template <> struct Vec4<__nv_bfloat16> { using type = uint2; };

template <typename G>
__device__ __forceinline__ void unpack4(const typename Vec4<G>::type& v, float out[4]) {
  if constexpr (std::is_same_v<G, float>) {
    out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
  } else {
    const G* h = reinterpret_cast<const G*>(&v);
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = up(h[j]);
  }
}

template <typename G>
__global__ void __launch_bounds__(kThreads) ef_add_histogram(const G* __restrict__ grad, float* __restrict__ g,
                                                             int64_t n, bool vectorized, uint32_t* hist0,
                                                             double* g_partial) {
  __shared__ uint32_t sh[kBins];
  zero_shared_hist(sh);
  double sq = 0;
  auto visit = [&](float v) {
    sq += static_cast<double>(v) * v;
    atomicAdd(&sh[key_of(v) >> kShift0], 1u);
  };
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t n4 = vectorized ? n / 4 : 0;
  for (int64_t v = start; v < n4; v += stride) {
    float gr[4];
    unpack4<G>(reinterpret_cast<const typename Vec4<G>::type*>(grad)[v], gr);
    float4 r = reinterpret_cast<const float4*>(g)[v];
    r.x += gr[0]; r.y += gr[1]; r.z += gr[2]; r.w += gr[3];
    reinterpret_cast<float4*>(g)[v] = r;
    visit(r.x); visit(r.y); visit(r.z); visit(r.w);
  }
  for (int64_t i = n4 * 4 + start; i < n; i += stride) {
    const float v = g[i] + up(grad[i]);
    g[i] = v;
    visit(v);
  }
  const double total = block_sum<kThreads>(sq);
  if (threadIdx.x == 0) g_partial[blockIdx.x] = total;
  flush_shared_hist(sh, hist0);
}

// --- 2. pick the bucket holding the k-th largest key ---------------------------------------

// level 0 takes k from the argument; later levels continue from the control block. `bins`
// is 2048 or 512; the new prefix is prefix << bits | bucket.
__global__ void __launch_bounds__(kPickThreads) pick_bucket(const uint32_t* hist, int level, int bits,
                                                            int64_t k, Control* ctl, int64_t capacity) {
  using Scan = cub::BlockScan<int64_t, kPickThreads>;
  __shared__ typename Scan::TempStorage temp;
  const int bins = 1 << bits;
  const int64_t want = level == 0 ? k : ctl->remaining;
  // Thread t holds bins from the top: bins - 1 - (t * kPickItems + j).
  int64_t counts[kPickItems], incl[kPickItems];
#pragma unroll
  for (int j = 0; j < kPickItems; ++j) {
    const int r = threadIdx.x * kPickItems + j;
    counts[j] = r < bins ? hist[bins - 1 - r] : 0;
  }
  Scan(temp).InclusiveSum(counts, incl);
#pragma unroll
  for (int j = 0; j < kPickItems; ++j) {
    const int r = threadIdx.x * kPickItems + j;
    const int64_t above = incl[j] - counts[j];
    if (r < bins && counts[j] > 0 && above < want && incl[j] >= want) {
      const uint32_t bucket = bins - 1 - r;
      ctl->prefix = level == 0 ? bucket : (ctl->prefix << bits) | bucket;
      ctl->remaining = want - above;
      ctl->bucket_count = counts[j];
      if (level == 0) ctl->use_candidates = counts[j] <= capacity;
      if (level == 2) {
        ctl->threshold = ctl->prefix;
        ctl->tie_count = counts[j];
        ctl->cut_index = INT_MAX;  // every tie kept, unless tie_cut finds otherwise
      }
    }
  }
}

// --- 3, 4. histograms of the next digits inside the chosen bucket ---------------------------

__global__ void __launch_bounds__(kThreads) filter_level1(const float* __restrict__ g, int64_t n, bool vectorized,
                                                          Control* ctl, uint32_t* hist1, uint32_t* candidates,
                                                          int64_t capacity) {
  __shared__ uint32_t sh[kBins];
  zero_shared_hist(sh);
  const uint32_t prefix = ctl->prefix;
  const bool listing = ctl->use_candidates;
  auto visit = [&](float v) {
    const uint32_t key = key_of(v);
    if ((key >> kShift0) != prefix) return;
    atomicAdd(&sh[(key >> kShift1) & (kBins - 1)], 1u);
    if (listing) {  // one atomic per warp for the matching lanes
      cg::coalesced_group lanes = cg::coalesced_threads();
      uint32_t base = 0;
      if (lanes.thread_rank() == 0) base = atomicAdd(&ctl->candidate_count, lanes.size());
      base = lanes.shfl(base, 0) + lanes.thread_rank();
      if (base < capacity) candidates[base] = key;
    }
  };
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t n4 = vectorized ? n / 4 : 0;
  for (int64_t v = start; v < n4; v += stride) {
    const float4 r = reinterpret_cast<const float4*>(g)[v];
    visit(r.x); visit(r.y); visit(r.z); visit(r.w);
  }
  for (int64_t i = n4 * 4 + start; i < n; i += stride) visit(g[i]);
  flush_shared_hist(sh, hist1);
}

__global__ void __launch_bounds__(kThreads) filter_level2(const float* __restrict__ g, int64_t n,
                                                          const uint32_t* candidates, const Control* ctl,
                                                          uint32_t* hist2) {
  __shared__ uint32_t sh[kBins];
  zero_shared_hist(sh);
  const uint32_t prefix = ctl->prefix;  // top 22 bits
  auto visit = [&](uint32_t key) {
    if ((key >> kShift1) == prefix) atomicAdd(&sh[key & ((1u << kShift1) - 1)], 1u);
  };
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t start = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (ctl->use_candidates) {
    const int64_t count = ctl->candidate_count;
    for (int64_t i = start; i < count; i += stride) visit(candidates[i]);
  } else {
    for (int64_t i = start; i < n; i += stride) visit(key_of(g[i]));
  }
  flush_shared_hist(sh, hist2);
}

// --- 6. ties at the threshold: the lower indices win ------------------------------------------

__device__ __forceinline__ int64_t chunk_begin(int64_t n, int c) { return n * c / kTieChunks; }

__device__ __forceinline__ bool ties_decide_nothing(const Control* ctl) {
  return ctl->remaining == ctl->tie_count;  // every entry with key == T is kept
}

__global__ void __launch_bounds__(kThreads) tie_count(const float* __restrict__ g, int64_t n, const Control* ctl,
                                                      uint32_t* tie_counts) {
  if (ties_decide_nothing(ctl)) return;
  const uint32_t t = ctl->threshold;
  uint32_t count = 0;
  for (int64_t i = chunk_begin(n, blockIdx.x) + threadIdx.x, end = chunk_begin(n, blockIdx.x + 1); i < end;
       i += kThreads)
    count += key_of(g[i]) == t;
  using Reduce = cub::BlockReduce<uint32_t, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  count = Reduce(temp).Sum(count);
  if (threadIdx.x == 0) tie_counts[blockIdx.x] = count;
}

// One block: the chunk holding the remaining-th tie, then that chunk in index order.
__global__ void __launch_bounds__(kTieThreads) tie_cut(const float* __restrict__ g, int64_t n, Control* ctl,
                                                       const uint32_t* tie_counts) {
  if (ties_decide_nothing(ctl)) return;
  using Scan = cub::BlockScan<int64_t, kTieThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ int64_t chunk, want;
  const int64_t need = ctl->remaining;  // >= 1 and < tie_count
  static_assert(kTieChunks == kTieThreads, "one chunk count per thread");
  const int64_t c = tie_counts[threadIdx.x];
  int64_t incl;
  Scan(temp).InclusiveSum(c, incl);
  if (incl - c < need && incl >= need) {
    chunk = threadIdx.x;
    want = need - (incl - c);
  }
  __syncthreads();
  const uint32_t t = ctl->threshold;
  int64_t seen = 0;  // ties before the current tile, in this chunk
  for (int64_t base = chunk_begin(n, chunk), end = chunk_begin(n, chunk + 1); base < end; base += kTieThreads) {
    const int64_t i = base + threadIdx.x;
    const int64_t tie = i < end && key_of(g[i]) == t;
    int64_t rank, tile_total;
    __syncthreads();  // temp is reused
    Scan(temp).InclusiveSum(tie, rank, tile_total);
    if (tie && seen + rank == want) ctl->cut_index = static_cast<int32_t>(i);
    seen += tile_total;
    if (seen >= want) break;  // uniform: tile_total is the same in every thread
  }
}

// --- 8, 9. values, zeroing, kept norm, and the two norms -----------------------------------------

__global__ void __launch_bounds__(kThreads) gather_zero(float* __restrict__ g, const int32_t* __restrict__ indices,
                                                        int64_t k, float* __restrict__ values, double* kept_partial) {
  double sq = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; j < k; j += stride) {
    const int32_t i = indices[j];
    const float v = g[i];
    values[j] = v;
    g[i] = 0.0f;
    sq += static_cast<double>(v) * v;
  }
  const double total = block_sum<kThreads>(sq);
  if (threadIdx.x == 0) kept_partial[blockIdx.x] = total;
}

__global__ void __launch_bounds__(kMaxBlocks) finish_norms(const double* g_partial, int g_blocks,
                                                           const double* kept_partial, int kept_blocks,
                                                           double* g_sq, double* kept_sq) {
  const double a = threadIdx.x < g_blocks ? g_partial[threadIdx.x] : 0.0;
  const double ga = block_sum<kMaxBlocks>(a);
  __syncthreads();
  const double b = threadIdx.x < kept_blocks ? kept_partial[threadIdx.x] : 0.0;
  const double kb = block_sum<kMaxBlocks>(b);
  if (threadIdx.x == 0) {
    *g_sq = ga;
    *kept_sq = kb;
  }
}

template <typename G>
cudaError_t run(const G* grad, float* g, int64_t n, int64_t k, float* values, int32_t* indices, double* g_sq,
                double* kept_sq, const Workspace& ws, cudaStream_t stream) {
  cudaError_t err;
  auto check = [&] { return err = cudaGetLastError(); };
  // Histograms, counters and control start at zero: one memset over the head of the workspace.
  err = cudaMemsetAsync(ws.ctl, 0, reinterpret_cast<char*>(ws.g_partial) - reinterpret_cast<char*>(ws.ctl), stream);
  if (err) return err;
  const bool vec = reinterpret_cast<uintptr_t>(g) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(grad) % (4 * sizeof(G)) == 0;
  const unsigned blocks = grid_for((n + 3) / 4, kThreads, kMaxBlocks);
  uint32_t* hist0 = ws.hist;
  uint32_t* hist1 = ws.hist + kBins;
  uint32_t* hist2 = ws.hist + 2 * kBins;

  ef_add_histogram<G><<<blocks, kThreads, 0, stream>>>(grad, g, n, vec, hist0, ws.g_partial);
  if (check()) return err;
  unsigned kept_blocks = 0;
  if (k > 0) {
    pick_bucket<<<1, kPickThreads, 0, stream>>>(hist0, 0, 11, k, ws.ctl, ws.capacity);
    filter_level1<<<blocks, kThreads, 0, stream>>>(g, n, vec, ws.ctl, hist1, ws.candidates, ws.capacity);
    pick_bucket<<<1, kPickThreads, 0, stream>>>(hist1, 1, 11, k, ws.ctl, ws.capacity);
    filter_level2<<<blocks, kThreads, 0, stream>>>(g, n, ws.candidates, ws.ctl, hist2);
    pick_bucket<<<1, kPickThreads, 0, stream>>>(hist2, 2, 9, k, ws.ctl, ws.capacity);
    tie_count<<<kTieChunks, kThreads, 0, stream>>>(g, n, ws.ctl, ws.tie_counts);
    tie_cut<<<1, kTieThreads, 0, stream>>>(g, n, ws.ctl, ws.tie_counts);
    if (check()) return err;
    size_t bytes = ws.cub_bytes;
    err = cub::DeviceSelect::If(ws.cub_temp, bytes, Indices(0), indices, &ws.ctl->num_selected,
                                static_cast<int>(n), Keep{g, ws.ctl}, stream);
    if (err) return err;
    kept_blocks = grid_for(k, kThreads, kMaxBlocks);
    gather_zero<<<kept_blocks, kThreads, 0, stream>>>(g, indices, k, values, ws.kept_partial);
    if (check()) return err;
  }
  finish_norms<<<1, kMaxBlocks, 0, stream>>>(ws.g_partial, blocks, ws.kept_partial, kept_blocks, g_sq, kept_sq);
  return cudaGetLastError();
}

}  // namespace

size_t topk_ef_workspace_bytes(int64_t n, int64_t k) { return layout(nullptr, n, nullptr); }

cudaError_t topk_ef(const void* grad, DType grad_dtype, float* residual, int64_t n, int64_t k, float* values,
                    int32_t* indices, double* g_sq, double* kept_sq, void* workspace, size_t workspace_bytes,
                    cudaStream_t stream) {
  if (n < 0 || n > INT_MAX || k < 0 || k > n) return cudaErrorInvalidValue;
  Workspace ws;
  if (layout(static_cast<char*>(workspace), n, &ws) > workspace_bytes) return cudaErrorInvalidValue;
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
