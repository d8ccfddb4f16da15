// Quantize's CPU kernels (accordion_hvd/codecs/quantize.py; reference.quantize_ef and
// reference.quantized_average are the plain-torch references, tests/test_quantize_ops.py holds
// these to them bit for bit).
//
// quantize_ef: one pass over memory per chunk. The chunk's g = grad + e is written into e
// while its max |g| is found; the chunk (in cache now) is then scaled and rounded into the
// payload. The arithmetic is the reference's, in float32: s = max|g| / qmax, q = round(g / s)
// half to even (nearbyint under the default rounding mode), clamped to +-qmax; a chunk of
// zeros has s = 0 and sends zeros. Chunks are independent: parallel over chunks.
//
// quantize_average: the mean over ranks of q * s, summed in rank order for each entry (the
// reference's order, so the sums round alike), then divided by the number of ranks. The rows
// may be a slice of a gathered bucket (a row stride other than their length).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "cpu/kernels.h"
#include "cpu/quantize_chunk.h"
#include "ops.h"

namespace accordion {
namespace {

constexpr int64_t kGrain = 16;  // chunks per parallel task (512 entries each by default)

template <typename G, typename Q>
void quantize_chunks(const G* grad, float* e, int64_t n, int64_t chunk, float qmax, bool add, float* scales, Q* q) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  at::parallel_for(0, chunks, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t lo = c * chunk, hi = std::min(n, lo + chunk);
      float amax = 0.f;
      bool nan = false;
      for (int64_t i = lo; i < hi; ++i) {
        const float g = add ? e[i] + static_cast<float>(grad[i]) : e[i];
        e[i] = g;
        const float a = std::abs(g);
        nan |= std::isnan(a);
        amax = a > amax ? a : amax;
      }
      const float s = cpu::chunk_scale(amax, nan, qmax);
      cpu::round_chunk(e + lo, hi - lo, s, qmax, q + lo);
      scales[c] = add ? s : std::numeric_limits<float>::quiet_NaN();  // a non-finite gradient: NaN scales
    }
  });
}

template <typename Q>
void average_chunks(const uint8_t* rows, int64_t ranks, int64_t row_stride, int64_t n, int64_t chunk, float* out) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  at::parallel_for(0, chunks, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t lo = c * chunk, hi = std::min(n, lo + chunk);
      for (int64_t i = lo; i < hi; ++i) out[i] = 0.f;
      for (int64_t r = 0; r < ranks; ++r) {
        const uint8_t* row = rows + r * row_stride;
        float s;
        std::memcpy(&s, row + 4 * c, sizeof(float));
        const Q* q = reinterpret_cast<const Q*>(row + 4 * chunks);
        for (int64_t i = lo; i < hi; ++i) out[i] += static_cast<float>(q[i]) * s;
      }
      const float world = static_cast<float>(ranks);
      for (int64_t i = lo; i < hi; ++i) out[i] /= world;
    }
  });
}

template <typename Q>
void quantize_ef_typed(const at::Tensor& grad, const at::Tensor& residual, int64_t chunk, bool add,
                       at::Tensor& payload) {
  const int64_t n = residual.numel(), chunks = (n + chunk - 1) / chunk;
  uint8_t* bytes = payload.mutable_data_ptr<uint8_t>();
  float* scales = reinterpret_cast<float*>(bytes);
  Q* q = reinterpret_cast<Q*>(bytes + 4 * chunks);
  const float qmax = static_cast<float>(std::numeric_limits<Q>::max());
  float* e = residual.mutable_data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "quantize_ef_cpu", [&] {
    quantize_chunks<scalar_t, Q>(grad.const_data_ptr<scalar_t>(), e, n, chunk, qmax, add, scales, q);
  });
  const int64_t used = 4 * chunks + n * static_cast<int64_t>(sizeof(Q));
  std::memset(bytes + used, 0, payload.numel() - used);  // the padding to 4 bytes
}

}  // namespace

void quantize_ef_cpu(const at::Tensor& grad, const at::Tensor& residual, int64_t bits, int64_t chunk, bool add,
                     at::Tensor& payload) {
  if (bits == 8) {
    quantize_ef_typed<int8_t>(grad, residual, chunk, add, payload);
  } else {
    quantize_ef_typed<int16_t>(grad, residual, chunk, add, payload);
  }
}

at::Tensor quantize_average_cpu(const at::Tensor& rows, int64_t numel, int64_t bits, int64_t chunk) {
  at::Tensor out = at::empty({numel}, rows.options().dtype(at::kFloat));
  const uint8_t* data = rows.const_data_ptr<uint8_t>();
  if (bits == 8) {
    average_chunks<int8_t>(data, rows.size(0), rows.stride(0), numel, chunk, out.mutable_data_ptr<float>());
  } else {
    average_chunks<int16_t>(data, rows.size(0), rows.stride(0), numel, chunk, out.mutable_data_ptr<float>());
  }
  return out;
}

}  // namespace accordion
