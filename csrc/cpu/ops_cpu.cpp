// The accordion:: operators on CPU tensors: the shared checks (ops.h), then the CPU kernels.
#include <torch/library.h>

#include "cpu/kernels.h"
#include "ops.h"
#include "quantize_chunks.h"

#include <tuple>

namespace accordion {
namespace {

// On the CPU the finite flag is read directly: that is a memory load, not a round-trip.
std::optional<at::Tensor> grad_if_finite(const at::Tensor& grad, const at::Tensor& finite) {
  if (finite.item<bool>()) return grad;
  return std::nullopt;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> topk_ef(const at::Tensor& grad,
                                                                   const at::Tensor& residual, int64_t k,
                                                                   const std::optional<at::Tensor>& finite) {
  auto [values, indices] = topk_ef_outputs(grad, residual, k, finite);
  double g_sq = 0, kept_sq = 0;
  // A non-finite gradient adds nothing: the selection is then made from the residual alone
  // (a zero gradient; allocated only on this rare path).
  const at::Tensor g = !finite || grad_if_finite(grad, *finite) ? grad.contiguous() : at::zeros_like(grad);
  topk_ef_cpu(g, residual, k, values, indices, g_sq, kept_sq);
  const auto scalar = residual.options().dtype(at::kDouble);
  return {values, indices, at::scalar_tensor(g_sq, scalar), at::scalar_tensor(kept_sq, scalar)};
}

// A bucket's layers one after the other (each layer's kernel is parallel already); the
// flags are read directly, as everywhere on the CPU.
std::tuple<at::Tensor, at::Tensor, at::Tensor> topk_ef_many(at::TensorList grads, at::TensorList residuals,
                                                            at::IntArrayRef ks,
                                                            const std::optional<at::Tensor>& finite) {
  const std::vector<int64_t> offsets = check_topk_ef_many_args(grads, residuals, ks, finite);
  const auto options = residuals[0].options();
  at::Tensor payload = at::empty({8 * offsets.back()}, options.dtype(at::kByte));
  const int64_t layers = static_cast<int64_t>(grads.size());
  at::Tensor g_sq = at::empty({layers}, options.dtype(at::kDouble)), kept_sq = at::empty_like(g_sq);
  const at::Tensor flags = finite ? finite->contiguous() : at::Tensor();
  for (int64_t i = 0; i < layers; ++i) {
    auto [values, indices] = payload_parts(payload, offsets[i], ks[i]);
    const bool ok = !finite || flags.const_data_ptr<bool>()[i];
    // A non-finite layer: the selection of the residual alone, made on a copy (rare path).
    at::Tensor residual = ok ? residuals[i] : residuals[i].clone();
    const at::Tensor grad = ok ? grads[i].contiguous() : at::zeros_like(grads[i], at::MemoryFormat::Contiguous);
    double gs = 0, kept = 0;
    topk_ef_cpu(grad, residual, ks[i], values, indices, gs, kept);
    if (!ok) values.fill_(std::numeric_limits<float>::quiet_NaN());
    g_sq.mutable_data_ptr<double>()[i] = gs;
    kept_sq.mutable_data_ptr<double>()[i] = kept;
  }
  return {payload, g_sq, kept_sq};
}

void restore_many_if_(at::TensorList residuals, const at::Tensor& payload, at::IntArrayRef ks,
                      const at::Tensor& flags) {
  const std::vector<int64_t> offsets = check_restore_many_args(residuals, payload, ks, flags);
  const at::Tensor f = flags.contiguous();
  for (size_t i = 0; i < residuals.size(); ++i) {
    if (!f.const_data_ptr<bool>()[i]) continue;
    auto [values, indices] = payload_parts(payload, offsets[i], ks[i]);
    const int64_t n = residuals[i].numel();
    float* r = residuals[i].mutable_data_ptr<float>();
    const float* v = values.const_data_ptr<float>();
    const int32_t* idx = indices.const_data_ptr<int32_t>();
    for (int64_t j = 0; j < ks[i]; ++j) {
      TORCH_CHECK(idx[j] >= 0 && idx[j] < n, "accordion::restore_many_if_: index ", idx[j], " of layer ", i,
                  " is outside [0, ", n, ")");
      r[idx[j]] = v[j];
    }
  }
}

// PowerSGD's phases for a bucket: one layer after the other (each layer's BLAS calls are
// parallel already), writing the payloads the bucket's collectives send; flags read directly.
at::Tensor powersgd_p_many(at::TensorList grads, at::TensorList residuals, at::TensorList qts,
                           const std::optional<at::Tensor>& finite) {
  const std::vector<int64_t> offsets = check_powersgd_p_many_args(grads, residuals, qts, finite);
  at::Tensor payload = at::empty({offsets.back()}, residuals[0].options());
  const at::Tensor flags = finite ? finite->contiguous() : at::Tensor();
  for (size_t i = 0; i < residuals.size(); ++i) {
    const at::Tensor p = payload.narrow(0, offsets[i], offsets[i + 1] - offsets[i]).view({residuals[i].size(0), -1});
    powersgd_p_cpu(grads[i], residuals[i], qts[i], p, !finite || flags.const_data_ptr<bool>()[i]);
  }
  return payload;
}

at::Tensor powersgd_qt_many(at::TensorList ps, at::TensorList residuals) {
  const std::vector<int64_t> offsets = check_powersgd_qt_many_args(ps, residuals);
  at::Tensor payload = at::empty({offsets.back()}, residuals[0].options());
  for (size_t i = 0; i < residuals.size(); ++i) {
    at::Tensor qt = payload.narrow(0, offsets[i], offsets[i + 1] - offsets[i]).view({ps[i].size(1), -1});
    powersgd_qt_cpu(ps[i], residuals[i], qt);
  }
  return payload;
}

void powersgd_finish_many_(at::TensorList residuals, at::TensorList outs, at::TensorList qts, at::TensorList ps,
                           at::TensorList qts_avg, const std::optional<at::Tensor>& ok) {
  check_powersgd_finish_many_args(residuals, outs, qts, ps, qts_avg, ok);
  const bool good = !ok || ok->item<bool>();
  for (size_t i = 0; i < residuals.size(); ++i) {
    at::Tensor out = outs[i];
    if (!good) {  // P and Q^T are NaN: M_hat is zero, the warm start is kept
      out.zero_();
      continue;
    }
    powersgd_finish_cpu(ps[i], qts_avg[i], out);
    const_cast<at::Tensor&>(qts[i]).copy_(qts_avg[i]);
  }
}

void powersgd_settle_many_(at::TensorList residuals, at::TensorList ps, at::TensorList qts, const at::Tensor& flag) {
  check_powersgd_settle_many_args(residuals, ps, qts, flag);
  if (residuals.empty() || !flag.item<bool>()) return;
  for (size_t i = 0; i < residuals.size(); ++i) powersgd_settle_cpu(residuals[i], ps[i], qts[i]);
}

at::Tensor sparse_average(const at::Tensor& values, const at::Tensor& indices, int64_t numel, int64_t world_size,
                          at::ScalarType dtype, const std::optional<at::Tensor>& bad) {
  check_sparse_average_args(values, indices, numel, world_size, dtype);
  check_bad_flag(bad, values);
  return sparse_average_cpu(values, indices, numel, world_size, dtype, bad ? bad->mutable_data_ptr<bool>() : nullptr);
}

void orthogonalize_(at::TensorList ps, double eps) {
  orthogonalize_cpu(orthogonalize_matrices(ps, eps), eps);
}

// On the CPU the flag is read directly (a memory load): nothing is touched when it is false,
// where a masked fill would still stream through every tensor.
void fill_if_(at::TensorList tensors, const at::Tensor& flag, const at::Scalar& value) {
  check_fill_if_args(tensors, flag);
  if (!flag.item<bool>()) return;
  for (const at::Tensor& t : tensors) const_cast<at::Tensor&>(t).fill_(value);
}

// The flag read directly, as in fill_if_: a step that went through touches nothing.
void restore_if_(const at::Tensor& residual, const at::Tensor& indices, const at::Tensor& values,
                 const at::Tensor& flag) {
  check_restore_if_args(residual, indices, values, flag);
  if (!flag.item<bool>()) return;
  const_cast<at::Tensor&>(residual).index_put_({indices.to(at::kLong)}, values);
}

// The flags read directly: a non-finite gradient adds nothing (its NaN payload filled), a
// skipped step touches nothing.
at::Tensor flush_whole(const at::Tensor& grad, const at::Tensor& residual, at::ScalarType dtype,
                       const std::optional<at::Tensor>& finite) {
  check_flush_whole_args(grad, residual, dtype, finite);
  at::Tensor out = at::empty(residual.sizes(), residual.options().dtype(dtype));
  if (finite && !finite->item<bool>()) return out.fill_(std::numeric_limits<double>::quiet_NaN());
  flush_whole_cpu(grad.contiguous(), residual, out);
  return out;
}

void settle_sent_(const at::Tensor& residual, at::ScalarType dtype, const at::Tensor& done) {
  check_settle_sent_args(residual, dtype, done);
  if (done.item<bool>()) settle_sent_cpu(residual, dtype);
}

}  // namespace

at::Tensor quantize_ef_(const at::Tensor& grad, const at::Tensor& residual, int64_t bits, int64_t chunk,
                        const std::optional<at::Tensor>& finite) {
  check_quantize_ef_args(grad, residual, bits, chunk, finite);
  at::Tensor payload = at::empty({quantize_payload_bytes(residual.numel(), bits, chunk)},
                                 residual.options().dtype(at::kByte));
  const bool add = !finite || finite->item<bool>();
  quantize_ef_cpu(grad.contiguous(), residual, bits, chunk, add, payload);
  return payload;
}

at::Tensor quantize_average(const at::Tensor& rows, int64_t numel, int64_t bits, int64_t chunk,
                            at::ScalarType dtype) {
  check_quantize_average_args(rows, numel, bits, chunk, dtype);
  at::Tensor total = quantize_average_cpu(rows, numel, bits, chunk);
  return dtype == at::kFloat ? total : total.to(dtype);
}

namespace {

at::Tensor quantize_chunks_ef_(const at::Tensor& grad, const at::Tensor& residual, int64_t bits, int64_t chunk,
                               int64_t k, double skip, const std::optional<at::Tensor>& finite) {
  check_quantize_chunks_ef_args(grad, residual, bits, chunk, k, skip, finite);
  at::Tensor payload = at::empty({quantize_chunks_payload_bytes(k, chunk, bits)}, residual.options().dtype(at::kByte));
  const bool add = !finite || finite->item<bool>();
  quantize_chunks_ef_cpu(grad.contiguous(), residual, bits, chunk, k, skip, add, payload);
  return payload;
}

std::tuple<at::Tensor, at::Tensor> quantize_chunks_average(const at::Tensor& rows, int64_t numel, int64_t k,
                                                           int64_t bits, int64_t chunk, at::ScalarType dtype) {
  check_quantize_chunks_average_args(rows, numel, k, bits, chunk, dtype);
  int64_t k_next = 0;
  at::Tensor mean = quantize_chunks_average_cpu(rows, numel, k, bits, chunk, dtype, k_next);
  return {mean, at::scalar_tensor(k_next, rows.options().dtype(at::kLong))};
}

void quantize_chunks_settle_(const at::Tensor& residual, const at::Tensor& indices, const at::Tensor& q,
                             const at::Tensor& scales, int64_t chunk, const at::Tensor& done) {
  check_quantize_chunks_settle_args(residual, indices, q, scales, chunk, done);
  if (done.item<bool>()) quantize_chunks_settle_cpu(residual, indices, q, scales, chunk);
}

at::Tensor sign_ef_(const at::Tensor& x, const at::Tensor& residual, const std::optional<at::Tensor>& finite) {
  check_sign_ef_args(x, residual, finite);
  at::Tensor payload = at::empty({sign_payload_bytes(residual.numel())}, residual.options().dtype(at::kByte));
  const bool add = !finite || finite->item<bool>();
  sign_ef_cpu(x.contiguous(), residual, add, payload);
  return payload;
}

at::Tensor sign_average(const at::Tensor& rows, int64_t numel, at::ScalarType dtype) {
  check_sign_average_args(rows, numel, dtype);
  at::Tensor mean = sign_average_cpu(rows, numel);
  return dtype == at::kFloat ? mean : mean.to(dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(accordion, CPU, m) {
  m.impl("ef_add_", &ef_add_<ef_add_out_cpu, grad_if_finite>);
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
  m.impl("sign_ef_", &sign_ef_);
  m.impl("sign_average", &sign_average);
}

}  // namespace accordion
