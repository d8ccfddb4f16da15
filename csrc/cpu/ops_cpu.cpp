// The accordion:: operators on CPU tensors: the shared checks (ops.h), then the CPU kernels.
#include <torch/library.h>

#include "cpu/kernels.h"
#include "ops.h"

namespace accordion {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> topk_ef(const at::Tensor& grad,
                                                                   const at::Tensor& residual, int64_t k) {
  auto [values, indices] = topk_ef_outputs(grad, residual, k);
  double g_sq = 0, kept_sq = 0;
  topk_ef_cpu(grad.contiguous(), residual, k, values, indices, g_sq, kept_sq);
  const auto scalar = residual.options().dtype(at::kDouble);
  return {values, indices, at::scalar_tensor(g_sq, scalar), at::scalar_tensor(kept_sq, scalar)};
}

at::Tensor sparse_average(const at::Tensor& values, const at::Tensor& indices, int64_t numel, int64_t world_size,
                          at::ScalarType dtype) {
  check_sparse_average_args(values, indices, numel, world_size, dtype);
  return sparse_average_cpu(values, indices, numel, world_size, dtype);
}

void orthogonalize_(at::TensorList ps, double eps) {
  orthogonalize_cpu(orthogonalize_matrices(ps, eps), eps);
}

at::Tensor error_update_(const at::Tensor& residual, const at::Tensor& approx, at::ScalarType dtype) {
  check_error_update_args(residual, approx, dtype);
  return error_update_cpu(residual, approx, dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(accordion, CPU, m) {
  m.impl("ef_add", &ef_add<ef_add_out_cpu>);
  m.impl("ef_add_", &ef_add_<ef_add_out_cpu>);
  m.impl("topk_ef", &topk_ef);
  m.impl("sparse_average", &sparse_average);
  m.impl("orthogonalize_", &orthogonalize_);
  m.impl("error_update_", &error_update_);
}

}  // namespace accordion
