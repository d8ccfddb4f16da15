// CUDA kernels of accordion::quantize_ef_ and accordion::quantize_average (see kernels.h): the
// same function as the CPU kernels (csrc/cpu/quantize.cpp), bit for bit.
//
// quantize_ef: one block per chunk (grid-stride over chunks). Each thread adds grad into e
// for its entries of the chunk and keeps their max |g|; a block reduction (NaN wins, as
// torch's amax) gives the scale s = max|g| / qmax, in float32 like the reference; then each
// thread writes q = round(g / s), half to even (rintf), clamped to +-qmax. The finite flag is
// read on the device: where false, e is not changed and the scales sent are NaN.
//
// quantize_average: a grid-stride loop over entries; each sums q * s over the ranks in rank
// order (the reference's order), then divides by the number of ranks.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/convert.cuh"
#include "cuda/kernels.h"

namespace accordion {
namespace cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float max_nan(float a, float b) {  // NaN wins, as torch's amax
  return (a != a || b != b) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
}

template <typename G, typename Q>
__global__ void quantize_ef_kernel(const G* __restrict__ grad, float* __restrict__ e, int64_t n, int64_t chunk,
                                   float qmax, const bool* finite, float* __restrict__ scales, Q* __restrict__ q) {
  __shared__ float partial[kThreads];
  const bool add = finite == nullptr || *finite;
  const int64_t chunks = (n + chunk - 1) / chunk;
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int64_t lo = c * chunk, hi = lo + chunk < n ? lo + chunk : n;
    float amax = 0.f;
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
      const float g = add ? e[i] + up(grad[i]) : e[i];
      e[i] = g;
      amax = max_nan(amax, fabsf(g));
    }
    partial[threadIdx.x] = amax;
    __syncthreads();
    for (int width = blockDim.x / 2; width > 0; width /= 2) {
      if (threadIdx.x < width) partial[threadIdx.x] = max_nan(partial[threadIdx.x], partial[threadIdx.x + width]);
      __syncthreads();
    }
    const float s = partial[0] / qmax;  // NaN stays NaN
    const float safe = s > 0.f ? s : 1.f;
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
      q[i] = static_cast<Q>(fminf(fmaxf(rintf(e[i] / safe), -qmax), qmax));
    }
    if (threadIdx.x == 0) scales[c] = add ? s : __int_as_float(0x7fc00000);
    __syncthreads();  // partial[] is reused by the next chunk
  }
}

template <typename Q>
__global__ void quantize_average_kernel(const uint8_t* __restrict__ rows, int64_t ranks, int64_t row_stride,
                                        int64_t n, int64_t chunk, float* __restrict__ out) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float total = 0.f;
    for (int64_t r = 0; r < ranks; ++r) {
      const uint8_t* row = rows + r * row_stride;
      const float s = reinterpret_cast<const float*>(row)[i / chunk];
      // _rn: no fused multiply-add (nvcc contracts a * b + c by default), as the CPU and
      // the reference round the product and then the sum
      total = __fadd_rn(total, __fmul_rn(static_cast<float>(reinterpret_cast<const Q*>(row + 4 * chunks)[i]), s));
    }
    out[i] = total / static_cast<float>(ranks);
  }
}

template <typename G, typename Q>
cudaError_t launch_ef(const void* grad, float* e, int64_t n, int64_t chunk, const bool* finite, void* payload,
                      cudaStream_t stream) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  auto* bytes = static_cast<uint8_t*>(payload);
  const float qmax = sizeof(Q) == 1 ? 127.f : 32767.f;
  quantize_ef_kernel<G, Q><<<grid_for(chunks, 1), kThreads, 0, stream>>>(
      static_cast<const G*>(grad), e, n, chunk, qmax, finite, reinterpret_cast<float*>(bytes),
      reinterpret_cast<Q*>(bytes + 4 * chunks));
  return cudaGetLastError();
}

template <typename G>
cudaError_t launch_ef_bits(const void* grad, float* e, int64_t n, int bits, int64_t chunk, const bool* finite,
                           void* payload, cudaStream_t stream) {
  return bits == 8 ? launch_ef<G, int8_t>(grad, e, n, chunk, finite, payload, stream)
                   : launch_ef<G, int16_t>(grad, e, n, chunk, finite, payload, stream);
}

}  // namespace

cudaError_t quantize_ef(const void* grad, DType grad_dtype, float* residual, int64_t n, int bits, int64_t chunk,
                        const bool* finite, void* payload, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (bits != 8 && bits != 16) return cudaErrorInvalidValue;
  switch (grad_dtype) {
    case DType::kFloat32: return launch_ef_bits<float>(grad, residual, n, bits, chunk, finite, payload, stream);
    case DType::kFloat16: return launch_ef_bits<__half>(grad, residual, n, bits, chunk, finite, payload, stream);
    case DType::kBFloat16:
      return launch_ef_bits<__nv_bfloat16>(grad, residual, n, bits, chunk, finite, payload, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t quantize_average(const void* rows, int64_t ranks, int64_t row_stride, int64_t n, int bits,
                             int64_t chunk, float* out, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const auto* data = static_cast<const uint8_t*>(rows);
  if (bits == 8) {
    quantize_average_kernel<int8_t><<<grid_for(n, kThreads), kThreads, 0, stream>>>(data, ranks, row_stride, n,
                                                                                    chunk, out);
  } else if (bits == 16) {
    quantize_average_kernel<int16_t><<<grid_for(n, kThreads), kThreads, 0, stream>>>(data, ranks, row_stride, n,
                                                                                     chunk, out);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace accordion
