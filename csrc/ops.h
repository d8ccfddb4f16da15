// The accordion:: operators, shared by every backend: the argument checks (so that CPU and
// CUDA reject the same inputs with the same messages) and the parts of an op that do not
// depend on the device. Schemas: ops.cpp (one TORCH_LIBRARY block). Implementations: one
// TORCH_LIBRARY_IMPL per backend, cpu/ops_cpu.cpp and cuda/ops_cuda.cpp, each beside its
// kernels. Python entry points and fake (meta) implementations: accordion_hvd/ops.py.
#pragma once

#include <ATen/ATen.h>

#include <limits>
#include <optional>
#include <utility>
#include <vector>

namespace accordion {

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* op, const char* names) {
  TORCH_CHECK(a.device() == b.device(), op, ": ", names, " must be on the same device, got ", a.device(), " and ",
              b.device());
}

inline void check_contiguous_float(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.layout() == at::kStrided, op, ": ", name, " must be a dense (strided) tensor, got ", t.layout());
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got strides ", t.strides());
}

// ef_add_: the error-feedback add shared by the codecs, residual += grad.
// The residual may be kept in float32 for half/bfloat16 gradients, so that small
// corrections that would round away in 16 bits keep accumulating; the sum has the
// residual's dtype.
inline void check_ef_add_args(const at::Tensor& grad, const at::Tensor& residual, const char* op) {
  TORCH_CHECK(grad.layout() == at::kStrided && residual.layout() == at::kStrided,
              op, ": grad and residual must be dense (strided) tensors, got ", grad.layout(),
              " and ", residual.layout());
  check_same_device(grad, residual, op, "grad and residual");
  TORCH_CHECK(grad.sizes() == residual.sizes(), op,
              ": grad and residual must have the same shape, got ", grad.sizes(), " and ",
              residual.sizes());
  const auto g = grad.scalar_type(), r = residual.scalar_type();
  TORCH_CHECK(at::isFloatingType(g), op, ": grad must be a floating-point tensor, got ", g);
  TORCH_CHECK(r == g || (r == at::kFloat && (g == at::kHalf || g == at::kBFloat16)), op,
              ": residual must have grad's dtype, or float32 for a half/bfloat16 grad; got grad ",
              g, " and residual ", r);
}

// ef_add_ on a backend whose kernel is EfAddOut(grad, residual, out): out =
// grad + residual over contiguous tensors, out may alias residual.
using EfAddOut = void (*)(const at::Tensor& grad, const at::Tensor& residual, at::Tensor& out);

// The optional `finite` argument of the error-feedback ops: a 0-d bool tensor on the
// gradient's device, computed there (no host round-trip). Where it is false the gradient is
// not added, so a step skipped for a non-finite gradient leaves the error feedback as it was.
// Each backend says how it applies the flag: GradIfFinite returns the gradient to add, or
// nothing when there is nothing to add (the CPU reads the flag; CUDA masks on the device).
using GradIfFinite = std::optional<at::Tensor> (*)(const at::Tensor& grad, const at::Tensor& finite);

inline void check_finite_flag(const std::optional<at::Tensor>& finite, const at::Tensor& grad, const char* op) {
  if (!finite) return;
  TORCH_CHECK(finite->layout() == at::kStrided && finite->dim() == 0 && finite->scalar_type() == at::kBool, op,
              ": finite must be a 0-d bool tensor, got a ", finite->dim(), "-d ", finite->scalar_type(), " tensor");
  check_same_device(*finite, grad, op, "finite and grad");
}

// In-place form used by the codecs: residual += grad, turning the error-feedback buffer into
// the tensor to compress without allocating another gradient-sized buffer.
template <EfAddOut kernel, GradIfFinite gate>
void ef_add_(const at::Tensor& grad, const at::Tensor& residual, const std::optional<at::Tensor>& finite) {
  constexpr const char* op = "accordion::ef_add_";
  check_ef_add_args(grad, residual, op);
  check_finite_flag(finite, grad, op);
  TORCH_CHECK(residual.is_contiguous(), op, ": residual must be contiguous, got strides ", residual.strides());
  at::Tensor g = grad;
  if (finite) {
    std::optional<at::Tensor> gated = gate(grad, *finite);
    if (!gated) return;
    g = *gated;
  }
  at::Tensor out = residual;
  kernel(g.contiguous(), residual, out);
}

