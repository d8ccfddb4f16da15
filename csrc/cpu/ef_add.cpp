// CPU kernel of accordion::ef_add_: out = grad + residual (out is the residual), in the residual's dtype.
// A memory-bound stream: one read of each input and one write, split across threads with
// at::parallel_for (the per-range loop is in ef_add_block.h). What it adds over torch is the
// mixed case, a 16-bit gradient into a float32 residual, converted on the fly (F16C).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "cpu/ef_add_block.h"
#include "cpu/kernels.h"

namespace accordion {
namespace {

constexpr int64_t kGrain = 1 << 15;  // elements per task: large enough to amortize scheduling

template <typename G, typename R>
void ef_add_loop(const G* grad, const R* residual, R* out, int64_t n) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    cpu::ef_add_range(grad, residual, out, begin, end);
  });
}

}  // namespace

void ef_add_out_cpu(const at::Tensor& grad, const at::Tensor& residual, at::Tensor& out) {
  const int64_t n = residual.numel();
  if (n == 0) return;
  if (grad.scalar_type() == residual.scalar_type()) {
    // Same dtype: a plain add, which torch already runs with AVX2/AVX-512 picked at run time
    // (this module is compiled for baseline x86-64); measured ~10% faster than our loop.
    at::add_out(out, residual, grad);
  } else {  // half/bfloat16 gradient into a float32 residual (checked by check_ef_add_args)
    AT_DISPATCH_REDUCED_FLOATING_TYPES(grad.scalar_type(), "ef_add_cpu_mixed", [&] {
      ef_add_loop(grad.const_data_ptr<scalar_t>(), residual.const_data_ptr<float>(),
                  out.mutable_data_ptr<float>(), n);
    });
  }
}

}  // namespace accordion
