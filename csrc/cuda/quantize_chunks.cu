// CUDA kernels of Quantize's sparse chunks (see kernels.h): the function of the CPU kernels
// (csrc/cpu/quantize_chunks.cpp), bit for bit, with nothing read on the host: k (the chunks
// this step sends) is an argument the host already has, k_next stays in the payload.
//
// quantize_chunks_ef, five launches:
//   1. measure: one block per chunk (grid-stride). e += grad, and the chunk's squares (float64)
//      into shared memory, zero-padded to P = pow2 >= chunk; the halves tree of
//      quantize_chunks_layout.h / quantize_chunks.h, x[i] += x[i + h], whatever the block size.
//   2. CUB radix sort of (energy, chunk) pairs, descending: stable, so ties keep the lower
//      chunk first, as std::stable_sort and torch.sort(stable=True).
//   3. local sums: one thread per block of kSumBlock sorted energies, left to right.
//   4. count: one block; thread 0 adds the blocks' offsets left to right, then every thread
//      counts the running sums (offset + local) below (1 - skip) * total; k_next to the header.
//   5. CUB radix sort of the first k chunk numbers, ascending, into the payload's indices;
//      then one block per chosen chunk quantizes it as quantize.cu does.
// Every float64 and float32 operation is written _rn: nvcc would otherwise contract a product
// and a sum into one fused multiply-add, which rounds once where the CPU rounds twice.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/block/block_reduce.cuh>
#include <cub/device/device_radix_sort.cuh>

#include "cuda/convert.cuh"
#include "cuda/kernels.h"
#include "quantize_chunks_layout.h"

namespace accordion {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kCountThreads = 1024;

__device__ __forceinline__ float max_nan(float a, float b) {  // NaN wins, as torch's amax
  return (a != a || b != b) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
}

template <typename G>
__global__ void measure_kernel(const G* __restrict__ grad, float* __restrict__ e, int64_t n, int64_t chunk, int64_t p,
                               const bool* finite, double* __restrict__ energy, int32_t* __restrict__ order) {
  extern __shared__ double squares[];
  const bool add = finite == nullptr || *finite;
  const int64_t chunks = (n + chunk - 1) / chunk;
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int64_t lo = c * chunk, len = (lo + chunk < n ? lo + chunk : n) - lo;
    for (int64_t i = threadIdx.x; i < p; i += blockDim.x) {
      double x = 0.0;
      if (i < len) {
        const float g = add ? __fadd_rn(e[lo + i], up(grad[lo + i])) : e[lo + i];
        e[lo + i] = g;
        x = __dmul_rn(static_cast<double>(g), static_cast<double>(g));
      }
      squares[i] = x;
    }
    __syncthreads();
    for (int64_t h = p / 2; h >= 1; h /= 2) {
      for (int64_t i = threadIdx.x; i < h; i += blockDim.x) squares[i] = __dadd_rn(squares[i], squares[i + h]);
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      energy[c] = squares[0];
      order[c] = static_cast<int32_t>(c);
    }
    __syncthreads();  // squares[] is reused by the next chunk
  }
}

__global__ void local_sums_kernel(const double* __restrict__ sorted, int64_t chunks, double* __restrict__ local) {
  const int64_t blocks = (chunks + kSumBlock - 1) / kSumBlock;
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < blocks;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    double sum = 0.0;
    for (int64_t j = b * kSumBlock, end = j + kSumBlock < chunks ? j + kSumBlock : chunks; j < end; ++j) {
      sum = __dadd_rn(sum, sorted[j]);
      local[j] = sum;
    }
  }
}