// topk_ef: fused TopK with error feedback; residual <- (grad + residual) with the kept
// entries zeroed. Returns the preallocated (values, indices) the kernels fill.
inline std::tuple<at::Tensor, at::Tensor> topk_ef_outputs(const at::Tensor& grad, const at::Tensor& residual,
                                                          int64_t k, const std::optional<at::Tensor>& finite) {
  constexpr const char* op = "accordion::topk_ef";
  check_ef_add_args(grad, residual, op);
  check_finite_flag(finite, grad, op);
  check_contiguous_float(residual, op, "residual");
  const int64_t n = residual.numel();
  TORCH_CHECK(n <= std::numeric_limits<int32_t>::max(), op, ": at most 2^31 - 1 entries (int32 indices), got ", n);
  TORCH_CHECK(k >= 0 && k <= n, op, ": k must be in [0, numel = ", n, "], got ", k);
  return {at::empty({k}, residual.options()), at::empty({k}, residual.options().dtype(at::kInt))};
}

// topk_ef_many: topk_ef for every layer of a bucket in one call. Layer i's k_i values
// (float32) and k_i indices (int32) go to one uint8 payload, at byte 8 * (k_0 + ... + k_{i-1}):
// values first, then indices: the bytes a bucket's allgather sends, with no copy. `finite`
// (optional, 1-d bool, one flag per layer) works as the codec needs for a non-finite
// gradient: that layer's residual is left exactly as it was and its values are NaN (the
// indices are a valid selection of the residual alone), so every rank sees the fault in the
// gathered data and there is nothing to undo for that layer. Both checks return the layers'
// offsets in the payload, in entries (the prefix sums of ks; the last one is the total).
inline std::vector<int64_t> check_topk_ef_many_args(at::TensorList grads, at::TensorList residuals, at::IntArrayRef ks,
                                          const std::optional<at::Tensor>& finite) {
  constexpr const char* op = "accordion::topk_ef_many";
  const size_t layers = grads.size();
  TORCH_CHECK(layers >= 1, op, ": grads must hold at least one tensor");
  TORCH_CHECK(residuals.size() == layers && ks.size() == layers, op,
              ": grads, residuals and ks must have the same length, got ", layers, ", ", residuals.size(), " and ",
              ks.size());
  std::vector<int64_t> offsets{0};
  offsets.reserve(layers + 1);
  for (size_t i = 0; i < layers; ++i) {
    check_ef_add_args(grads[i], residuals[i], op);
    check_contiguous_float(residuals[i], op, "every residual");
    check_same_device(residuals[i], residuals[0], op, "every residual");
    const int64_t n = residuals[i].numel();
    TORCH_CHECK(n <= std::numeric_limits<int32_t>::max(), op, ": at most 2^31 - 1 entries per layer (int32 indices), "
                "got ", n, " in layer ", i);
    TORCH_CHECK(ks[i] >= 0 && ks[i] <= n, op, ": ks[", i, "] must be in [0, numel = ", n, "], got ", ks[i]);
    offsets.push_back(offsets.back() + ks[i]);
  }
  if (finite) {
    TORCH_CHECK(finite->layout() == at::kStrided && finite->dim() == 1 && finite->scalar_type() == at::kBool &&
                finite->numel() == static_cast<int64_t>(layers), op, ": finite must be a 1-d bool tensor of ", layers,
                " flags (one per layer), got a ", finite->dim(), "-d ", finite->scalar_type(), " tensor of ",
                finite->numel());
    check_same_device(*finite, residuals[0], op, "finite and the residuals");
  }
  return offsets;
}

