// The accordion:: operators on CUDA tensors: the shared checks (ops.h), then the pure-CUDA
// kernels of this directory (kernels.h), on the current stream under a device guard, with
// outputs and workspaces from torch's caching allocator. Built only when torch has CUDA
// (see CMakeLists.txt); `make cuda-check` compiles it, syntax only, on machines without.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>
#include <tuple>

#include "cuda/kernels.h"
#include "ops.h"
#include "quantize_chunks.h"

namespace accordion {
namespace {

cuda::DType to_kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return cuda::DType::kFloat32;
    case at::kDouble: return cuda::DType::kFloat64;
    case at::kHalf: return cuda::DType::kFloat16;
    case at::kBFloat16: return cuda::DType::kBFloat16;
    default: TORCH_CHECK(false, "accordion: unsupported dtype on CUDA: ", t);
  }
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }

void ef_add_out_cuda(const at::Tensor& grad, const at::Tensor& residual, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(residual.device());
  C10_CUDA_CHECK(cuda::ef_add(grad.const_data_ptr(), to_kernel_dtype(grad.scalar_type()), residual.const_data_ptr(),
                              out.mutable_data_ptr(), to_kernel_dtype(residual.scalar_type()), residual.numel(),
                              current_stream()));
}

// The finite flag stays on the device: the gradient is masked there (one extra pass, only
// when a flag is given), never read by the host. (topk_ef reads its flag in the kernels.)
std::optional<at::Tensor> grad_if_finite(const at::Tensor& grad, const at::Tensor& finite) {
  return grad.masked_fill(finite.logical_not(), 0);
}

// The TopK kernels over `layers` (their grads of one dtype), with a workspace from the
// caching allocator: freed when this returns, it stays reserved for the stream's later
// work, so that is safe while the kernels still run.
void run_topk(const std::vector<cuda::TopKLayer>& layers, at::ScalarType grad_dtype, bool poison,
              const at::TensorOptions& options) {
  const size_t bytes = cuda::topk_ef_workspace_bytes(layers.data(), static_cast<int>(layers.size()));
  at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, options.dtype(at::kByte));
  C10_CUDA_CHECK(cuda::topk_ef(layers.data(), static_cast<int>(layers.size()), to_kernel_dtype(grad_dtype), poison,
                               workspace.mutable_data_ptr(), bytes, current_stream()));
}

// g_sq and kept_sq stay on the device (0-d float64): no synchronization.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> topk_ef(const at::Tensor& grad,
                                                                   const at::Tensor& residual, int64_t k,
                                                                   const std::optional<at::Tensor>& finite) {
  auto [values, indices] = topk_ef_outputs(grad, residual, k, finite);
  const c10::cuda::CUDAGuard guard(residual.device());
  const auto scalar = residual.options().dtype(at::kDouble);
  at::Tensor g_sq = at::empty({}, scalar), kept_sq = at::empty({}, scalar);
  const at::Tensor g = grad.contiguous();
  run_topk({{g.const_data_ptr(), residual.mutable_data_ptr<float>(), residual.numel(), k,
             values.mutable_data_ptr<float>(), indices.mutable_data_ptr<int32_t>(), g_sq.mutable_data_ptr<double>(),
             kept_sq.mutable_data_ptr<double>(), finite ? finite->const_data_ptr<bool>() : nullptr}},
           g.scalar_type(), /*poison=*/false, residual.options());
  return {values, indices, g_sq, kept_sq};
}

// A bucket: one launch sequence per gradient dtype present (a bucket has one in practice).
std::tuple<at::Tensor, at::Tensor, at::Tensor> topk_ef_many(at::TensorList grads, at::TensorList residuals,
                                                            at::IntArrayRef ks,
                                                            const std::optional<at::Tensor>& finite) {
  const std::vector<int64_t> offsets = check_topk_ef_many_args(grads, residuals, ks, finite);
  const c10::cuda::CUDAGuard guard(residuals[0].device());
  const auto options = residuals[0].options();
  const int64_t count = static_cast<int64_t>(grads.size());
  at::Tensor payload = at::empty({8 * offsets.back()}, options.dtype(at::kByte));
  at::Tensor g_sq = at::empty({count}, options.dtype(at::kDouble)), kept_sq = at::empty_like(g_sq);
  const at::Tensor flags = finite ? finite->contiguous() : at::Tensor();
  std::vector<at::Tensor> contiguous;  // alive until the kernels are launched
  contiguous.reserve(count);
  for (const at::ScalarType dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    std::vector<cuda::TopKLayer> layers;
    for (int64_t i = 0; i < count; ++i) {
      if (grads[i].scalar_type() != dtype) continue;
      contiguous.push_back(grads[i].contiguous());
      auto [values, indices] = payload_parts(payload, offsets[i], ks[i]);
      layers.push_back({contiguous.back().const_data_ptr(), residuals[i].mutable_data_ptr<float>(),
                        residuals[i].numel(), ks[i], values.mutable_data_ptr<float>(),
                        indices.mutable_data_ptr<int32_t>(), g_sq.mutable_data_ptr<double>() + i,
                        kept_sq.mutable_data_ptr<double>() + i, finite ? flags.const_data_ptr<bool>() + i : nullptr});
    }
    if (!layers.empty()) run_topk(layers, dtype, /*poison=*/true, options);
  }
  return {payload, g_sq, kept_sq};
}

