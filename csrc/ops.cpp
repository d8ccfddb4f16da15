// Schemas of every accordion:: operator, and the wrappers that check arguments once and hand
// contiguous tensors to the CPU or CUDA kernel. The fake (meta) implementations that
// torch.compile and opcheck need are registered from Python (accordion_hvd/ops.py).
#include <torch/library.h>

#include <limits>
#include <tuple>

#include "ops.h"

namespace accordion {
namespace {

void ef_add_out(const at::Tensor& grad, const at::Tensor& residual, at::Tensor& out) {
  const at::Tensor g = grad.contiguous();  // e.g. a channels-last gradient
  if (residual.is_cuda()) {
#ifdef ACCORDION_WITH_CUDA
    ef_add_out_cuda(g, residual, out);
    return;
#else
    TORCH_CHECK(false, "accordion::ef_add: this build has no CUDA kernels (rebuild with ACCORDION_CUDA=ON)");
#endif
  }
  ef_add_out_cpu(g, residual, out);
}

// Functional form: returns grad + residual, in the residual's dtype.
at::Tensor ef_add(const at::Tensor& grad, const at::Tensor& residual) {
  check_ef_add_args(grad, residual, "accordion::ef_add");
  at::Tensor out = at::empty(residual.sizes(), residual.options().memory_format(at::MemoryFormat::Contiguous));
  ef_add_out(grad, residual.contiguous(), out);
  return out;
}

// In-place form used by the codecs: residual += grad, turning the error-feedback buffer into
// the tensor to compress without allocating another gradient-sized buffer.
void ef_add_(const at::Tensor& grad, const at::Tensor& residual) {
  check_ef_add_args(grad, residual, "accordion::ef_add_");
  TORCH_CHECK(residual.is_contiguous(), "accordion::ef_add_: residual must be contiguous, got strides ",
              residual.strides());
  at::Tensor out = residual;
  ef_add_out(grad, residual, out);
}

// CPU, or CUDA in a build with the CUDA kernels; anything else gets this message rather than
// the dispatcher's "could not run ... with arguments from the 'X' backend".
void check_device(const at::Tensor& t, const char* op, const char* name) {
#ifdef ACCORDION_WITH_CUDA
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), op, ": ", name, " is on ", t.device(),
              "; this op has CPU and CUDA kernels");
#else
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " is on ", t.device(),
              "; this build has only CPU kernels (rebuild with ACCORDION_CUDA=ON for CUDA)");
#endif
}

void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* op, const char* names) {
  TORCH_CHECK(a.device() == b.device(), op, ": ", names, " must be on the same device, got ", a.device(), " and ",
              b.device());
}

void check_contiguous_float(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.layout() == at::kStrided, op, ": ", name, " must be a dense (strided) tensor, got ", t.layout());
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got strides ", t.strides());
  check_device(t, op, name);
}

// Fused TopK with error feedback; residual <- (grad + residual) with the kept entries zeroed.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> topk_ef(const at::Tensor& grad,
                                                                   const at::Tensor& residual, int64_t k) {
  constexpr const char* op = "accordion::topk_ef";
  check_ef_add_args(grad, residual, op);
  check_contiguous_float(residual, op, "residual");
  const int64_t n = residual.numel();
  TORCH_CHECK(n <= std::numeric_limits<int32_t>::max(), op, ": at most 2^31 - 1 entries (int32 indices), got ", n);
  TORCH_CHECK(k >= 0 && k <= n, op, ": k must be in [0, numel = ", n, "], got ", k);
  at::Tensor values = at::empty({k}, residual.options());
  at::Tensor indices = at::empty({k}, residual.options().dtype(at::kInt));
  const auto scalar = residual.options().dtype(at::kDouble);
#ifdef ACCORDION_WITH_CUDA
  if (residual.is_cuda()) {  // the norms stay on the device: no synchronization
    at::Tensor g_sq = at::empty({}, scalar), kept_sq = at::empty({}, scalar);
    topk_ef_cuda(grad.contiguous(), residual, k, values, indices, g_sq, kept_sq);
    return {values, indices, g_sq, kept_sq};
  }
#endif
  double g_sq = 0, kept_sq = 0;
  topk_ef_cpu(grad.contiguous(), residual, k, values, indices, g_sq, kept_sq);
  return {values, indices, at::scalar_tensor(g_sq, scalar), at::scalar_tensor(kept_sq, scalar)};
}

