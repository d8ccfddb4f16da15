// CPU kernels of PowerSGD for a whole bucket (accordion::powersgd_*_many; checks in ops.h).
//
// The products go through BLAS (torch's mm). What is ours is the first phase: M = grad + e
// and P = M Q in one sweep over M, by blocks of rows small enough to stay in L2 between the
// add that writes them and the product that reads them; done one after the other over the
// whole layer, the product reads M back from memory (ResNet-18: 45 MB per step). The other
// phases are one BLAS call per layer: Q^T = P^T M written straight into the bucket's Q^T
// payload, M_hat = P Q^T into the gradient's memory, e -= P Q^T in place (addmm).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>

#include "cpu/ef_add_block.h"
#include "cpu/kernels.h"

namespace accordion {
namespace {

// Entries of M per block: 512 KiB of float32, well inside the L2 of a current x86 core
// (1-2 MiB) together with the block of gradient streaming through.
constexpr int64_t kBlockEntries = 1 << 17;

}  // namespace

void powersgd_p_cpu(const at::Tensor& grad, const at::Tensor& residual, const at::Tensor& qt, const at::Tensor& p,
                    bool add) {
  const int64_t n = residual.size(0), m = residual.size(1);
  if (!add) {  // a non-finite gradient: e is left as it was, P is NaN for every rank to see
    const_cast<at::Tensor&>(p).fill_(std::numeric_limits<float>::quiet_NaN());
    return;
  }
  if (n == 0) return;
  const int64_t rows = std::max<int64_t>(1, kBlockEntries / std::max<int64_t>(m, 1));
  const int64_t blocks = (n + rows - 1) / rows;
  const at::Tensor q = qt.t();  // (m, r): BLAS reads Q^T's row-major storage as Q, no copy
  float* e = residual.mutable_data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "powersgd_p_cpu", [&] {
    const scalar_t* g = grad.const_data_ptr<scalar_t>();
    // One task per block (nested BLAS calls run on the task's thread).
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t first = b * rows, count = std::min(rows, n - first);
        cpu::ef_add_range(g + first * m, e + first * m, e + first * m, 0, count * m);
        at::Tensor block = p.narrow(0, first, count);
        at::mm_out(block, residual.narrow(0, first, count), q);
      }
    });
  });
}

void powersgd_qt_cpu(const at::Tensor& p, const at::Tensor& residual, at::Tensor& qt) {
  at::mm_out(qt, p.t(), residual);
}

void powersgd_finish_cpu(const at::Tensor& p, const at::Tensor& qt_avg, at::Tensor& out) {
  const at::Tensor shaped = out.view({p.size(0), qt_avg.size(1)});
  if (out.scalar_type() == at::kFloat) {
    at::Tensor target = shaped;
    at::mm_out(target, p, qt_avg);
  } else {  // a 16-bit gradient: the product in float32, rounded once
    const_cast<at::Tensor&>(shaped).copy_(at::mm(p, qt_avg));
  }
}

void powersgd_settle_cpu(const at::Tensor& residual, const at::Tensor& p, const at::Tensor& qt) {
  const_cast<at::Tensor&>(residual).addmm_(p, qt, /*beta=*/1, /*alpha=*/-1);
}

}  // namespace accordion