// A layer's values and indices inside a topk_ef_many payload (uint8, 8 bytes per entry).
inline std::pair<at::Tensor, at::Tensor> payload_parts(const at::Tensor& payload, int64_t offset, int64_t k) {
  return {payload.narrow(0, 8 * offset, 4 * k).view(at::kFloat),
          payload.narrow(0, 8 * offset + 4 * k, 4 * k).view(at::kInt)};
}

// restore_many_if_: undo a topk_ef_many where a skipped step needs it: layer i's kept entries
// go back into residuals[i] if flags[i] (1-d bool on their device).
inline std::vector<int64_t> check_restore_many_args(at::TensorList residuals, const at::Tensor& payload, at::IntArrayRef ks,
                                          const at::Tensor& flags) {
  constexpr const char* op = "accordion::restore_many_if_";
  const size_t layers = residuals.size();
  TORCH_CHECK(ks.size() == layers, op, ": residuals and ks must have the same length, got ", layers, " and ",
              ks.size());
  std::vector<int64_t> offsets{0};
  for (size_t i = 0; i < layers; ++i) {
    check_contiguous_float(residuals[i], op, "every residual");
    check_same_device(residuals[i], payload, op, "every residual and the payload");
    TORCH_CHECK(ks[i] >= 0 && ks[i] <= residuals[i].numel(), op, ": ks[", i, "] must be in [0, numel = ",
                residuals[i].numel(), "], got ", ks[i]);
    offsets.push_back(offsets.back() + ks[i]);
  }
  TORCH_CHECK(payload.layout() == at::kStrided && payload.scalar_type() == at::kByte && payload.dim() == 1 &&
              payload.is_contiguous() && payload.numel() == 8 * offsets.back(), op,
              ": payload must be a contiguous 1-d uint8 tensor of 8 * sum(ks) = ", 8 * offsets.back(),
              " bytes, got ", payload.scalar_type(), " ", payload.sizes());
  TORCH_CHECK(flags.layout() == at::kStrided && flags.dim() == 1 && flags.scalar_type() == at::kBool &&
              flags.numel() == static_cast<int64_t>(layers), op, ": flags must be a 1-d bool tensor of ", layers,
              " flags, got a ", flags.dim(), "-d ", flags.scalar_type(), " tensor of ", flags.numel());
  check_same_device(flags, payload, op, "flags and the payload");
  return offsets;
}

// PowerSGD for a whole bucket (the codec's phases, codecs/powersgd.py, a bucket per call).
// Every layer is a float32 residual e (n x m, contiguous) with Q^T (r x m, float32,
// contiguous, 1 <= r <= kMaxBucketRank); a bucket's P and Q^T payloads are flat float32
// buffers, layer after layer: P (n x r) at the prefix sum of n * r, Q^T (r x m) at the prefix
// sum of r * m. The ranks are capped so that a CUDA thread keeps a row's r sums in registers.
constexpr int64_t kMaxBucketRank = 16;

inline void check_bucket_layer(const at::Tensor& residual, const at::Tensor& qt, const at::Tensor& first,
                               size_t i, const char* op) {
  check_contiguous_float(residual, op, "every residual");
  check_contiguous_float(qt, op, "every Q^T");
  TORCH_CHECK(residual.dim() == 2 && qt.dim() == 2 && qt.size(1) == residual.size(1), op, ": layer ", i,
              ": the residual must be 2-d (n x m) and Q^T (r x m), got ", residual.sizes(), " and ", qt.sizes());
  TORCH_CHECK(qt.size(0) >= 1 && qt.size(0) <= kMaxBucketRank, op, ": layer ", i, ": rank must be in [1, ",
              kMaxBucketRank, "], got ", qt.size(0));
  check_same_device(residual, first, op, "every tensor of the bucket");
  check_same_device(qt, first, op, "every tensor of the bucket");
}