// TopK's decode: the average over ranks of their sparse vectors, densely, in `dtype`.
at::Tensor sparse_average(const at::Tensor& values, const at::Tensor& indices, int64_t numel,
                          int64_t world_size, at::ScalarType dtype) {
  constexpr const char* op = "accordion::sparse_average";
  check_contiguous_float(values, op, "values");
  TORCH_CHECK(indices.layout() == at::kStrided && indices.scalar_type() == at::kInt && indices.is_contiguous(),
              op, ": indices must be a contiguous int32 tensor, got ", indices.scalar_type());
  check_device(indices, op, "indices");
  check_same_device(values, indices, op, "values and indices");
  TORCH_CHECK(values.dim() == 1 && indices.dim() == 1 && values.numel() == indices.numel(), op,
              ": values and indices must be 1-d of the same length, got ", values.sizes(), " and ", indices.sizes());
  TORCH_CHECK(numel >= 0 && numel <= std::numeric_limits<int32_t>::max(), op,
              ": numel must be in [0, 2^31 - 1], got ", numel);
  TORCH_CHECK(world_size >= 1, op, ": world_size must be >= 1, got ", world_size);
  TORCH_CHECK(at::isFloatingType(dtype), op, ": dtype must be a floating-point type, got ", dtype);
#ifdef ACCORDION_WITH_CUDA
  if (values.is_cuda()) return sparse_average_cuda(values, indices, numel, world_size, dtype);
#endif
  return sparse_average_cpu(values, indices, numel, world_size, dtype);
}

// Gram-Schmidt on the columns of every matrix in `ps`, in place, in one call.
void orthogonalize_(at::TensorList ps, double eps) {
  constexpr const char* op = "accordion::orthogonalize_";
  TORCH_CHECK(eps >= 0, op, ": eps must be >= 0, got ", eps);
  std::vector<at::Tensor> mats;
  mats.reserve(ps.size());
  for (size_t i = 0; i < ps.size(); ++i) {
    const at::Tensor& p = ps[i];
    TORCH_CHECK(p.layout() == at::kStrided && p.dim() == 2, op, ": ps[", i, "] must be a dense 2-d tensor, got ",
                p.dim(), "-d ", p.layout());
    TORCH_CHECK(p.scalar_type() == at::kFloat || p.scalar_type() == at::kDouble, op, ": ps[", i,
                "] must be float32 or float64, got ", p.scalar_type());
    TORCH_CHECK(p.is_contiguous(), op, ": ps[", i, "] must be contiguous, got strides ", p.strides());
    check_device(p, op, "ps");
    TORCH_CHECK(p.device() == ps[0].device(), op, ": every matrix must be on one device, got ps[0] on ",
                ps[0].device(), " and ps[", i, "] on ", p.device());
    if (p.numel() > 0) mats.push_back(p);
  }
#ifdef ACCORDION_WITH_CUDA
  if (!mats.empty() && mats[0].is_cuda()) return orthogonalize_cuda(mats, eps);
#endif
  orthogonalize_cpu(mats, eps);
}

// residual -= approx (float32); returns approx in `dtype`, in one pass.
at::Tensor error_update_(const at::Tensor& residual, const at::Tensor& approx, at::ScalarType dtype) {
  constexpr const char* op = "accordion::error_update_";
  check_contiguous_float(residual, op, "residual");
  check_contiguous_float(approx, op, "approx");
  TORCH_CHECK(residual.sizes() == approx.sizes(), op, ": residual and approx must have the same shape, got ",
              residual.sizes(), " and ", approx.sizes());
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": dtype must be float32, float16 or bfloat16, got ", dtype);
  check_same_device(residual, approx, op, "residual and approx");
#ifdef ACCORDION_WITH_CUDA
  if (residual.is_cuda()) return error_update_cuda(residual, approx, dtype);
#endif
  return error_update_cpu(residual, approx, dtype);
}

}  // namespace

TORCH_LIBRARY(accordion, m) {
  m.def("ef_add(Tensor grad, Tensor residual) -> Tensor");
  m.def("ef_add_(Tensor grad, Tensor(a!) residual) -> ()");
  m.def("topk_ef(Tensor grad, Tensor(a!) residual, int k) -> (Tensor values, Tensor indices, Tensor g_sq, "
        "Tensor kept_sq)");
  m.def("sparse_average(Tensor values, Tensor indices, int numel, int world_size, ScalarType dtype) -> Tensor");
  m.def("orthogonalize_(Tensor(a!)[] ps, float eps) -> ()");
  m.def("error_update_(Tensor(a!) residual, Tensor approx, ScalarType dtype) -> Tensor");
}

// The same function serves CPU and CUDA (it picks the kernel by device), registered per key
// so that other keys (Meta, fake tensors) keep their own Python registrations.
TORCH_LIBRARY_IMPL(accordion, CPU, m) {
  m.impl("ef_add", &ef_add);
  m.impl("ef_add_", &ef_add_);
  m.impl("topk_ef", &topk_ef);
  m.impl("sparse_average", &sparse_average);
  m.impl("orthogonalize_", &orthogonalize_);
  m.impl("error_update_", &error_update_);
}
#ifdef ACCORDION_WITH_CUDA
TORCH_LIBRARY_IMPL(accordion, CUDA, m) {
  m.impl("ef_add", &ef_add);
  m.impl("ef_add_", &ef_add_);
  m.impl("topk_ef", &topk_ef);
  m.impl("sparse_average", &sparse_average);
  m.impl("orthogonalize_", &orthogonalize_);
  m.impl("error_update_", &error_update_);
}
#endif

}  // namespace accordion
