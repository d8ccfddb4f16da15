// Schemas of every accordion:: operator, and the wrappers that check arguments once and hand
// contiguous tensors to the CPU or CUDA kernel. The fake (meta) implementations that
// torch.compile and opcheck need are registered from Python (accordion_hvd/ops.py).
#include <torch/library.h>

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

}  // namespace

TORCH_LIBRARY(accordion, m) {
  m.def("ef_add(Tensor grad, Tensor residual) -> Tensor");
  m.def("ef_add_(Tensor grad, Tensor(a!) residual) -> ()");
}

// The same function serves CPU and CUDA (it picks the kernel by device), registered per key
// so that other keys (Meta, fake tensors) keep their own Python registrations.
TORCH_LIBRARY_IMPL(accordion, CPU, m) {
  m.impl("ef_add", &ef_add);
  m.impl("ef_add_", &ef_add_);
}
#ifdef ACCORDION_WITH_CUDA
TORCH_LIBRARY_IMPL(accordion, CUDA, m) {
  m.impl("ef_add", &ef_add);
  m.impl("ef_add_", &ef_add_);
}
#endif

}  // namespace accordion