inline void check_layer_flags(const std::optional<at::Tensor>& flags, size_t layers, const at::Tensor& first,
                              const char* op, const char* name) {
  if (!flags) return;
  TORCH_CHECK(flags->layout() == at::kStrided && flags->dim() == 1 && flags->scalar_type() == at::kBool &&
              flags->numel() == static_cast<int64_t>(layers), op, ": ", name, " must be a 1-d bool tensor of ", layers,
              " flags (one per layer), got a ", flags->dim(), "-d ", flags->scalar_type(), " tensor of ",
              flags->numel());
  check_same_device(*flags, first, op, "the flags and the residuals");
}

inline void check_bucket_flag(const std::optional<at::Tensor>& flag, const at::Tensor& first, const char* op,
                              const char* name) {
  if (!flag) return;
  TORCH_CHECK(flag->layout() == at::kStrided && flag->dim() == 0 && flag->scalar_type() == at::kBool, op, ": ", name,
              " must be a 0-d bool tensor, got a ", flag->dim(), "-d ", flag->scalar_type(), " tensor");
  check_same_device(*flag, first, op, "the flag and the residuals");
}

// powersgd_p_many: per layer, M = grad + e written into e, and P = M Q into the P payload.
// `finite` (optional, 1-d bool, one flag per layer): where false the gradient is not added
// (e is left as it was) and that layer's P is NaN, so every rank sees the fault in the
// averaged P. Returns the offsets of the layers' P in the payload (the last: its length).
inline std::vector<int64_t> check_powersgd_p_many_args(at::TensorList grads, at::TensorList residuals,
                                                       at::TensorList qts, const std::optional<at::Tensor>& finite) {
  constexpr const char* op = "accordion::powersgd_p_many";
  const size_t layers = residuals.size();
  TORCH_CHECK(layers >= 1, op, ": residuals must hold at least one tensor");
  TORCH_CHECK(grads.size() == layers && qts.size() == layers, op,
              ": grads, residuals and qts must have the same length, got ", grads.size(), ", ", layers, " and ",
              qts.size());
  std::vector<int64_t> offsets{0};
  for (size_t i = 0; i < layers; ++i) {
    check_bucket_layer(residuals[i], qts[i], residuals[0], i, op);
    TORCH_CHECK(grads[i].layout() == at::kStrided && grads[i].is_contiguous() &&
                grads[i].numel() == residuals[i].numel(), op, ": layer ", i, ": grad must be a contiguous tensor of ",
                residuals[i].numel(), " entries (any shape), got ", grads[i].sizes(), " with strides ",
                grads[i].strides());
    check_ef_add_args(grads[i].view(residuals[i].sizes()), residuals[i], op);
    offsets.push_back(offsets.back() + residuals[i].size(0) * qts[i].size(0));
  }
  check_layer_flags(finite, layers, residuals[0], op, "finite");
  return offsets;
}

// powersgd_qt_many: per layer, Q^T = P^T M (r x m) into the Q payload, from each layer's
// (orthogonalized, averaged) P (n x r, float32, contiguous) and its M (in e). Returns the
// offsets of the layers' Q^T in the payload.
inline std::vector<int64_t> check_powersgd_qt_many_args(at::TensorList ps, at::TensorList residuals) {
  constexpr const char* op = "accordion::powersgd_qt_many";
  const size_t layers = residuals.size();
  TORCH_CHECK(layers >= 1, op, ": residuals must hold at least one tensor");
  TORCH_CHECK(ps.size() == layers, op, ": ps and residuals must have the same length, got ", ps.size(), " and ",
              layers);
  std::vector<int64_t> offsets{0};
  for (size_t i = 0; i < layers; ++i) {
    check_contiguous_float(ps[i], op, "every P");
    check_contiguous_float(residuals[i], op, "every residual");
    TORCH_CHECK(residuals[i].dim() == 2 && ps[i].dim() == 2 && ps[i].size(0) == residuals[i].size(0), op,
                ": layer ", i, ": the residual must be 2-d (n x m) and P (n x r), got ", residuals[i].sizes(), " and ",
                ps[i].sizes());
    TORCH_CHECK(ps[i].size(1) >= 1 && ps[i].size(1) <= kMaxBucketRank, op, ": layer ", i, ": rank must be in [1, ",
                kMaxBucketRank, "], got ", ps[i].size(1));
    check_same_device(ps[i], residuals[0], op, "every tensor of the bucket");
    check_same_device(residuals[i], residuals[0], op, "every tensor of the bucket");
    offsets.push_back(offsets.back() + ps[i].size(1) * residuals[i].size(1));
  }
  return offsets;
}