// One launch per 64 layers; the flags are read on the device.
void restore_many_if_(at::TensorList residuals, const at::Tensor& payload, at::IntArrayRef ks,
                      const at::Tensor& flags) {
  const std::vector<int64_t> offsets = check_restore_many_args(residuals, payload, ks, flags);
  if (residuals.empty()) return;
  const c10::cuda::CUDAGuard guard(payload.device());
  const at::Tensor f = flags.contiguous();
  std::vector<cuda::RestoreLayer> layers;
  for (size_t i = 0; i < residuals.size(); ++i) {
    auto [values, indices] = payload_parts(payload, offsets[i], ks[i]);
    layers.push_back({residuals[i].mutable_data_ptr<float>(), values.const_data_ptr<float>(),
                      indices.const_data_ptr<int32_t>(), f.const_data_ptr<bool>() + i, residuals[i].numel(), ks[i]});
  }
  C10_CUDA_CHECK(cuda::topk_restore(layers.data(), static_cast<int>(layers.size()), current_stream()));
}

at::Tensor sparse_average(const at::Tensor& values, const at::Tensor& indices, int64_t numel, int64_t world_size,
                          at::ScalarType dtype, const std::optional<at::Tensor>& bad_flag) {
  check_sparse_average_args(values, indices, numel, world_size, dtype);
  check_bad_flag(bad_flag, values);
  const c10::cuda::CUDAGuard guard(values.device());
  const cudaStream_t stream = current_stream();
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
  if (bad_flag) {  // flagged on the device, read by the caller later: no synchronization here
    const_cast<at::Tensor&>(*bad_flag).logical_or_(bad.ne(-1).squeeze(0));
  } else {
    // Without a flag a bad index from another rank is an error at once, as on the CPU: this
    // costs one synchronization.
    const uint64_t first_bad = static_cast<uint64_t>(bad.item<int64_t>());
    TORCH_CHECK(first_bad == std::numeric_limits<uint64_t>::max(), "accordion::sparse_average: indices[",
                first_bad >> 32, "] = ", static_cast<int32_t>(first_bad & 0xffffffffu),
                " is outside [0, numel = ", numel, ")");
  }
  const bool direct = dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
  at::Tensor out = dtype == at::kFloat || !direct ? sum : at::empty({numel}, values.options().dtype(dtype));
  C10_CUDA_CHECK(cuda::divide_convert(sum.const_data_ptr<float>(), numel, world_size, out.mutable_data_ptr(),
                                      to_kernel_dtype(out.scalar_type()), stream));
  return direct ? out : out.to(dtype);
}

// PowerSGD for a bucket: a fixed launch sequence per phase and gradient dtype, whatever the
// layer count; flags stay on the device. Layer i of a phase as the kernels take it.
cuda::PowerSGDLayer psgd_layer(const at::Tensor& residual, int64_t r) {
  cuda::PowerSGDLayer L{};
  L.residual = residual.mutable_data_ptr<float>();
  L.n = residual.size(0);
  L.m = residual.size(1);
  L.r = r;
  return L;
}

