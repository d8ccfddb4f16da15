// CUDA kernels of accordion::sparse_average, TopK's decode (see kernels.h): the gathered
// (values, indices) of all ranks scatter-added into a dense float32 sum, then divided by the
// world size and written in the gradient's dtype.
//
// Every rank decodes on its own, so the result must be the same bits on every rank or the
// replicas drift apart. Floating-point atomics add in whatever order the hardware picks, so
// the segments (one per rank) are added one launch after another, in rank order, as the CPU
// kernel and the reference do. Within a segment each index appears once (TopK sends distinct
// indices), so the atomics there never race and the result is deterministic; they only keep
// a malformed input with repeated indices from losing updates.
#include <climits>

#include "cuda/convert.cuh"
#include "cuda/kernels.h"

namespace accordion {
namespace cuda {
namespace {

constexpr int kThreads = 256;

__global__ void scatter_add_kernel(const float* __restrict__ values, const int32_t* __restrict__ indices,
                                   int64_t begin, int64_t end, float* sum, int64_t numel,
                                   unsigned long long* bad_position) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = begin + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < end; j += stride) {
    const int32_t i = indices[j];
    if (i < 0 || i >= numel) {  // never write outside the output; the caller raises
      atomicMin(bad_position, (static_cast<unsigned long long>(j) << 32) | static_cast<uint32_t>(i));
      continue;
    }
    atomicAdd(&sum[i], values[j]);
  }
}

template <typename T>
__global__ void divide_convert_kernel(const float* sum, int64_t numel, float world, T* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += stride)
    out[i] = down<T>(sum[i] / world);  // a division, as torch's div_ does: the same rounding
}

}  // namespace

cudaError_t sparse_scatter_add(const float* values, const int32_t* indices, int64_t count, int64_t segments,
                               float* sum, int64_t numel, unsigned long long* bad_position, cudaStream_t stream) {
  if (count < 0 || segments < 1 || count % segments != 0) return cudaErrorInvalidValue;
  const int64_t per = count / segments;
  if (per == 0) return cudaSuccess;
  for (int64_t s = 0; s < segments; ++s) {
    scatter_add_kernel<<<grid_for(per, kThreads), kThreads, 0, stream>>>(values, indices, s * per, (s + 1) * per,
                                                                        sum, numel, bad_position);
    if (cudaError_t err = cudaGetLastError()) return err;
  }
  return cudaSuccess;
}

cudaError_t divide_convert(const float* sum, int64_t numel, int64_t world_size, void* out, DType out_dtype,
                           cudaStream_t stream) {
  if (numel <= 0) return cudaSuccess;
  const unsigned grid = grid_for(numel, kThreads);
  const float world = static_cast<float>(world_size);
  return with_out_type(out_dtype, out, [&](auto* typed) {
    divide_convert_kernel<<<grid, kThreads, 0, stream>>>(sum, numel, world, typed);
  });
}

}  // namespace cuda
}  // namespace accordion
