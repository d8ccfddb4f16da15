// Device-side conversions between the storage dtypes and the type arithmetic is done in
// (float, or double for float64), shared by the kernels in this directory. Rounding to 16
// bits is round-to-nearest-even, as torch's .to() does, so CPU, CUDA and the plain-torch
// reference agree bit for bit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/kernels.h"

namespace accordion {
namespace cuda {

template <typename T> struct Math { using type = float; };
template <> struct Math<double> { using type = double; };

template <typename T> __device__ __forceinline__ typename Math<T>::type up(T x) { return static_cast<typename Math<T>::type>(x); }
template <> __device__ __forceinline__ float up(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float up(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T down(typename Math<T>::type x) { return static_cast<T>(x); }
template <> __device__ __forceinline__ __half down<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 down<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Grid size for a grid-stride loop over n items: enough blocks to fill any current GPU
// several times over, never more than `cap`.
inline unsigned grid_for(int64_t n, int threads, int64_t cap = 65536) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks < cap ? blocks : cap));
}

// Calls launch(out) with `out` as a pointer to the storage type of `dtype` (float32, float16
// or bfloat16), then returns the launch's error.
template <typename Launch>
cudaError_t with_out_type(DType dtype, void* out, Launch launch) {
  switch (dtype) {
    case DType::kFloat32: launch(static_cast<float*>(out)); break;
    case DType::kFloat16: launch(static_cast<__half*>(out)); break;
    case DType::kBFloat16: launch(static_cast<__nv_bfloat16*>(out)); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace accordion