// powersgd_finish_many_: per layer, with the averaged Q^T: M_hat = P Q^T written to out (the
// gradient's memory, float32, float16 or bfloat16, n * m entries, contiguous) and the layer's
// Q^T (the next step's warm start) set to the average. With `ok` (0-d bool) false some rank's
// gradient was not finite (P and Q^T are NaN): out is zero and Q^T is left as it was. The
// error feedback is settled later (powersgd_settle_many_), once the step is known not to be
// skipped: until then e holds M, so a skipped step loses nothing.
inline void check_powersgd_finish_many_args(at::TensorList residuals, at::TensorList outs, at::TensorList qts,
                                            at::TensorList ps, at::TensorList qts_avg,
                                            const std::optional<at::Tensor>& ok) {
  constexpr const char* op = "accordion::powersgd_finish_many_";
  const size_t layers = residuals.size();
  TORCH_CHECK(outs.size() == layers && qts.size() == layers && ps.size() == layers && qts_avg.size() == layers, op,
              ": residuals, outs, qts, ps and qts_avg must have the same length, got ", layers, ", ", outs.size(),
              ", ", qts.size(), ", ", ps.size(), " and ", qts_avg.size());
  for (size_t i = 0; i < layers; ++i) {
    check_bucket_layer(residuals[i], qts[i], residuals[0], i, op);
    check_contiguous_float(ps[i], op, "every P");
    check_contiguous_float(qts_avg[i], op, "every averaged Q^T");
    TORCH_CHECK(ps[i].dim() == 2 && ps[i].size(0) == residuals[i].size(0) && ps[i].size(1) == qts[i].size(0), op,
                ": layer ", i, ": P must be n x r = ", residuals[i].size(0), " x ", qts[i].size(0), ", got ",
                ps[i].sizes());
    TORCH_CHECK(qts_avg[i].sizes() == qts[i].sizes(), op, ": layer ", i, ": the averaged Q^T must be ", qts[i].sizes(),
                ", got ", qts_avg[i].sizes());
    const at::Tensor& out = outs[i];
    TORCH_CHECK(out.layout() == at::kStrided && out.is_contiguous() && out.numel() == residuals[i].numel() &&
                (out.scalar_type() == at::kFloat || out.scalar_type() == at::kHalf ||
                 out.scalar_type() == at::kBFloat16), op, ": layer ", i, ": out must be a contiguous float32, float16 "
                "or bfloat16 tensor of ", residuals[i].numel(), " entries, got ", out.scalar_type(), " ",
                out.sizes());
    TORCH_CHECK(!out.is_same(residuals[i]), op, ": layer ", i, ": out must not be the residual");
    for (const at::Tensor* t : {&ps[i], &qts_avg[i], &out}) check_same_device(*t, residuals[0], op, "every tensor of the bucket");
  }
  if (layers) check_bucket_flag(ok, residuals[0], op, "ok");
}