__global__ void count_kernel(const double* __restrict__ local, int64_t chunks, double keep, double* offsets,
                             int32_t* k_next) {
  using Reduce = cub::BlockReduce<long long, kCountThreads>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ double bound;
  const int64_t blocks = (chunks + kSumBlock - 1) / kSumBlock;
  if (threadIdx.x == 0) {
    double offset = 0.0;
    for (int64_t b = 0; b < blocks; ++b) {
      offsets[b] = offset;
      const int64_t last = (b + 1) * kSumBlock < chunks ? (b + 1) * kSumBlock - 1 : chunks - 1;
      offset = __dadd_rn(offset, local[last]);
    }
    bound = __dmul_rn(keep, __dadd_rn(offsets[blocks - 1], local[chunks - 1]));
  }
  __syncthreads();  // offsets (global memory) and bound visible to the block
  long long below = 0;
  for (int64_t j = threadIdx.x; j < chunks; j += blockDim.x) below += __dadd_rn(offsets[j / kSumBlock], local[j]) < bound;
  below = Reduce(temp).Sum(below);
  if (threadIdx.x == 0) *k_next = static_cast<int32_t>(below + 1 < chunks ? below + 1 : chunks);
}

template <typename Q>
__global__ void quantize_chosen_kernel(const float* __restrict__ e, int64_t n, int64_t chunk, int64_t k,
                                       const int32_t* __restrict__ indices, float qmax, const bool* finite,
                                       float* __restrict__ scales, Q* __restrict__ q) {
  __shared__ float partial[kThreads];
  const bool add = finite == nullptr || *finite;
  for (int64_t i = blockIdx.x; i < k; i += gridDim.x) {
    const int64_t lo = static_cast<int64_t>(indices[i]) * chunk, len = (lo + chunk < n ? lo + chunk : n) - lo;
    float amax = 0.f;
    for (int64_t j = threadIdx.x; j < len; j += blockDim.x) amax = max_nan(amax, fabsf(e[lo + j]));
    partial[threadIdx.x] = amax;
    __syncthreads();
    for (int width = blockDim.x / 2; width > 0; width /= 2) {
      if (threadIdx.x < width) partial[threadIdx.x] = max_nan(partial[threadIdx.x], partial[threadIdx.x + width]);
      __syncthreads();
    }
    const float s = __fdiv_rn(partial[0], qmax);
    const float safe = s > 0.f ? s : 1.f;
    for (int64_t j = threadIdx.x; j < len; j += blockDim.x) {  // the padding after len: zeroed by the caller
      q[i * chunk + j] = static_cast<Q>(fminf(fmaxf(rintf(__fdiv_rn(e[lo + j], safe)), -qmax), qmax));
    }
    if (threadIdx.x == 0) scales[i] = add ? s : __int_as_float(0x7fc00000);
    __syncthreads();  // partial[] is reused by the next chunk
  }
}

struct Workspace {  // carved from the caller's bytes, each part 256-byte aligned
  double *energy, *sorted, *local, *offsets;
  int32_t *order, *sorted_order;
  void* cub;
  size_t cub_bytes, total;
};

size_t align(size_t bytes) { return (bytes + 255) / 256 * 256; }

Workspace carve(void* base, int64_t chunks, int64_t k) {
  Workspace w{};
  size_t pairs = 0, keys = 0;
  cub::DeviceRadixSort::SortPairsDescending(nullptr, pairs, w.energy, w.sorted, w.order, w.sorted_order,
                                            static_cast<int>(chunks));
  cub::DeviceRadixSort::SortKeys(nullptr, keys, w.order, w.order, static_cast<int>(k));
  w.cub_bytes = pairs > keys ? pairs : keys;
  const int64_t blocks = (chunks + kSumBlock - 1) / kSumBlock;
  auto* at = static_cast<uint8_t*>(base);
  size_t used = 0;
  auto take = [&](size_t bytes) {
    void* p = at == nullptr ? nullptr : at + used;
    used += align(bytes);
    return p;
  };
  w.energy = static_cast<double*>(take(8 * chunks));
  w.sorted = static_cast<double*>(take(8 * chunks));
  w.local = static_cast<double*>(take(8 * chunks));
  w.offsets = static_cast<double*>(take(8 * blocks));
  w.order = static_cast<int32_t*>(take(4 * chunks));
  w.sorted_order = static_cast<int32_t*>(take(4 * chunks));
  w.cub = take(w.cub_bytes);
  w.total = used;
  return w;
}

