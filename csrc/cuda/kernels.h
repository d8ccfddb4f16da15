// Launchers of the pure-CUDA kernels in this directory.
//
// This header and the .cu files use only the CUDA runtime (and CUB): no ATen, no c10/cuda.
// That keeps them compilable with nvcc on machines whose torch is a CPU build (CI compiles
// every .cu for sm_80 and sm_90 with `make cuda-check`). The torch glue that picks the
// current stream and maps dtypes lives in *_glue.cpp, built only when torch has CUDA.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace accordion {
namespace cuda {

enum class DType : int { kFloat32, kFloat16, kBFloat16, kFloat64 };

// out[i] = grad[i] + residual[i] for i < n, computed in float (double for float64).
// residual and out have dtype `residual_dtype`; grad has `grad_dtype`, equal to it or a
// 16-bit type with a float32 residual. out may alias residual. Asynchronous on `stream`.
cudaError_t ef_add(const void* grad, DType grad_dtype, const void* residual, void* out,
                   DType residual_dtype, int64_t n, cudaStream_t stream);

}  // namespace cuda
}  // namespace accordion