// powersgd_settle_many_: e = M - P Q^T for every layer when `flag` (0-d bool, on the device)
// is true: the step went through (and no rank's gradient was non-finite). The CPU reads the
// flag; the CUDA kernel reads it first and returns at once when it is false.
inline void check_powersgd_settle_many_args(at::TensorList residuals, at::TensorList ps, at::TensorList qts,
                                          const at::Tensor& flag) {
  constexpr const char* op = "accordion::powersgd_settle_many_";
  const size_t layers = residuals.size();
  TORCH_CHECK(ps.size() == layers && qts.size() == layers, op,
              ": residuals, ps and qts must have the same length, got ", layers, ", ", ps.size(), " and ", qts.size());
  for (size_t i = 0; i < layers; ++i) {
    check_bucket_layer(residuals[i], qts[i], residuals[0], i, op);
    check_contiguous_float(ps[i], op, "every P");
    TORCH_CHECK(ps[i].dim() == 2 && ps[i].size(0) == residuals[i].size(0) && ps[i].size(1) == qts[i].size(0), op,
                ": layer ", i, ": P must be n x r = ", residuals[i].size(0), " x ", qts[i].size(0), ", got ",
                ps[i].sizes());
    check_same_device(ps[i], residuals[0], op, "every tensor of the bucket");
  }
  if (layers) check_bucket_flag(flag, residuals[0], op, "flag");
}

// sparse_average: TopK's decode, the average over ranks of their sparse vectors, densely.
inline void check_sparse_average_args(const at::Tensor& values, const at::Tensor& indices, int64_t numel,
                                      int64_t world_size, at::ScalarType dtype) {
  constexpr const char* op = "accordion::sparse_average";
  check_contiguous_float(values, op, "values");
  TORCH_CHECK(indices.layout() == at::kStrided && indices.scalar_type() == at::kInt && indices.is_contiguous(),
              op, ": indices must be a contiguous int32 tensor, got ", indices.scalar_type());
  check_same_device(values, indices, op, "values and indices");
  TORCH_CHECK(values.dim() == 1 && indices.dim() == 1 && values.numel() == indices.numel(), op,
              ": values and indices must be 1-d of the same length, got ", values.sizes(), " and ", indices.sizes());
  TORCH_CHECK(numel >= 0 && numel <= std::numeric_limits<int32_t>::max(), op,
              ": numel must be in [0, 2^31 - 1], got ", numel);
  TORCH_CHECK(world_size >= 1, op, ": world_size must be >= 1, got ", world_size);
  TORCH_CHECK(at::isFloatingType(dtype), op, ": dtype must be a floating-point type, got ", dtype);
}

// sparse_average's optional `bad`: a 0-d bool tensor on the values' device. Given, an index
// outside [0, numel) is skipped and sets it (on the device: the caller reads it later, once
// per step, and fails then); without it such an index raises at once.
inline void check_bad_flag(const std::optional<at::Tensor>& bad, const at::Tensor& values) {
  constexpr const char* op = "accordion::sparse_average";
  if (!bad) return;
  TORCH_CHECK(bad->layout() == at::kStrided && bad->dim() == 0 && bad->scalar_type() == at::kBool, op,
              ": bad must be a 0-d bool tensor, got a ", bad->dim(), "-d ", bad->scalar_type(), " tensor");
  check_same_device(*bad, values, op, "bad and values");
}

// orthogonalize_: Gram-Schmidt on the columns of every matrix in ps, in place, in one call.
// Returns the non-empty matrices, for the kernel.
inline std::vector<at::Tensor> orthogonalize_matrices(at::TensorList ps, double eps) {
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
    TORCH_CHECK(p.device() == ps[0].device(), op, ": every matrix must be on one device, got ps[0] on ",
                ps[0].device(), " and ps[", i, "] on ", p.device());
    if (p.numel() > 0) mats.push_back(p);
  }
  return mats;
}

// fill_if_: fill every tensor with a value when a 0-d bool flag on their device is true (zero
// a skipped step's results, settle error feedback, NaN for a non-finite gradient's payload),
// without the host reading the flag where that would wait for the device.
inline void check_fill_if_args(at::TensorList tensors, const at::Tensor& flag) {
  constexpr const char* op = "accordion::fill_if_";
  TORCH_CHECK(flag.layout() == at::kStrided && flag.dim() == 0 && flag.scalar_type() == at::kBool, op,
              ": flag must be a 0-d bool tensor, got a ", flag.dim(), "-d ", flag.scalar_type(), " tensor");
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].layout() == at::kStrided, op, ": tensors[", i, "] must be a dense (strided) tensor, got ",
                tensors[i].layout());
    TORCH_CHECK(tensors[i].device() == flag.device(), op, ": tensors[", i, "] is on ", tensors[i].device(),
                ", the flag on ", flag.device());
  }
}