at::Tensor powersgd_p_many(at::TensorList grads, at::TensorList residuals, at::TensorList qts,
                           const std::optional<at::Tensor>& finite) {
  const std::vector<int64_t> offsets = check_powersgd_p_many_args(grads, residuals, qts, finite);
  const c10::cuda::CUDAGuard guard(residuals[0].device());
  at::Tensor payload = at::empty({offsets.back()}, residuals[0].options());
  const at::Tensor flags = finite ? finite->contiguous() : at::Tensor();
  for (const at::ScalarType dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    std::vector<cuda::PowerSGDLayer> layers;
    for (size_t i = 0; i < residuals.size(); ++i) {
      if (grads[i].scalar_type() != dtype) continue;
      cuda::PowerSGDLayer L = psgd_layer(residuals[i], qts[i].size(0));
      L.grad = grads[i].const_data_ptr();  // contiguous (checked)
      L.qt = const_cast<float*>(qts[i].const_data_ptr<float>());
      L.p = payload.mutable_data_ptr<float>() + offsets[i];
      L.finite = finite ? flags.const_data_ptr<bool>() + i : nullptr;
      layers.push_back(L);
    }
    if (!layers.empty())
      C10_CUDA_CHECK(cuda::powersgd_p(layers.data(), static_cast<int>(layers.size()), to_kernel_dtype(dtype),
                                      current_stream()));
  }
  return payload;
}

at::Tensor powersgd_qt_many(at::TensorList ps, at::TensorList residuals) {
  const std::vector<int64_t> offsets = check_powersgd_qt_many_args(ps, residuals);
  const c10::cuda::CUDAGuard guard(residuals[0].device());
  at::Tensor payload = at::empty({offsets.back()}, residuals[0].options());
  std::vector<cuda::PowerSGDLayer> layers;
  for (size_t i = 0; i < residuals.size(); ++i) {
    cuda::PowerSGDLayer L = psgd_layer(residuals[i], ps[i].size(1));
    L.p = const_cast<float*>(ps[i].const_data_ptr<float>());
    L.qt_out = payload.mutable_data_ptr<float>() + offsets[i];
    layers.push_back(L);
  }
  const size_t bytes = cuda::powersgd_qt_workspace_bytes(layers.data(), static_cast<int>(layers.size()));
  // From the caching allocator: freed on return, it stays reserved for the stream's later work.
  at::Tensor workspace = at::empty({static_cast<int64_t>(bytes / sizeof(float))}, residuals[0].options());
  C10_CUDA_CHECK(cuda::powersgd_qt(layers.data(), static_cast<int>(layers.size()),
                                   workspace.mutable_data_ptr<float>(), current_stream()));
  return payload;
}

void powersgd_finish_many_(at::TensorList residuals, at::TensorList outs, at::TensorList qts, at::TensorList ps,
                           at::TensorList qts_avg, const std::optional<at::Tensor>& ok) {
  check_powersgd_finish_many_args(residuals, outs, qts, ps, qts_avg, ok);
  if (residuals.empty()) return;
  const c10::cuda::CUDAGuard guard(residuals[0].device());
  for (const at::ScalarType dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    std::vector<cuda::PowerSGDLayer> layers;
    for (size_t i = 0; i < residuals.size(); ++i) {
      if (outs[i].scalar_type() != dtype) continue;
      cuda::PowerSGDLayer L = psgd_layer(residuals[i], qts[i].size(0));
      L.p = const_cast<float*>(ps[i].const_data_ptr<float>());
      L.qt_avg = qts_avg[i].const_data_ptr<float>();
      L.qt = const_cast<float*>(qts[i].const_data_ptr<float>());
      L.out = outs[i].mutable_data_ptr();
      layers.push_back(L);
    }
    if (!layers.empty())
      C10_CUDA_CHECK(cuda::powersgd_finish(layers.data(), static_cast<int>(layers.size()), to_kernel_dtype(dtype),
                                           ok ? ok->const_data_ptr<bool>() : nullptr, current_stream()));
  }
}

void powersgd_settle_many_(at::TensorList residuals, at::TensorList ps, at::TensorList qts, const at::Tensor& flag) {
  check_powersgd_settle_many_args(residuals, ps, qts, flag);
  if (residuals.empty()) return;
  const c10::cuda::CUDAGuard guard(residuals[0].device());
  std::vector<cuda::PowerSGDLayer> layers;
  for (size_t i = 0; i < residuals.size(); ++i) {
    cuda::PowerSGDLayer L = psgd_layer(residuals[i], qts[i].size(0));
    L.p = const_cast<float*>(ps[i].const_data_ptr<float>());
    L.qt_avg = qts[i].const_data_ptr<float>();
    layers.push_back(L);
  }
  C10_CUDA_CHECK(cuda::powersgd_settle(layers.data(), static_cast<int>(layers.size()), flag.const_data_ptr<bool>(),
                                       current_stream()));
}

