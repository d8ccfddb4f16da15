// CPU kernel of accordion::sparse_average, TopK's decode: every rank's (values, indices),
// concatenated in rank order, scatter-added into a dense float32 vector, divided by the
// world size, and written in the gradient's dtype.
//
// The scatter runs on one thread, in rank order, so an index sent by several ranks is
// summed in the same order on every rank and in the reference (rank order matters for the
// rounding; a parallel scatter would need atomics and lose that). It touches only the
// world * k gathered entries, with a bounds check on each index (a bad index from another
// rank must not write outside the output).
#include "cpu/kernels.h"

namespace accordion {

at::Tensor sparse_average_cpu(const at::Tensor& values, const at::Tensor& indices, int64_t numel,
                              int64_t world_size, at::ScalarType out_dtype, bool* bad) {
  at::Tensor sum = at::zeros({numel}, values.options());
  float* s = sum.mutable_data_ptr<float>();
  const float* v = values.const_data_ptr<float>();
  const int32_t* idx = indices.const_data_ptr<int32_t>();
  for (int64_t j = 0, count = values.numel(); j < count; ++j) {
    const int32_t i = idx[j];
    if (bad != nullptr && (i < 0 || i >= numel)) {  // skipped, flagged: the caller fails the step
      *bad = true;
      continue;
    }
    TORCH_CHECK(i >= 0 && i < numel, "accordion::sparse_average: indices[", j, "] = ", i,
                " is outside [0, numel = ", numel, ")");
    s[i] += v[j];
  }
  // The dense O(n) tail is torch's own vectorized division and conversion: the same
  // rounding as the reference, at the memory's speed.
  sum.div_(world_size);
  return out_dtype == at::kFloat ? sum : sum.to(out_dtype);
}

}  // namespace accordion