// restore_if_: residual[indices] = values when a 0-d bool flag on their device is true (TopK
// puts a skipped step's selection back into its error feedback), without the host reading
// the flag where that would wait for the device.
inline void check_restore_if_args(const at::Tensor& residual, const at::Tensor& indices, const at::Tensor& values,
                                  const at::Tensor& flag) {
  constexpr const char* op = "accordion::restore_if_";
  check_contiguous_float(residual, op, "residual");
  check_contiguous_float(values, op, "values");
  TORCH_CHECK(indices.layout() == at::kStrided && indices.scalar_type() == at::kInt && indices.dim() == 1 &&
              indices.numel() == values.numel(), op, ": indices must be 1-d int32 of values' length, got ",
              indices.scalar_type(), " ", indices.sizes(), " for values ", values.sizes());
  TORCH_CHECK(flag.layout() == at::kStrided && flag.dim() == 0 && flag.scalar_type() == at::kBool, op,
              ": flag must be a 0-d bool tensor, got a ", flag.dim(), "-d ", flag.scalar_type(), " tensor");
  check_same_device(residual, indices, op, "residual and indices");
  check_same_device(residual, values, op, "residual and values");
  check_same_device(residual, flag, op, "residual and flag");
}

// quantize_ef_ and quantize_average: Quantize's encode and decode (accordion_hvd/codecs/
// quantize.py; the plain-torch reference is reference.quantize_ef / quantized_average).
// One rank's payload for a layer of n entries: ceil(n / chunk) float32 scales, then n int8
// (bits 8) or int16 (bits 16), zero-padded to a multiple of 4 bytes.
inline int64_t quantize_payload_bytes(int64_t numel, int64_t bits, int64_t chunk) {
  const int64_t chunks = (numel + chunk - 1) / chunk;
  return 4 * chunks + (numel * bits + 31) / 32 * 4;
}

inline void check_quantize_levels(int64_t bits, int64_t chunk, const char* op) {
  TORCH_CHECK(bits == 8 || bits == 16, op, ": bits must be 8 or 16, got ", bits);
  TORCH_CHECK(chunk >= 1, op, ": chunk must be >= 1, got ", chunk);
}

inline void check_quantize_ef_args(const at::Tensor& grad, const at::Tensor& residual, int64_t bits, int64_t chunk,
                                   const std::optional<at::Tensor>& finite) {
  constexpr const char* op = "accordion::quantize_ef_";
  check_ef_add_args(grad, residual, op);
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous() && residual.dim() == 1, op,
              ": residual must be a contiguous 1-d float32 tensor, got ", residual.scalar_type(), " ",
              residual.sizes());
  check_quantize_levels(bits, chunk, op);
  check_finite_flag(finite, grad, op);
}

inline void check_quantize_average_args(const at::Tensor& rows, int64_t numel, int64_t bits, int64_t chunk,
                                        at::ScalarType dtype) {
  constexpr const char* op = "accordion::quantize_average";
  check_quantize_levels(bits, chunk, op);
  TORCH_CHECK(numel >= 0, op, ": numel must be >= 0, got ", numel);
  TORCH_CHECK(rows.layout() == at::kStrided && rows.scalar_type() == at::kByte && rows.dim() == 2 &&
              rows.stride(1) == 1, op, ": rows must be a 2-d uint8 tensor (ranks x payload bytes) whose rows are "
              "contiguous, got ", rows.scalar_type(), " ", rows.sizes(), " with strides ", rows.strides());
  TORCH_CHECK(rows.size(0) >= 1, op, ": rows must hold at least one rank's payload");
  TORCH_CHECK(rows.size(1) == quantize_payload_bytes(numel, bits, chunk), op, ": each row must be a payload of ",
              quantize_payload_bytes(numel, bits, chunk), " bytes for ", numel, " entries at ", bits,
              " bits in chunks of ", chunk, ", got ", rows.size(1));
  TORCH_CHECK(at::isFloatingType(dtype), op, ": dtype must be a floating-point type, got ", dtype);
}