void orthogonalize_(at::TensorList ps, double eps) {
  const std::vector<at::Tensor> mats = orthogonalize_matrices(ps, eps);
  if (mats.empty()) return;
  const c10::cuda::CUDAGuard guard(mats[0].device());
  // One launch per dtype present (float32 and float64 are never mixed in practice).
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    std::vector<cuda::MatrixRef> refs;
    for (const at::Tensor& p : mats)
      if (p.scalar_type() == dtype) refs.push_back({p.data_ptr(), p.size(0), p.size(1)});
    if (refs.empty()) continue;
    C10_CUDA_CHECK(cuda::orthogonalize(refs.data(), static_cast<int>(refs.size()), to_kernel_dtype(dtype), eps,
                                       current_stream()));
  }
}

// The flag stays on the device: a masked fill per tensor, never read by the host.
void fill_if_(at::TensorList tensors, const at::Tensor& flag, const at::Scalar& value) {
  check_fill_if_args(tensors, flag);
  const c10::cuda::CUDAGuard guard(flag.device());
  for (const at::Tensor& t : tensors) const_cast<at::Tensor&>(t).masked_fill_(flag, value);
}

// The flag stays on the device: the entries are written either way, with the values or with
// what they hold (k entries: nothing next to the step's other work).
void restore_if_(const at::Tensor& residual, const at::Tensor& indices, const at::Tensor& values,
                 const at::Tensor& flag) {
  check_restore_if_args(residual, indices, values, flag);
  const c10::cuda::CUDAGuard guard(residual.device());
  const at::Tensor index = indices.to(at::kLong);
  const_cast<at::Tensor&>(residual).index_put_({index}, at::where(flag, values, residual.index({index})));
}

// The flags stay on the device: the kernels read them.
at::Tensor flush_whole(const at::Tensor& grad, const at::Tensor& residual, at::ScalarType dtype,
                       const std::optional<at::Tensor>& finite) {
  check_flush_whole_args(grad, residual, dtype, finite);
  const c10::cuda::CUDAGuard guard(residual.device());
  at::Tensor out = at::empty(residual.sizes(), residual.options().dtype(dtype));
  const at::Tensor g = grad.contiguous();
  C10_CUDA_CHECK(cuda::flush_whole(g.const_data_ptr(), to_kernel_dtype(g.scalar_type()),
                                   residual.mutable_data_ptr<float>(), residual.numel(), out.mutable_data_ptr(),
                                   to_kernel_dtype(dtype), finite ? finite->const_data_ptr<bool>() : nullptr,
                                   current_stream()));
  return out;
}

void settle_sent_(const at::Tensor& residual, at::ScalarType dtype, const at::Tensor& done) {
  check_settle_sent_args(residual, dtype, done);
  const c10::cuda::CUDAGuard guard(residual.device());
  if (dtype == at::kFloat) {  // nothing rounded away: e = 0 where the step went through
    const_cast<at::Tensor&>(residual).masked_fill_(done, 0);
    return;
  }
  C10_CUDA_CHECK(cuda::settle_sent(residual.mutable_data_ptr<float>(), residual.numel(), to_kernel_dtype(dtype),
                                   done.const_data_ptr<bool>(), current_stream()));
}

at::Tensor quantize_ef_(const at::Tensor& grad, const at::Tensor& residual, int64_t bits, int64_t chunk,
                        const std::optional<at::Tensor>& finite) {
  check_quantize_ef_args(grad, residual, bits, chunk, finite);
  const int64_t n = residual.numel();
  // zeros: the padding after the integers is sent as zeros
  at::Tensor payload = at::zeros({quantize_payload_bytes(n, bits, chunk)}, residual.options().dtype(at::kByte));
  const at::Tensor g = grad.contiguous();
  C10_CUDA_CHECK(cuda::quantize_ef(g.const_data_ptr(), to_kernel_dtype(g.scalar_type()),
                                   residual.mutable_data_ptr<float>(), n, static_cast<int>(bits), chunk,
                                   finite ? finite->const_data_ptr<bool>() : nullptr, payload.mutable_data_ptr(),
                                   current_stream()));
  return payload;
}

at::Tensor quantize_average(const at::Tensor& rows, int64_t numel, int64_t bits, int64_t chunk,
                            at::ScalarType dtype) {
  check_quantize_average_args(rows, numel, bits, chunk, dtype);
  at::Tensor total = at::empty({numel}, rows.options().dtype(at::kFloat));
  C10_CUDA_CHECK(cuda::quantize_average(rows.const_data_ptr(), rows.size(0), rows.stride(0), numel,
                                        static_cast<int>(bits), chunk, total.mutable_data_ptr<float>(),
                                        current_stream()));
  return dtype == at::kFloat ? total : total.to(dtype);
}

