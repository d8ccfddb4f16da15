// CUDA kernels of PowerSGD's non-GEMM steps (the products go through cuBLAS: torch mm/bmm).
//
// orthogonalize: Gram-Schmidt on every layer's P (n x r, row-major) in one launch, one block
// per matrix. P is tall and thin, so the work per matrix is a few passes over n rows with a
// block-wide reduction after each: per column i, one pass for its norm, one that normalizes
// it, then for the later columns (eight at a time, so the partial sums stay in registers) one
// pass for their dot products with column i and one that removes column i from them. Sums
// are kept in double per thread and reduced with warp shuffles, then across warps. Column i
// is divided by (norm + eps), so a zero column stays finite, as in PyTorch's PowerSGD hook.

#include "cuda/convert.cuh"
#include "cuda/kernels.h"

namespace accordion {
namespace cuda {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kChunk = 8;  // later columns handled per pass

struct Batch {
  MatrixRef m[kMaxMatricesPerLaunch];
};

// Sums kChunk values over the block; every thread gets the totals.
__device__ void block_sums(double (&v)[kChunk], double (*shared)[kChunk]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int c = 0; c < kChunk; ++c)
    for (int off = 16; off > 0; off /= 2) v[c] += __shfl_down_sync(0xffffffffu, v[c], off);
  if (lane == 0)
#pragma unroll
    for (int c = 0; c < kChunk; ++c) shared[warp][c] = v[c];
  __syncthreads();
#pragma unroll
  for (int c = 0; c < kChunk; ++c) {
    double total = 0;
    for (int w = 0; w < kWarps; ++w) total += shared[w][c];  // the same order in every thread
    v[c] = total;
  }
  __syncthreads();  // shared is reused by the next call
}

template <typename T>
__global__ void __launch_bounds__(kThreads) gram_schmidt_kernel(const Batch batch, double eps) {
  __shared__ double shared[kWarps][kChunk];
  const MatrixRef ref = batch.m[blockIdx.x];
  T* p = static_cast<T*>(ref.data);
  const int64_t n = ref.rows, r = ref.cols;
  for (int64_t i = 0; i < r; ++i) {
    double acc[kChunk] = {};
    for (int64_t row = threadIdx.x; row < n; row += kThreads) {
      const double x = p[row * r + i];
      acc[0] += x * x;
    }
    block_sums(acc, shared);
    const T denom = static_cast<T>(sqrt(acc[0])) + static_cast<T>(eps);
    for (int64_t row = threadIdx.x; row < n; row += kThreads) p[row * r + i] /= denom;
    __syncthreads();
    for (int64_t j0 = i + 1; j0 < r; j0 += kChunk) {
      double dots[kChunk] = {};
      for (int64_t row = threadIdx.x; row < n; row += kThreads) {
        const double ci = p[row * r + i];
#pragma unroll
        for (int c = 0; c < kChunk; ++c)
          if (j0 + c < r) dots[c] += ci * p[row * r + j0 + c];
      }
      block_sums(dots, shared);
      for (int64_t row = threadIdx.x; row < n; row += kThreads) {
        const T ci = p[row * r + i];
#pragma unroll
        for (int c = 0; c < kChunk; ++c)
          if (j0 + c < r) p[row * r + j0 + c] -= ci * static_cast<T>(dots[c]);
      }
      __syncthreads();
    }
  }
}

}  // namespace

cudaError_t orthogonalize(const MatrixRef* matrices, int count, DType dtype, double eps, cudaStream_t stream) {
  if (dtype != DType::kFloat32 && dtype != DType::kFloat64) return cudaErrorInvalidValue;
  for (int first = 0; first < count; first += kMaxMatricesPerLaunch) {
    Batch batch;
    const int here = count - first < kMaxMatricesPerLaunch ? count - first : kMaxMatricesPerLaunch;
    for (int j = 0; j < here; ++j) batch.m[j] = matrices[first + j];
    if (dtype == DType::kFloat32)
      gram_schmidt_kernel<float><<<here, kThreads, 0, stream>>>(batch, eps);
    else
      gram_schmidt_kernel<double><<<here, kThreads, 0, stream>>>(batch, eps);
    if (cudaError_t err = cudaGetLastError()) return err;
  }
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace accordion