// flush_whole and settle_sent_: a layer, or a front end's flat buffer, sent whole in a wire
// dtype (float16 or bfloat16 at DENSE16, float32 at DENSE) with its rounding kept in error
// feedback (accordion_hvd/codecs/_common.py; the plain-torch reference is reference.
// flush_whole / settle_sent). flush_whole: residual (float32) += grad, unless `finite` is
// false, and a new tensor of residual in `dtype`, NaN everywhere if `finite` is false.
// settle_sent_: if `done`, residual -= residual rounded to `dtype` (what the wire carried),
// else nothing (a skipped step keeps all of g).
inline void check_wire_dtype(at::ScalarType dtype, const char* op) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": dtype must be float32, float16 or bfloat16, got ", dtype);
}

inline void check_flush_whole_args(const at::Tensor& grad, const at::Tensor& residual, at::ScalarType dtype,
                                   const std::optional<at::Tensor>& finite) {
  constexpr const char* op = "accordion::flush_whole";
  check_ef_add_args(grad, residual, op);
  check_contiguous_float(residual, op, "residual");
  check_wire_dtype(dtype, op);
  check_finite_flag(finite, grad, op);
}

inline void check_settle_sent_args(const at::Tensor& residual, at::ScalarType dtype, const at::Tensor& done) {
  constexpr const char* op = "accordion::settle_sent_";
  check_contiguous_float(residual, op, "residual");
  check_wire_dtype(dtype, op);
  TORCH_CHECK(done.layout() == at::kStrided && done.dim() == 0 && done.scalar_type() == at::kBool, op,
              ": done must be a 0-d bool tensor, got a ", done.dim(), "-d ", done.scalar_type(), " tensor");
  check_same_device(residual, done, op, "residual and done");
}

// sign_ef_ and sign_average: Sign's encode and decode (accordion_hvd/codecs/sign.py; the
// plain-torch reference is reference.sign_ef / sign_average). One rank's payload for a layer
// of n entries: one float32 scale, then n bits (bit i of byte j: entry 8j + i is >= 0),
// zero-padded to a multiple of 4 bytes.
inline int64_t sign_payload_bytes(int64_t numel) { return 4 + (numel + 31) / 32 * 4; }

inline void check_sign_ef_args(const at::Tensor& x, const at::Tensor& residual,
                               const std::optional<at::Tensor>& finite) {
  constexpr const char* op = "accordion::sign_ef_";
  check_ef_add_args(x, residual, op);
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous() && residual.dim() == 1, op,
              ": residual must be a contiguous 1-d float32 tensor, got ", residual.scalar_type(), " ",
              residual.sizes());
  check_finite_flag(finite, x, op);
}

inline void check_sign_average_args(const at::Tensor& rows, int64_t numel, at::ScalarType dtype) {
  constexpr const char* op = "accordion::sign_average";
  TORCH_CHECK(numel >= 0, op, ": numel must be >= 0, got ", numel);
  TORCH_CHECK(rows.layout() == at::kStrided && rows.scalar_type() == at::kByte && rows.dim() == 2 &&
              rows.stride(1) == 1, op, ": rows must be a 2-d uint8 tensor (ranks x payload bytes) whose rows are "
              "contiguous, got ", rows.scalar_type(), " ", rows.sizes(), " with strides ", rows.strides());
  TORCH_CHECK(rows.size(0) >= 1, op, ": rows must hold at least one rank's payload");
  TORCH_CHECK(rows.size(1) == sign_payload_bytes(numel), op, ": each row must be a payload of ",
              sign_payload_bytes(numel), " bytes for ", numel, " entries, got ", rows.size(1));
  TORCH_CHECK(at::isFloatingType(dtype), op, ": dtype must be a floating-point type, got ", dtype);
}

}  // namespace accordion
