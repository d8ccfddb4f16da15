// CPU kernel of accordion::sparse_average, TopK's decode: every rank's (values, indices),
// concatenated in rank order, scatter-added into a dense float32 vector, divided by the
// world size, and written in the gradient's dtype.
//
// The scatter runs on one thread, in rank order, so an index sent by several ranks is
// summed in the same order on every rank and in the reference (rank order matters for the
// rounding; a parallel scatter would need atomics and lose that). It touches only the
// world * k gathered entries; the O(n) work, zero-filling and the division with its dtype
// conversion, is spread over threads.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "ops.h"

namespace accordion {

constexpr int64_t kGrain = 1 << 15;

at::Tensor sparse_average_cpu(const at::Tensor& values, const at::Tensor& indices, int64_t numel,
                              int64_t world_size, at::ScalarType out_dtype) {
  at::Tensor sum = at::zeros({numel}, values.options());
  float* s = sum.mutable_data_ptr<float>();
  const float* v = values.const_data_ptr<float>();
  const int32_t* idx = indices.const_data_ptr<int32_t>();
  for (int64_t j = 0, count = values.numel(); j < count; ++j) {
    const int32_t i = idx[j];
    TORCH_CHECK(i >= 0 && i < numel, "accordion::sparse_average: indices[", j, "] = ", i,
                " is outside [0, numel = ", numel, ")");
    s[i] += v[j];
  }
  const float world = static_cast<float>(world_size);
  if (out_dtype == at::kFloat) {
    at::parallel_for(0, numel, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) s[i] /= world;
    });
    return sum;
  }
  at::Tensor out = at::empty({numel}, values.options().dtype(out_dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_dtype, "sparse_average_cpu", [&] {
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, numel, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) o[i] = static_cast<scalar_t>(s[i] / world);
    });
  });
  return out;
}

}  // namespace accordion
