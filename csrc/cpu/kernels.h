// The CPU kernels (ATen tensors in, contiguous and checked by ops.h's checks first).
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace accordion {

// out = grad + residual elementwise; out may alias residual (cpu/ef_add.cpp).
void ef_add_out_cpu(const at::Tensor& grad, const at::Tensor& residual, at::Tensor& out);

// topk_ef (cpu/topk_ef.cpp): residual (float32) is updated in place; values (float32) and
// indices (int32) have k entries, preallocated by the caller.
void topk_ef_cpu(const at::Tensor& grad, const at::Tensor& residual, int64_t k, at::Tensor& values,
                 at::Tensor& indices, double& g_sq, double& kept_sq);

// sparse_average (cpu/sparse_average.cpp).
// With `bad` (a bool the caller owns) an index out of range is skipped and sets *bad; with
// nullptr it raises.
at::Tensor sparse_average_cpu(const at::Tensor& values, const at::Tensor& indices, int64_t numel,
                              int64_t world_size, at::ScalarType out_dtype, bool* bad = nullptr);

// orthogonalize_ and error_update_ (cpu/powersgd.cpp).
void orthogonalize_cpu(const std::vector<at::Tensor>& ps, double eps);
at::Tensor error_update_cpu(const at::Tensor& residual, const at::Tensor& approx, at::ScalarType out_dtype);

}  // namespace accordion
