// The CPU kernels (ATen tensors in, contiguous and checked by ops.h's checks first).
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace accordion {

// out = grad + residual elementwise; out may alias residual (cpu/ef_add.cpp).
void ef_add_out_cpu(const at::Tensor& grad, const at::Tensor& residual, at::Tensor& out);

// topk_ef (cpu/topk_ef.cpp): residual (float32) is updated in place; values (float32) and
// indices (int32) have k entries, preallocated by the caller.
void topk_ef_cpu(const at::Tensor& grad, const at::Tensor& residual, int64_t k, at::Tensor& values,
                 at::Tensor& indices, double& g_sq, double& kept_sq);

// sparse_average (cpu/sparse_average.cpp).
// With `bad` (a bool the caller owns) an index out of range is skipped and sets *bad; with
// nullptr it raises.
at::Tensor sparse_average_cpu(const at::Tensor& values, const at::Tensor& indices, int64_t numel,
                              int64_t world_size, at::ScalarType out_dtype, bool* bad = nullptr);

// orthogonalize_ (cpu/powersgd.cpp).
void orthogonalize_cpu(const std::vector<at::Tensor>& ps, double eps);

// PowerSGD for a whole bucket, one layer per call (cpu/powersgd_bucket.cpp): M = grad + e into
// e and P = M Q (skipped, P NaN, when !add); Q^T = P^T M; out = P Q^T in out's dtype; e -= P Q^T.
void powersgd_p_cpu(const at::Tensor& grad, const at::Tensor& residual, const at::Tensor& qt, const at::Tensor& p,
                    bool add);
void powersgd_qt_cpu(const at::Tensor& p, const at::Tensor& residual, at::Tensor& qt);
void powersgd_finish_cpu(const at::Tensor& p, const at::Tensor& qt_avg, at::Tensor& out);
void powersgd_settle_cpu(const at::Tensor& residual, const at::Tensor& p, const at::Tensor& qt);

// A layer or buffer sent whole (cpu/whole.cpp), residual float32: e += grad and out = e in out's
// dtype; e -= e rounded to `sent` (float32: e = 0).
void flush_whole_cpu(const at::Tensor& grad, const at::Tensor& residual, at::Tensor& out);
void settle_sent_cpu(const at::Tensor& residual, at::ScalarType sent);

// Quantize (cpu/quantize.cpp): e += grad (unless !add) and this rank's payload written (see
// ops.h quantize_payload_bytes), its scales NaN when !add; and the mean over the rows' payloads,
// dequantized, in float32.
void quantize_ef_cpu(const at::Tensor& grad, const at::Tensor& residual, int64_t bits, int64_t chunk, bool add,
                     at::Tensor& payload);
at::Tensor quantize_average_cpu(const at::Tensor& rows, int64_t numel, int64_t bits, int64_t chunk);

// Quantize's sparse chunks (cpu/quantize_chunks.cpp; layout: quantize_chunks.h): e += grad
// (unless !add) and the payload of the k chunks of largest energy written, its scales NaN when
// !add; the mean over the rows' payloads in `dtype` (summed in float32) and the next k (the
// largest k_next, at most every chunk); e -= q * s over the sent chunks.
void quantize_chunks_ef_cpu(const at::Tensor& grad, const at::Tensor& residual, int64_t bits, int64_t chunk,
                            int64_t k, double skip, bool add, at::Tensor& payload);
at::Tensor quantize_chunks_average_cpu(const at::Tensor& rows, int64_t numel, int64_t k, int64_t bits, int64_t chunk,
                                       at::ScalarType dtype, int64_t& k_next);
void quantize_chunks_settle_cpu(const at::Tensor& residual, const at::Tensor& indices, const at::Tensor& q,
                                const at::Tensor& scales, int64_t chunk);

// Sign (cpu/sign.cpp): e += x (unless !add) and this rank's payload written (see ops.h
// sign_payload_bytes), its scale NaN when !add; and the mean over the rows' payloads, decoded,
// in float32.
void sign_ef_cpu(const at::Tensor& x, const at::Tensor& residual, bool add, at::Tensor& payload);
at::Tensor sign_average_cpu(const at::Tensor& rows, int64_t numel);

}  // namespace accordion