template <typename G, typename Q>
cudaError_t launch_ef(const G* grad, float* e, int64_t n, int64_t chunk, int64_t k, double skip, const bool* finite,
                      uint8_t* payload, const Workspace& w, cudaStream_t stream) {
  const int64_t chunks = (n + chunk - 1) / chunk, p = pow2_at_least(chunk);
  measure_kernel<G><<<grid_for(chunks, 1), kThreads, p * sizeof(double), stream>>>(grad, e, n, chunk, p, finite,
                                                                                 w.energy, w.order);
  size_t bytes = w.cub_bytes;
  cudaError_t err = cub::DeviceRadixSort::SortPairsDescending(w.cub, bytes, w.energy, w.sorted, w.order,
                                                              w.sorted_order, static_cast<int>(chunks), 0, 64, stream);
  if (err != cudaSuccess) return err;
  const int64_t blocks = (chunks + kSumBlock - 1) / kSumBlock;
  local_sums_kernel<<<grid_for(blocks, 128), 128, 0, stream>>>(w.sorted, chunks, w.local);
  count_kernel<<<1, kCountThreads, 0, stream>>>(w.local, chunks, 1.0 - skip, w.offsets,
                                                reinterpret_cast<int32_t*>(payload));
  auto* indices = reinterpret_cast<int32_t*>(payload + 4);
  bytes = w.cub_bytes;
  err = cub::DeviceRadixSort::SortKeys(w.cub, bytes, w.sorted_order, indices, static_cast<int>(k), 0, 32, stream);
  if (err != cudaSuccess) return err;
  const float qmax = sizeof(Q) == 1 ? 127.f : 32767.f;
  quantize_chosen_kernel<Q><<<grid_for(k, 1), kThreads, 0, stream>>>(
      e, n, chunk, k, indices, qmax, finite, reinterpret_cast<float*>(payload + 4 + 4 * k),
      reinterpret_cast<Q*>(payload + 4 + 8 * k));
  return cudaGetLastError();
}

template <typename G>
cudaError_t launch_ef_bits(const void* grad, float* e, int64_t n, int bits, int64_t chunk, int64_t k, double skip,
                           const bool* finite, uint8_t* payload, const Workspace& w, cudaStream_t stream) {
  const auto* g = static_cast<const G*>(grad);
  return bits == 8 ? launch_ef<G, int8_t>(g, e, n, chunk, k, skip, finite, payload, w, stream)
                   : launch_ef<G, int16_t>(g, e, n, chunk, k, skip, finite, payload, w, stream);
}

template <typename Q>
__global__ void scatter_rank_kernel(const uint8_t* __restrict__ row, int64_t k, int64_t chunk, int64_t n,
                                    float* __restrict__ out) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  const auto* indices = reinterpret_cast<const int32_t*>(row + 4);
  const auto* scales = reinterpret_cast<const float*>(row + 4 + 4 * k);
  const auto* q = reinterpret_cast<const Q*>(row + 4 + 8 * k);
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < k * chunk;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = t / chunk, c = indices[i], at = c * chunk + t % chunk;
    if (c < 0 || c >= chunks || at >= n) continue;  // not this layer's chunk: never written outside it
    out[at] = __fadd_rn(out[at], __fmul_rn(static_cast<float>(q[t]), scales[i]));
  }
}

__global__ void divide_kernel(float* out, int64_t n, float ranks) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = __fdiv_rn(out[i], ranks);
  }
}

__global__ void agree_kernel(const uint8_t* rows, int64_t ranks, int64_t row_stride, int64_t chunks,
                             int64_t* k_next) {
  int64_t most = 1;
  for (int64_t r = 0; r < ranks; ++r) {
    const int64_t need = *reinterpret_cast<const int32_t*>(rows + r * row_stride);
    most = need > most ? need : most;
  }
  *k_next = most < chunks ? most : chunks;
}

