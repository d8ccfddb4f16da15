// Shared by the torch glue files (built only when torch has CUDA): dtype mapping and the
// device guard + current stream every op needs.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/kernels.h"

namespace accordion {

inline cuda::DType to_kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return cuda::DType::kFloat32;
    case at::kDouble: return cuda::DType::kFloat64;
    case at::kHalf: return cuda::DType::kFloat16;
    case at::kBFloat16: return cuda::DType::kBFloat16;
    default: TORCH_CHECK(false, "accordion: unsupported dtype on CUDA: ", t);
  }
}

}  // namespace accordion
