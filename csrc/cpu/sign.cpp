// Sign's CPU kernels (accordion_hvd/codecs/sign.py; reference.sign_ef and reference.sign_average
// are the plain-torch references, tests/test_sign.py holds these to them).
//
// sign_ef: one pass over memory. Blocks of kBlock entries (a multiple of 8, so that every
// byte of bits belongs to one block) each write g = x + e into e, add g^2 in float64 and pack
// the block's bits while it is in cache; the blocks' sums are then added in block order, so
// the scale sqrt(sum / n) does not depend on the number of threads. (The reference adds in
// torch's order: the scale may differ in its last bit, the bits never.)
//
// sign_average: the mean over ranks of s * (+1 or -1), added in rank order for each entry (the
// reference's order), then divided by the number of ranks. The rows may be a slice of a
// gathered bucket (a row stride other than their length).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu/kernels.h"
#include "ops.h"

namespace accordion {
namespace {

constexpr int64_t kBlock = 8192;  // entries per block of the sum (a multiple of 8)

template <typename X>
void sign_blocks(const X* x, float* e, int64_t n, bool add, uint8_t* bits, double* sums) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t lo = b * kBlock, hi = std::min(n, lo + kBlock);
      double sum = 0.0;
      for (int64_t i = lo; i < hi; ++i) {
        const float g = add ? e[i] + static_cast<float>(x[i]) : e[i];
        e[i] = g;
        sum += static_cast<double>(g) * static_cast<double>(g);
      }
      sums[b] = sum;
      for (int64_t j = lo / 8; j < (hi + 7) / 8; ++j) {
        uint8_t byte = 0;
        const int64_t top = std::min<int64_t>(8, hi - 8 * j);
        for (int64_t k = 0; k < top; ++k) byte |= static_cast<uint8_t>(e[8 * j + k] >= 0.f) << k;
        bits[j] = byte;
      }
    }
  });
}

}  // namespace

void sign_ef_cpu(const at::Tensor& x, const at::Tensor& residual, bool add, at::Tensor& payload) {
  const int64_t n = residual.numel(), blocks = (n + kBlock - 1) / kBlock;
  uint8_t* bytes = payload.mutable_data_ptr<uint8_t>();
  std::memset(bytes, 0, payload.numel());  // (the padding to 4 bytes)
  std::vector<double> sums(blocks, 0.0);
  float* e = residual.mutable_data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "sign_ef_cpu", [&] {
    sign_blocks<scalar_t>(x.const_data_ptr<scalar_t>(), e, n, add, bytes + 4, sums.data());
  });
  double total = 0.0;
  for (const double s : sums) total += s;
  const float scale = !add ? std::numeric_limits<float>::quiet_NaN()
                           : n ? static_cast<float>(std::sqrt(total / static_cast<double>(n))) : 0.f;
  std::memcpy(bytes, &scale, sizeof(float));
}

at::Tensor sign_average_cpu(const at::Tensor& rows, int64_t numel) {
  at::Tensor out = at::empty({numel}, rows.options().dtype(at::kFloat));
  const uint8_t* data = rows.const_data_ptr<uint8_t>();
  const int64_t ranks = rows.size(0), stride = rows.stride(0);
  std::vector<float> scales(ranks);
  for (int64_t r = 0; r < ranks; ++r) std::memcpy(&scales[r], data + r * stride, sizeof(float));
  float* o = out.mutable_data_ptr<float>();
  const float world = static_cast<float>(ranks);
  at::parallel_for(0, (numel + 7) / 8, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t lo = 8 * j, hi = std::min(numel, lo + 8);
      for (int64_t i = lo; i < hi; ++i) o[i] = 0.f;
      for (int64_t r = 0; r < ranks; ++r) {
        const uint8_t byte = data[r * stride + 4 + j];
        const float s = scales[r];
        for (int64_t i = lo; i < hi; ++i) o[i] += (byte >> (i - lo)) & 1 ? s : -s;
      }
      for (int64_t i = lo; i < hi; ++i) o[i] /= world;
    }
  });
  return out;
}

}  // namespace accordion