at::Tensor quantize_chunks_ef_(const at::Tensor& grad, const at::Tensor& residual, int64_t bits, int64_t chunk,
                               int64_t k, double skip, const std::optional<at::Tensor>& finite) {
  check_quantize_chunks_ef_args(grad, residual, bits, chunk, k, skip, finite);
  TORCH_CHECK(chunk <= cuda::kMaxSparseChunk, "accordion::quantize_chunks_ef_: chunk must be <= ",
              cuda::kMaxSparseChunk, " on CUDA (a chunk's energy is summed in shared memory), got ", chunk);
  const c10::cuda::CUDAGuard guard(residual.device());
  const int64_t n = residual.numel();
  // zeros: the last chunk's padding and the payload's are sent as zeros
  at::Tensor payload = at::zeros({quantize_chunks_payload_bytes(k, chunk, bits)}, residual.options().dtype(at::kByte));
  at::Tensor workspace = at::empty({static_cast<int64_t>(cuda::quantize_chunks_workspace_bytes(n, chunk, k))},
                                   residual.options().dtype(at::kByte));
  const at::Tensor g = grad.contiguous();
  C10_CUDA_CHECK(cuda::quantize_chunks_ef(g.const_data_ptr(), to_kernel_dtype(g.scalar_type()),
                                          residual.mutable_data_ptr<float>(), n, static_cast<int>(bits), chunk, k,
                                          skip, finite ? finite->const_data_ptr<bool>() : nullptr,
                                          payload.mutable_data_ptr(), workspace.mutable_data_ptr(),
                                          current_stream()));
  return payload;
}

std::tuple<at::Tensor, at::Tensor> quantize_chunks_average(const at::Tensor& rows, int64_t numel, int64_t k,
                                                           int64_t bits, int64_t chunk, at::ScalarType dtype) {
  check_quantize_chunks_average_args(rows, numel, k, bits, chunk, dtype);
  const c10::cuda::CUDAGuard guard(rows.device());
  at::Tensor total = at::empty({numel}, rows.options().dtype(at::kFloat));
  at::Tensor k_next = at::empty({}, rows.options().dtype(at::kLong));
  C10_CUDA_CHECK(cuda::quantize_chunks_average(rows.const_data_ptr(), rows.size(0), rows.stride(0), numel,
                                               static_cast<int>(bits), chunk, k, total.mutable_data_ptr<float>(),
                                               k_next.mutable_data_ptr<int64_t>(), current_stream()));
  return {dtype == at::kFloat ? total : total.to(dtype), k_next};
}

void quantize_chunks_settle_(const at::Tensor& residual, const at::Tensor& indices, const at::Tensor& q,
                             const at::Tensor& scales, int64_t chunk, const at::Tensor& done) {
  check_quantize_chunks_settle_args(residual, indices, q, scales, chunk, done);
  const c10::cuda::CUDAGuard guard(residual.device());
  C10_CUDA_CHECK(cuda::quantize_chunks_settle(residual.mutable_data_ptr<float>(), residual.numel(), chunk,
                                              indices.numel(), indices.const_data_ptr<int32_t>(), q.const_data_ptr(),
                                              q.scalar_type() == at::kChar ? 8 : 16, scales.const_data_ptr<float>(),
                                              done.const_data_ptr<bool>(), current_stream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(accordion, CUDA, m) {
  m.impl("ef_add_", &ef_add_<ef_add_out_cuda, grad_if_finite>);
  m.impl("topk_ef", &topk_ef);
  m.impl("topk_ef_many", &topk_ef_many);
  m.impl("restore_many_if_", &restore_many_if_);
  m.impl("sparse_average", &sparse_average);
  m.impl("powersgd_p_many", &powersgd_p_many);
  m.impl("powersgd_qt_many", &powersgd_qt_many);
  m.impl("powersgd_finish_many_", &powersgd_finish_many_);
  m.impl("powersgd_settle_many_", &powersgd_settle_many_);
  m.impl("orthogonalize_", &orthogonalize_);
  m.impl("fill_if_", &fill_if_);
  m.impl("restore_if_", &restore_if_);
  m.impl("quantize_ef_", &quantize_ef_);
  m.impl("quantize_average", &quantize_average);
  m.impl("flush_whole", &flush_whole);
  m.impl("settle_sent_", &settle_sent_);
  m.impl("quantize_chunks_ef_", &quantize_chunks_ef_);
  m.impl("quantize_chunks_average", &quantize_chunks_average);
  m.impl("quantize_chunks_settle_", &quantize_chunks_settle_);
}

}  // namespace accordion
