// Launchers of the pure-CUDA kernels in this directory.
//
// This header and the .cu files use only the CUDA runtime (and CUB): no ATen, no c10/cuda.
// That keeps them compilable with nvcc on machines whose torch is a CPU build (CI compiles
// every .cu for sm_80 and sm_90 with `make cuda-check`). The torch side (checks, current
// stream, dtype mapping, registration) is ops_cuda.cpp, built only when torch has CUDA.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace accordion {
namespace cuda {

enum class DType : int { kFloat32, kFloat16, kBFloat16, kFloat64 };

// out[i] = grad[i] + residual[i] for i < n, computed in float (double for float64).
// residual and out have dtype `residual_dtype`; grad has `grad_dtype`, equal to it or a
// 16-bit type with a float32 residual. out may alias residual. Asynchronous on `stream`.
cudaError_t ef_add(const void* grad, DType grad_dtype, const void* residual, void* out,
                   DType residual_dtype, int64_t n, cudaStream_t stream);

// --- TopK with error feedback (topk_ef.cu) ---------------------------------------------------
// The same function as the CPU kernel (csrc/cpu/topk_ef.cpp), for every layer of a call with
// one fixed sequence of launches per 24 layers: g = grad + residual is written into
// `residual`; the k entries of largest |g| (ties: the lower index) are written to
// `values`/`indices` in ascending index order and zeroed in `residual`; g_sq and kept_sq
// (one double each, device memory) get the squared norms of g and of the kept part.
// residual is float32; every layer's grad has `grad_dtype`: float32, float16 or bfloat16.
// 0 <= k <= n <= 2^31 - 1. A layer's `finite` (a flag in device memory, or nullptr): where
// false the gradient is not added; with `poison` that layer's residual is also left as it
// was and its values are NaN (the indices still a valid selection of the residual).
// Everything runs on `stream` with no host synchronization; `workspace` must hold
// topk_ef_workspace_bytes(layers, count) bytes (any contents) and stay alive until the
// work is done.
struct TopKLayer {
  const void* grad;
  float* residual;
  int64_t n, k;
  float* values;
  int32_t* indices;
  double* g_sq;
  double* kept_sq;
  const bool* finite;
};
size_t topk_ef_workspace_bytes(const TopKLayer* layers, int count);
cudaError_t topk_ef(const TopKLayer* layers, int count, DType grad_dtype, bool poison, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream);

// Undoes a topk_ef where a layer's flag (device memory) is set: residual[indices[j]] =
// values[j] for its k kept entries (indices outside [0, n) skipped). One launch per 64 layers.
struct RestoreLayer {
  float* residual;
  const float* values;
  const int32_t* indices;
  const bool* flag;
  int64_t n, k;
};
cudaError_t topk_restore(const RestoreLayer* layers, int count, cudaStream_t stream);

// --- TopK's decode (sparse_average.cu) ----------------------------------------------------
// sum[indices[j]] += values[j] for the `count` gathered entries, taken as `segments` equal
// segments (one per rank) added one after the other, so that an index sent by several ranks
// is summed in rank order: the same bits on every rank, run after run. sum (numel float32)
// must be zeroed by the caller. An index outside [0, numel) is skipped, and for the smallest
// such position j, (j << 32 | the index's 32 bits) is written to *bad_position (which the
// caller sets to UINT64_MAX first).
cudaError_t sparse_scatter_add(const float* values, const int32_t* indices, int64_t count,
                               int64_t segments, float* sum, int64_t numel,
                               unsigned long long* bad_position, cudaStream_t stream);
// out[i] = sum[i] / world_size in out_dtype (float32, float16 or bfloat16); out may alias sum.
cudaError_t divide_convert(const float* sum, int64_t numel, int64_t world_size, void* out,
                           DType out_dtype, cudaStream_t stream);

// --- PowerSGD (powersgd.cu) ------------------------------------------------------------------
struct MatrixRef {
  void* data;     // contiguous, row-major
  int64_t rows;   // n
  int64_t cols;   // r
};
// Gram-Schmidt on the columns of every matrix, in place, all matrices in one launch (per
// batch of kMaxMatricesPerLaunch): column i is divided by (its norm + eps), then removed
// from the columns after it. Dot products and norms accumulate in double. dtype is float32
// or float64 for all matrices.
constexpr int kMaxMatricesPerLaunch = 200;
cudaError_t orthogonalize(const MatrixRef* matrices, int count, DType dtype, double eps,
                          cudaStream_t stream);
// PowerSGD for a whole bucket (powersgd_bucket.cu), one launch sequence per kLayersPerLaunch
// layers. Each phase reads the fields it names; the others may be anything. Every matrix is
// float32, contiguous, row-major; 1 <= r <= 16 (ops.h's kMaxBucketRank).
//   powersgd_p:      grad (n*m entries of grad_dtype), residual (n x m), qt (r x m), finite
//                    (a flag in device memory, or nullptr) -> residual = M = grad + e, p (n x r)
//                    = M Q; where *finite is false: residual untouched, p NaN.
//   powersgd_qt:     p, residual -> qt_out (r x m) = P^T M. workspace: powersgd_qt_workspace_bytes.
//   powersgd_finish: p, qt_avg (r x m) -> out (n*m entries of out_dtype) = P Q^T, qt = qt_avg;
//                    where *ok (device memory; nullptr: true) is false: out = 0, qt untouched.
//   powersgd_settle: p, qt_avg (the Q^T to use), *flag (device memory) -> residual -= P Q^T
//                    if *flag.
constexpr int kLayersPerLaunch = 32;
struct PowerSGDLayer {
  const void* grad;
  float* residual;
  float* qt;
  float* p;
  const float* qt_avg;
  float* qt_out;
  void* out;
  const bool* finite;
  int64_t n, m, r;
};
cudaError_t powersgd_p(const PowerSGDLayer* layers, int count, DType grad_dtype, cudaStream_t stream);
size_t powersgd_qt_workspace_bytes(const PowerSGDLayer* layers, int count);
cudaError_t powersgd_qt(const PowerSGDLayer* layers, int count, float* workspace, cudaStream_t stream);
cudaError_t powersgd_finish(const PowerSGDLayer* layers, int count, DType out_dtype, const bool* ok,
                            cudaStream_t stream);
cudaError_t powersgd_settle(const PowerSGDLayer* layers, int count, const bool* flag, cudaStream_t stream);


// --- A layer or buffer sent whole (whole.cu) ------------------------------------------------
// The CPU kernels' function (csrc/cpu/whole.cpp), bit for bit. flush_whole: residual (float32,
// n) += grad (float32, float16 or bfloat16) and out = residual in out_dtype, unless *finite is
// false (finite may be nullptr): then out is NaN and residual unchanged. settle_sent: if
// *done, residual -= residual rounded to sent_dtype (float16 or bfloat16). Asynchronous.
cudaError_t flush_whole(const void* grad, DType grad_dtype, float* residual, int64_t n, void* out,
                        DType out_dtype, const bool* finite, cudaStream_t stream);
cudaError_t settle_sent(float* residual, int64_t n, DType sent_dtype, const bool* done, cudaStream_t stream);

// --- Quantize (quantize.cu) -------------------------------------------------------------------
// The CPU kernels' function (csrc/cpu/quantize.cpp), bit for bit. quantize_ef: residual
// (float32, n entries) += grad (float32, float16 or bfloat16; not where *finite is false) and
// this rank's payload written: ceil(n / chunk) float32 scales (NaN where *finite is false),
// then n int8 (bits 8) or int16 (bits 16); the caller zeroes the padding. finite may be
// nullptr. quantize_average: out (float32, n) = the mean over `ranks` payloads, row r at
// rows + r * row_stride. Asynchronous on `stream`.
cudaError_t quantize_ef(const void* grad, DType grad_dtype, float* residual, int64_t n, int bits, int64_t chunk,
                        const bool* finite, void* payload, cudaStream_t stream);
cudaError_t quantize_average(const void* rows, int64_t ranks, int64_t row_stride, int64_t n, int bits,
                             int64_t chunk, float* out, cudaStream_t stream);

// --- Quantize's sparse chunks (quantize_chunks.cu) --------------------------------------------
// The CPU kernels' function (csrc/cpu/quantize_chunks.cpp; layout and the order of every sum:
// csrc/quantize_chunks.h), bit for bit, asynchronous on `stream`, nothing read on the host.
// quantize_chunks_ef: residual (float32, n) += grad (not where *finite is false; finite may be
// nullptr) and the payload (zeroed by the caller) of the k chunks of largest energy, its scales
// NaN where *finite is false. 1 <= k <= chunks, chunk <= kMaxSparseChunk (a chunk's energy tree
// is in shared memory). `workspace`: quantize_chunks_workspace_bytes(n, chunk, k) bytes, alive
// until the work is done.
// quantize_chunks_average: out (float32, n) = the mean over `ranks` payloads of k chunks (row r
// at rows + r * row_stride), each entry summed in rank order; a chunk index outside the layer
// is skipped (never written); *k_next (int64, device memory) = the largest header, clamped to
// [1, chunks]. quantize_chunks_settle: if *done, residual -= q * s over the k chunks sent.
constexpr int64_t kMaxSparseChunk = 4096;
size_t quantize_chunks_workspace_bytes(int64_t n, int64_t chunk, int64_t k);
cudaError_t quantize_chunks_ef(const void* grad, DType grad_dtype, float* residual, int64_t n, int bits, int64_t chunk,
                               int64_t k, double skip, const bool* finite, void* payload, void* workspace,
                               cudaStream_t stream);
cudaError_t quantize_chunks_average(const void* rows, int64_t ranks, int64_t row_stride, int64_t n, int bits,
                                    int64_t chunk, int64_t k, float* out, int64_t* k_next, cudaStream_t stream);
cudaError_t quantize_chunks_settle(float* residual, int64_t n, int64_t chunk, int64_t k, const int32_t* indices,
                                   const void* q, int bits, const float* scales, const bool* done,
                                   cudaStream_t stream);

}  // namespace cuda
}  // namespace accordion
