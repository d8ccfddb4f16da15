// CUDA kernels of PowerSGD for a whole bucket (accordion::powersgd_*_many; the CPU versions
// are csrc/cpu/powersgd_bucket.cpp, the plain-torch reference accordion_hvd/reference.py).
//
// A bucket's layers are many and mostly small (ResNet-18: 21 matrices of 2K-2.4M entries),
// so per-layer GEMMs are launch-bound; and at rank r <= 16 the products are matrix-vector
// work, bound by memory, not by arithmetic. Each phase is therefore one segmented kernel
// over every layer of the call (up to kLayersPerLaunch; more layers, more launches): the
// layer table travels in the kernel parameters, each block works inside one layer (the
// table holds every layer's first block), and a row's r partial sums stay in registers.
//
//   p:      M = grad + e written into e, and P = M Q, in one pass over M. One warp per row of
//           M: its lanes stride along the row, accumulate the r dot products with Q^T's rows,
//           then reduce them across the warp. A layer whose `finite` flag is false leaves e
//           as it was and writes NaN to P (every rank then sees the fault in the average).
//   qt:     Q^T = P^T M, one pass over M. Each thread owns a column j and a chunk of
//           kChunkRows rows, and writes its r partial sums to a workspace; a second kernel
//           adds the chunks up in chunk order, so the result is the same run after run (no
//           atomics).
//   finish: out = P Q^T (in the gradient's dtype) and the layer's Q^T set to the averaged
//           one, elementwise; with `ok` false (read on the device) out is zero, Q^T kept.
//   settle: e -= P Q^T, elementwise, when the step's flag (device memory) is true; when it
//           is false every block returns after reading it.
#include "cuda/convert.cuh"
#include "cuda/kernels.h"

