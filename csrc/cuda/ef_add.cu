// CUDA kernel of accordion::ef_add_ (see kernels.h). A grid-stride elementwise stream; the
// arithmetic is done in float (double for float64), as torch's add does, so CPU, CUDA and
// the plain-torch reference agree bit for bit.
#include "cuda/convert.cuh"
#include "cuda/kernels.h"

namespace accordion {
namespace cuda {
namespace {

template <typename G, typename R>
__global__ void ef_add_kernel(const G* __restrict__ grad, const R* residual, R* out, int64_t n) {
  using acc_t = typename Math<R>::type;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = down<R>(static_cast<acc_t>(up(grad[i])) + up(residual[i]));
  }
}

template <typename G, typename R>
cudaError_t launch(const void* grad, const void* residual, void* out, int64_t n, cudaStream_t stream) {
  constexpr int kThreads = 256;
  ef_add_kernel<G, R><<<grid_for(n, kThreads), kThreads, 0, stream>>>(
      static_cast<const G*>(grad), static_cast<const R*>(residual), static_cast<R*>(out), n);
  return cudaGetLastError();
}

}  // namespace

cudaError_t ef_add(const void* grad, DType grad_dtype, const void* residual, void* out,
                   DType residual_dtype, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (grad_dtype == residual_dtype) {
    switch (residual_dtype) {
      case DType::kFloat32: return launch<float, float>(grad, residual, out, n, stream);
      case DType::kFloat64: return launch<double, double>(grad, residual, out, n, stream);
      case DType::kFloat16: return launch<__half, __half>(grad, residual, out, n, stream);
      case DType::kBFloat16: return launch<__nv_bfloat16, __nv_bfloat16>(grad, residual, out, n, stream);
    }
  } else if (residual_dtype == DType::kFloat32) {
    if (grad_dtype == DType::kFloat16) return launch<__half, float>(grad, residual, out, n, stream);
    if (grad_dtype == DType::kBFloat16) return launch<__nv_bfloat16, float>(grad, residual, out, n, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace accordion
