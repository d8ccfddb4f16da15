// Torch glue for the CUDA kernels of TopK (topk_ef.cu, sparse_average.cu) and PowerSGD
// (powersgd.cu): outputs and workspaces come from torch's caching allocator, work goes on
// the current stream. Arguments were checked by the op wrappers in ops.cpp, the same checks
// as on the CPU. Built only when torch has CUDA (see CMakeLists.txt).
#include <limits>

#include "cuda/glue.h"
#include "ops.h"

namespace accordion {

void topk_ef_cuda(const at::Tensor& grad, const at::Tensor& residual, int64_t k, at::Tensor& values,
                  at::Tensor& indices, at::Tensor& g_sq, at::Tensor& kept_sq) {
  const c10::cuda::CUDAGuard guard(residual.device());
  const int64_t n = residual.numel();
  const size_t bytes = cuda::topk_ef_workspace_bytes(n, k);
  // Freed (back to the caching allocator) when this returns; the allocator keeps it for
  // the stream's later work, so that is safe while the kernels still run.
  at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, residual.options().dtype(at::kByte));
  C10_CUDA_CHECK(cuda::topk_ef(grad.const_data_ptr(), to_kernel_dtype(grad.scalar_type()),
                               residual.mutable_data_ptr<float>(), n, k, values.mutable_data_ptr<float>(),
                               indices.mutable_data_ptr<int32_t>(), g_sq.mutable_data_ptr<double>(),
                               kept_sq.mutable_data_ptr<double>(), workspace.mutable_data_ptr(), bytes,
                               at::cuda::getCurrentCUDAStream()));
}

at::Tensor sparse_average_cuda(const at::Tensor& values, const at::Tensor& indices, int64_t numel,
                               int64_t world_size, at::ScalarType out_dtype) {
  const c10::cuda::CUDAGuard guard(values.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor sum = at::zeros({numel}, values.options());
  at::Tensor bad = at::full({1}, -1, values.options().dtype(at::kLong));  // all bits set: UINT64_MAX
  const int64_t count = values.numel();
  // One segment per rank when the entries split evenly (TopK: every rank sends k), so
  // overlapping indices add in rank order; else one segment.
  const int64_t segments = count % world_size == 0 ? world_size : 1;
  C10_CUDA_CHECK(cuda::sparse_scatter_add(values.const_data_ptr<float>(), indices.const_data_ptr<int32_t>(), count,
                                          segments, sum.mutable_data_ptr<float>(), numel,
                                          reinterpret_cast<unsigned long long*>(bad.mutable_data_ptr<int64_t>()),
                                          stream));
  // A bad index from another rank must be an error, as on the CPU: this costs one
  // synchronization, which the decode (right after a blocking allgather) can afford.
  const uint64_t first_bad = static_cast<uint64_t>(bad.item<int64_t>());
  TORCH_CHECK(first_bad == std::numeric_limits<uint64_t>::max(), "accordion::sparse_average: indices[",
              first_bad >> 32, "] = ", static_cast<int32_t>(first_bad & 0xffffffffu), " is outside [0, numel = ",
              numel, ")");
  const bool direct = out_dtype == at::kFloat || out_dtype == at::kHalf || out_dtype == at::kBFloat16;
  at::Tensor out = out_dtype == at::kFloat || !direct ? sum : at::empty({numel}, values.options().dtype(out_dtype));
  C10_CUDA_CHECK(cuda::divide_convert(sum.const_data_ptr<float>(), numel, world_size, out.mutable_data_ptr(),
                                      to_kernel_dtype(out.scalar_type()), stream));
  return direct ? out : out.to(out_dtype);
}

void orthogonalize_cuda(const std::vector<at::Tensor>& ps, double eps) {
  if (ps.empty()) return;
  const c10::cuda::CUDAGuard guard(ps[0].device());
  // One launch per dtype present (float32 and float64 are never mixed in practice).
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    std::vector<cuda::MatrixRef> refs;
    for (const at::Tensor& p : ps)
      if (p.scalar_type() == dtype) refs.push_back({p.data_ptr(), p.size(0), p.size(1)});
    if (refs.empty()) continue;
    C10_CUDA_CHECK(cuda::orthogonalize(refs.data(), static_cast<int>(refs.size()), to_kernel_dtype(dtype), eps,
                                       at::cuda::getCurrentCUDAStream()));
  }
}

at::Tensor error_update_cuda(const at::Tensor& residual, const at::Tensor& approx, at::ScalarType out_dtype) {
  const c10::cuda::CUDAGuard guard(residual.device());
  at::Tensor out = at::empty(approx.sizes(), approx.options().dtype(out_dtype));
  C10_CUDA_CHECK(cuda::error_update(residual.mutable_data_ptr<float>(), approx.const_data_ptr<float>(),
                                    approx.numel(), out.mutable_data_ptr(), to_kernel_dtype(out_dtype),
                                    at::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace accordion
