// Torch glue for the CUDA ef_add kernel: current stream, device guard, dtype mapping.
// Built only when torch has CUDA (see CMakeLists.txt); the kernel itself is in ef_add.cu.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/kernels.h"
#include "ops.h"

namespace accordion {
namespace {

cuda::DType to_kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return cuda::DType::kFloat32;
    case at::kDouble: return cuda::DType::kFloat64;
    case at::kHalf: return cuda::DType::kFloat16;
    case at::kBFloat16: return cuda::DType::kBFloat16;
    default: TORCH_CHECK(false, "accordion: unsupported dtype on CUDA: ", t);
  }
}

}  // namespace

void ef_add_out_cuda(const at::Tensor& grad, const at::Tensor& residual, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(residual.device());
  C10_CUDA_CHECK(cuda::ef_add(grad.const_data_ptr(), to_kernel_dtype(grad.scalar_type()),
                              residual.const_data_ptr(), out.mutable_data_ptr(),
                              to_kernel_dtype(residual.scalar_type()), residual.numel(),
                              at::cuda::getCurrentCUDAStream()));
}

}  // namespace accordion