template <typename Q>
__global__ void settle_kernel(float* __restrict__ e, int64_t n, int64_t chunk, int64_t k,
                              const int32_t* __restrict__ indices, const Q* __restrict__ q,
                              const float* __restrict__ scales, const bool* done) {
  if (!*done) return;
  const int64_t chunks = (n + chunk - 1) / chunk;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < k * chunk;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = t / chunk, c = indices[i], at = c * chunk + t % chunk;
    if (c < 0 || c >= chunks || at >= n) continue;
    e[at] = __fsub_rn(e[at], __fmul_rn(static_cast<float>(q[t]), scales[i]));
  }
}

}  // namespace

size_t quantize_chunks_workspace_bytes(int64_t n, int64_t chunk, int64_t k) {
  return carve(nullptr, (n + chunk - 1) / chunk, k).total;
}

cudaError_t quantize_chunks_ef(const void* grad, DType grad_dtype, float* residual, int64_t n, int bits, int64_t chunk,
                               int64_t k, double skip, const bool* finite, void* payload, void* workspace,
                               cudaStream_t stream) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  if (n <= 0 || k < 1 || k > chunks || chunk > kMaxSparseChunk || (bits != 8 && bits != 16)) {
    return cudaErrorInvalidValue;
  }
  const Workspace w = carve(workspace, chunks, k);
  auto* bytes = static_cast<uint8_t*>(payload);
  switch (grad_dtype) {
    case DType::kFloat32:
      return launch_ef_bits<float>(grad, residual, n, bits, chunk, k, skip, finite, bytes, w, stream);
    case DType::kFloat16:
      return launch_ef_bits<__half>(grad, residual, n, bits, chunk, k, skip, finite, bytes, w, stream);
    case DType::kBFloat16:
      return launch_ef_bits<__nv_bfloat16>(grad, residual, n, bits, chunk, k, skip, finite, bytes, w, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t quantize_chunks_average(const void* rows, int64_t ranks, int64_t row_stride, int64_t n, int bits,
                                    int64_t chunk, int64_t k, float* out, int64_t* k_next, cudaStream_t stream) {
  if (n <= 0 || (bits != 8 && bits != 16)) return cudaErrorInvalidValue;
  const auto* data = static_cast<const uint8_t*>(rows);
  cudaError_t err = cudaMemsetAsync(out, 0, n * sizeof(float), stream);
  if (err != cudaSuccess) return err;
  for (int64_t r = 0; r < ranks; ++r) {  // one launch per rank: each entry summed in rank order
    if (bits == 8) {
      scatter_rank_kernel<int8_t><<<grid_for(k * chunk, kThreads), kThreads, 0, stream>>>(data + r * row_stride, k,
                                                                                         chunk, n, out);
    } else {
      scatter_rank_kernel<int16_t><<<grid_for(k * chunk, kThreads), kThreads, 0, stream>>>(data + r * row_stride,
                                                                                          k, chunk, n, out);
    }
  }
  divide_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(out, n, static_cast<float>(ranks));
  agree_kernel<<<1, 1, 0, stream>>>(data, ranks, row_stride, (n + chunk - 1) / chunk, k_next);
  return cudaGetLastError();
}

cudaError_t quantize_chunks_settle(float* residual, int64_t n, int64_t chunk, int64_t k, const int32_t* indices,
                                   const void* q, int bits, const float* scales, const bool* done,
                                   cudaStream_t stream) {
  if (k <= 0) return cudaSuccess;
  if (bits == 8) {
    settle_kernel<int8_t><<<grid_for(k * chunk, kThreads), kThreads, 0, stream>>>(
        residual, n, chunk, k, indices, static_cast<const int8_t*>(q), scales, done);
  } else if (bits == 16) {
    settle_kernel<int16_t><<<grid_for(k * chunk, kThreads), kThreads, 0, stream>>>(
        residual, n, chunk, k, indices, static_cast<const int16_t*>(q), scales, done);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace accordion
