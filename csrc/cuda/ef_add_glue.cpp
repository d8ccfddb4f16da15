// Torch glue for the CUDA ef_add kernel: current stream, device guard, dtype mapping.
// Built only when torch has CUDA (see CMakeLists.txt); the kernel itself is in ef_add.cu.
#include "cuda/glue.h"
#include "ops.h"

namespace accordion {

void ef_add_out_cuda(const at::Tensor& grad, const at::Tensor& residual, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(residual.device());
  C10_CUDA_CHECK(cuda::ef_add(grad.const_data_ptr(), to_kernel_dtype(grad.scalar_type()),
                              residual.const_data_ptr(), out.mutable_data_ptr(),
                              to_kernel_dtype(residual.scalar_type()), residual.numel(),
                              at::cuda::getCurrentCUDAStream()));
}

}  // namespace accordion
