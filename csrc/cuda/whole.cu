// CUDA kernels of accordion::flush_whole and accordion::settle_sent_ (see kernels.h): one
// grid-stride pass each, the flags read from device memory by the kernels (the host never
// waits for them). The arithmetic is the CPU kernels' (cpu/whole.cpp), bit for bit.
#include "cuda/convert.cuh"
#include "cuda/kernels.h"

namespace accordion {
namespace cuda {
namespace {

constexpr int kThreads = 256;

template <typename G, typename O>
__global__ void flush_whole_kernel(const G* __restrict__ grad, float* e, O* out, int64_t n, const bool* finite) {
  const bool add = finite == nullptr || *finite;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    if (add) {
      const float g = up(grad[i]) + e[i];
      e[i] = g;
      out[i] = down<O>(g);
    } else {
      out[i] = down<O>(__int_as_float(0x7fc00000));  // NaN: every rank sees the fault
    }
  }
}

template <typename S>
__global__ void settle_sent_kernel(float* e, int64_t n, const bool* done) {
  if (!*done) return;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    e[i] -= up(down<S>(e[i]));
  }
}

template <typename G>
cudaError_t flush_with_grad(const G* grad, float* e, int64_t n, void* out, DType out_dtype, const bool* finite,
                            cudaStream_t stream) {
  return with_out_type(out_dtype, out, [&](auto* o) {
    flush_whole_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(grad, e, o, n, finite);
  });
}

}  // namespace

cudaError_t flush_whole(const void* grad, DType grad_dtype, float* residual, int64_t n, void* out,
                        DType out_dtype, const bool* finite, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  switch (grad_dtype) {
    case DType::kFloat32: return flush_with_grad(static_cast<const float*>(grad), residual, n, out, out_dtype, finite, stream);
    case DType::kFloat16: return flush_with_grad(static_cast<const __half*>(grad), residual, n, out, out_dtype, finite, stream);
    case DType::kBFloat16:
      return flush_with_grad(static_cast<const __nv_bfloat16*>(grad), residual, n, out, out_dtype, finite, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t settle_sent(float* residual, int64_t n, DType sent_dtype, const bool* done, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  switch (sent_dtype) {
    case DType::kFloat16: settle_sent_kernel<__half><<<grid_for(n, kThreads), kThreads, 0, stream>>>(residual, n, done); break;
    case DType::kBFloat16:
      settle_sent_kernel<__nv_bfloat16><<<grid_for(n, kThreads), kThreads, 0, stream>>>(residual, n, done);
      break;
    default: return cudaErrorInvalidValue;  // float32: the caller zeroes under the flag
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace accordion
