// The accordion:: operators: schemas live in ops.cpp, one TORCH_LIBRARY block; CPU kernels in
// cpu/, CUDA kernels in cuda/ (pure CUDA) with their torch glue in cuda/*_glue.cpp.
// Argument checks shared by every backend live here, so CPU and CUDA reject the same
// inputs with the same messages.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace accordion {

// ef_add: the error-feedback add shared by both codecs, out = grad + residual.
// The residual may be kept in float32 for half/bfloat16 gradients, so that small
// corrections that would round away in 16 bits keep accumulating; the sum has the
// residual's dtype.
inline void check_ef_add_args(const at::Tensor& grad, const at::Tensor& residual, const char* op) {
  TORCH_CHECK(grad.layout() == at::kStrided && residual.layout() == at::kStrided,
              op, ": grad and residual must be dense (strided) tensors, got ", grad.layout(),
              " and ", residual.layout());
  TORCH_CHECK(grad.device() == residual.device(), op,
              ": grad and residual must be on the same device, got ", grad.device(), " and ",
              residual.device());
  TORCH_CHECK(grad.sizes() == residual.sizes(), op,
              ": grad and residual must have the same shape, got ", grad.sizes(), " and ",
              residual.sizes());
  const auto g = grad.scalar_type(), r = residual.scalar_type();
  TORCH_CHECK(at::isFloatingType(g), op, ": grad must be a floating-point tensor, got ", g);
  TORCH_CHECK(r == g || (r == at::kFloat && (g == at::kHalf || g == at::kBFloat16)), op,
              ": residual must have grad's dtype, or float32 for a half/bfloat16 grad; got grad ",
              g, " and residual ", r);
}

// Computes out = grad + residual elementwise over contiguous tensors; out may alias residual.
void ef_add_out_cpu(const at::Tensor& grad, const at::Tensor& residual, at::Tensor& out);

// topk_ef: see cpu/topk_ef.cpp. residual (float32, contiguous) is updated in place; values
// (float32) and indices (int32) have k entries, preallocated by the caller.
void topk_ef_cpu(const at::Tensor& grad, const at::Tensor& residual, int64_t k, at::Tensor& values,
                 at::Tensor& indices, double& g_sq, double& kept_sq);
// sparse_average: see cpu/sparse_average.cpp.
at::Tensor sparse_average_cpu(const at::Tensor& values, const at::Tensor& indices, int64_t numel,
                              int64_t world_size, at::ScalarType out_dtype);
// orthogonalize_ and error_update_: see cpu/powersgd.cpp.
void orthogonalize_cpu(const std::vector<at::Tensor>& ps, double eps);
at::Tensor error_update_cpu(const at::Tensor& residual, const at::Tensor& approx, at::ScalarType out_dtype);

#ifdef ACCORDION_WITH_CUDA
// The same five ops on CUDA (cuda/*_glue.cpp); g_sq and kept_sq are 0-d float64 device tensors.
void ef_add_out_cuda(const at::Tensor& grad, const at::Tensor& residual, at::Tensor& out);
void topk_ef_cuda(const at::Tensor& grad, const at::Tensor& residual, int64_t k, at::Tensor& values,
                  at::Tensor& indices, at::Tensor& g_sq, at::Tensor& kept_sq);
at::Tensor sparse_average_cuda(const at::Tensor& values, const at::Tensor& indices, int64_t numel,
                               int64_t world_size, at::ScalarType out_dtype);
void orthogonalize_cuda(const std::vector<at::Tensor>& ps, double eps);
at::Tensor error_update_cuda(const at::Tensor& residual, const at::Tensor& approx, at::ScalarType out_dtype);
#endif

}  // namespace accordion