namespace accordion {
namespace cuda {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kMaxRank = 16;           // ops.h's kMaxBucketRank: r sums per thread in registers
constexpr int kChunkRows = 64;         // rows of M per thread in the qt kernel
constexpr int kElementsPerThread = 4;  // finish and settle: entries of M per thread

struct Table {
  PowerSGDLayer layers[kLayersPerLaunch];
  int64_t first_block[kLayersPerLaunch + 1];  // blocks of layers 0..i-1; the last: the grid
  int64_t workspace[kLayersPerLaunch];        // qt: where each layer's partial sums start (floats)
  int count;
};
static_assert(sizeof(Table) <= 4000, "the layer table must fit the 4 KB kernel-parameter limit");

// The layer block `b` works in (the table is short: a linear scan).
__device__ __forceinline__ int layer_of(const Table& t, int64_t b) {
  int i = 0;
  while (i + 1 < t.count && t.first_block[i + 1] <= b) ++i;
  return i;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
  return v;
}

template <typename G>
__global__ void __launch_bounds__(kThreads) p_kernel(const __grid_constant__ Table t) {
  const int which = layer_of(t, blockIdx.x);
  const PowerSGDLayer& L = t.layers[which];
  const int64_t row = (blockIdx.x - t.first_block[which]) * kWarps + threadIdx.x / 32;
  if (row >= L.n) return;  // the layer's last block may have spare warps
  const int lane = threadIdx.x % 32, r = static_cast<int>(L.r);
  const int64_t m = L.m;
  const bool add = L.finite == nullptr || *L.finite;
  float* e = L.residual + row * m;
  const G* g = static_cast<const G*>(L.grad) + row * m;
  float acc[kMaxRank] = {};
  for (int64_t j = lane; j < m; j += 32) {
    float x = e[j];
    if (add) {
      x += up(g[j]);
      e[j] = x;
    }
#pragma unroll
    for (int c = 0; c < kMaxRank; ++c)
      if (c < r) acc[c] += x * L.qt[c * m + j];
  }
#pragma unroll
  for (int c = 0; c < kMaxRank; ++c) {
    if (c >= r) break;
    const float total = warp_sum(acc[c]);
    if (lane == 0) L.p[row * r + c] = add ? total : __int_as_float(0x7fc00000);  // NaN
  }
}

__global__ void __launch_bounds__(kThreads) qt_partial_kernel(const __grid_constant__ Table t, float* workspace) {
  const int which = layer_of(t, blockIdx.x);
  const PowerSGDLayer& L = t.layers[which];
  const int64_t m = L.m, tiles = (m + kThreads - 1) / kThreads;
  const int64_t local = blockIdx.x - t.first_block[which];
  const int64_t chunk = local / tiles, j = (local % tiles) * kThreads + threadIdx.x;
  if (j >= m) return;
  const int r = static_cast<int>(L.r);
  const int64_t first = chunk * kChunkRows, last = min(L.n, first + kChunkRows);
  float acc[kMaxRank] = {};
  for (int64_t i = first; i < last; ++i) {
    const float x = L.residual[i * m + j];
#pragma unroll
    for (int c = 0; c < kMaxRank; ++c)
      if (c < r) acc[c] += L.p[i * r + c] * x;  // the same P entry for the whole warp: one load
  }
  float* partial = workspace + t.workspace[which] + chunk * r * m;
#pragma unroll
  for (int c = 0; c < kMaxRank; ++c)
    if (c < r) partial[c * m + j] = acc[c];
}

__global__ void __launch_bounds__(kThreads) qt_sum_kernel(const __grid_constant__ Table t, const float* workspace) {
  const int which = layer_of(t, blockIdx.x);
  const PowerSGDLayer& L = t.layers[which];
  const int64_t entries = L.r * L.m, chunks = (L.n + kChunkRows - 1) / kChunkRows;
  const int64_t k = (blockIdx.x - t.first_block[which]) * kThreads + threadIdx.x;
  if (k >= entries) return;
  const float* partial = workspace + t.workspace[which] + k;
  float total = 0;
  for (int64_t chunk = 0; chunk < chunks; ++chunk) total += partial[chunk * entries];
  L.qt_out[k] = total;
}

// Entry (i, j) of P Q^T, Q^T given row-major (r x m).
__device__ __forceinline__ float approx_at(const float* p, const float* qt, int r, int64_t m, int64_t i, int64_t j) {
  float a = 0;
#pragma unroll
  for (int c = 0; c < kMaxRank; ++c)
    if (c < r) a += p[i * r + c] * qt[c * m + j];
  return a;
}

template <typename O>
__global__ void __launch_bounds__(kThreads) finish_kernel(const __grid_constant__ Table t, const bool* ok_flag) {
  const int which = layer_of(t, blockIdx.x);
  const PowerSGDLayer& L = t.layers[which];
  const bool ok = ok_flag == nullptr || *ok_flag;
  const int r = static_cast<int>(L.r);
  const int64_t m = L.m, entries = L.n * m, q_entries = L.r * m;
  const int64_t base = (blockIdx.x - t.first_block[which]) * kThreads * kElementsPerThread + threadIdx.x;
  O* out = static_cast<O*>(L.out);
#pragma unroll
  for (int s = 0; s < kElementsPerThread; ++s) {
    const int64_t k = base + s * kThreads;
    if (k < entries) out[k] = ok ? down<O>(approx_at(L.p, L.qt_avg, r, m, k / m, k % m)) : down<O>(0.0f);
    if (ok && k < q_entries) L.qt[k] = L.qt_avg[k];  // r * m < n * m for a compressed layer
  }
}

__global__ void __launch_bounds__(kThreads) settle_kernel(const __grid_constant__ Table t, const bool* flag) {
  if (!*flag) return;
  const int which = layer_of(t, blockIdx.x);
  const PowerSGDLayer& L = t.layers[which];
  const int r = static_cast<int>(L.r);
  const int64_t m = L.m, entries = L.n * m;
  const int64_t base = (blockIdx.x - t.first_block[which]) * kThreads * kElementsPerThread + threadIdx.x;
#pragma unroll
  for (int s = 0; s < kElementsPerThread; ++s) {
    const int64_t k = base + s * kThreads;
    if (k < entries) L.residual[k] -= approx_at(L.p, L.qt_avg, r, m, k / m, k % m);
  }
}

// Fills a table with layers [first, first + count) and each one's blocks (blocks_of(layer)),
// then launches launch(table, grid) if there is any work.
template <typename Blocks, typename Launch>
cudaError_t for_each_table(const PowerSGDLayer* layers, int total, Blocks blocks_of, Launch launch) {
  for (int first = 0; first < total; first += kLayersPerLaunch) {
    Table t{};
    t.count = total - first < kLayersPerLaunch ? total - first : kLayersPerLaunch;
    t.first_block[0] = 0;
    for (int i = 0; i < t.count; ++i) {
      t.layers[i] = layers[first + i];
      t.first_block[i + 1] = t.first_block[i] + blocks_of(layers[first + i]);
    }
    if (t.first_block[t.count] == 0) continue;
    launch(t, static_cast<unsigned>(t.first_block[t.count]));
    if (cudaError_t err = cudaGetLastError()) return err;
  }
  return cudaSuccess;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t elementwise_blocks(const PowerSGDLayer& L) {
  const int64_t items = L.n * L.m > L.r * L.m ? L.n * L.m : L.r * L.m;
  return ceil_div(items, static_cast<int64_t>(kThreads) * kElementsPerThread);
}

}  // namespace

size_t powersgd_qt_workspace_bytes(const PowerSGDLayer* layers, int count) {
  size_t floats = 0;
  for (int i = 0; i < count; ++i) floats += ceil_div(layers[i].n, kChunkRows) * layers[i].r * layers[i].m;
  return floats * sizeof(float);
}

cudaError_t powersgd_p(const PowerSGDLayer* layers, int count, DType grad_dtype, cudaStream_t stream) {
  const auto blocks = [](const PowerSGDLayer& L) { return ceil_div(L.n, kWarps); };
  return for_each_table(layers, count, blocks, [&](const Table& t, unsigned grid) {
    switch (grad_dtype) {
      case DType::kFloat32: p_kernel<float><<<grid, kThreads, 0, stream>>>(t); break;
      case DType::kFloat16: p_kernel<__half><<<grid, kThreads, 0, stream>>>(t); break;
      case DType::kBFloat16: p_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(t); break;
      default: break;  // rejected by the checks (ops.h)
    }
  });
}

cudaError_t powersgd_qt(const PowerSGDLayer* layers, int count, float* workspace, cudaStream_t stream) {
  // Each launch of up to kLayersPerLaunch layers uses the workspace from its first layer on.
  for (int first = 0; first < count; first += kLayersPerLaunch) {
    const int here = count - first < kLayersPerLaunch ? count - first : kLayersPerLaunch;
    float* base = workspace + powersgd_qt_workspace_bytes(layers, first) / sizeof(float);
    const auto partial_blocks = [](const PowerSGDLayer& L) {
      return ceil_div(L.m, kThreads) * ceil_div(L.n, kChunkRows);
    };
    // `here` layers make one table; a failed launch's error stays for for_each_table to return.
    cudaError_t err = for_each_table(layers + first, here, partial_blocks, [&](Table& t, unsigned grid) {
      int64_t offset = 0;
      for (int i = 0; i < t.count; ++i) {
        t.workspace[i] = offset;
        offset += ceil_div(t.layers[i].n, kChunkRows) * t.layers[i].r * t.layers[i].m;
      }
      qt_partial_kernel<<<grid, kThreads, 0, stream>>>(t, base);
      Table sums = t;  // the same layers and workspace offsets, one thread per entry of Q^T
      sums.first_block[0] = 0;
      for (int i = 0; i < sums.count; ++i)
        sums.first_block[i + 1] = sums.first_block[i] + ceil_div(sums.layers[i].r * sums.layers[i].m, kThreads);
      qt_sum_kernel<<<static_cast<unsigned>(sums.first_block[sums.count]), kThreads, 0, stream>>>(sums, base);
    });
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t powersgd_finish(const PowerSGDLayer* layers, int count, DType out_dtype, const bool* ok,
                            cudaStream_t stream) {
  return for_each_table(layers, count, elementwise_blocks, [&](const Table& t, unsigned grid) {
    switch (out_dtype) {
      case DType::kFloat32: finish_kernel<float><<<grid, kThreads, 0, stream>>>(t, ok); break;
      case DType::kFloat16: finish_kernel<__half><<<grid, kThreads, 0, stream>>>(t, ok); break;
      case DType::kBFloat16: finish_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(t, ok); break;
      default: break;  // rejected by the checks (ops.h)
    }
  });
}

cudaError_t powersgd_settle(const PowerSGDLayer* layers, int count, const bool* flag, cudaStream_t stream) {
  return for_each_table(layers, count, elementwise_blocks, [&](const Table& t, unsigned grid) {
    settle_kernel<<<grid, kThreads, 0, stream>>>(t, flag);
  });
}

}  // namespace cuda
}  // namespace accordion
