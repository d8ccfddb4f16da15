// Quantize's sparse chunks on the CPU (accordion_hvd/codecs/quantize_chunks.py; layout and
// energy order: quantize_chunks.h). tests/test_quantize_chunks_ops.py holds these bit for bit to
// reference.quantize_chunks_ef and reference.quantized_chunks_average.
//
// quantize_chunks_ef: pass 1, parallel over chunks: e += grad and the chunk's energy (its g
// is in cache for the tree). Then on one thread: the chunks ordered by energy (stable, largest
// first), the running sum in that order (float64, in quantize_chunks.h's order) for k_next, the first
// k indices sorted ascending. Pass 2, parallel over the k chosen chunks: scale and round, with
// quantize.cpp's arithmetic (cpu/quantize_chunk.h). Chunks not chosen are not
// read again: on a step that sends few chunks of a large embedding, that is most of it.
//
// quantize_chunks_average: one pass over the output, parallel over chunks: each chunk the sum of
// the ranks that sent it, in rank order (the reference's sum order), divided by the ranks, or
// zeros.
//
// quantize_chunks_settle: e -= q * s over the sent chunks only (elsewhere e - 0 = e).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "cpu/kernels.h"
#include "cpu/quantize_chunk.h"
#include "quantize_chunks.h"

namespace accordion {
namespace {

constexpr int64_t kGrain = 16;  // chunks per parallel task

// The energy of one chunk's g[0, len): quantize_chunks.h's tree over p >= len entries.
inline double tree_energy(const float* g, int64_t len, int64_t p, double* buf) {
  for (int64_t i = 0; i < len; ++i) buf[i] = static_cast<double>(g[i]) * static_cast<double>(g[i]);
  for (int64_t i = len; i < p; ++i) buf[i] = 0.0;
  for (int64_t h = p / 2; h >= 1; h /= 2) {
    for (int64_t i = 0; i < h; ++i) buf[i] += buf[i + h];
  }
  return buf[0];
}

template <typename G>
void add_and_measure(const G* grad, float* e, int64_t n, int64_t chunk, bool add, double* energy) {
  const int64_t chunks = (n + chunk - 1) / chunk, p = pow2_at_least(chunk);
  at::parallel_for(0, chunks, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<double> buf(p);
    for (int64_t c = begin; c < end; ++c) {
      const int64_t lo = c * chunk, hi = std::min(n, lo + chunk);
      if (add) {
        for (int64_t i = lo; i < hi; ++i) e[i] += static_cast<float>(grad[i]);
      }
      energy[c] = tree_energy(e + lo, hi - lo, p, buf.data());
    }
  });
}

// k_next and the k chosen chunks, ascending (module comment).
int32_t choose(const std::vector<double>& energy, int64_t k, double skip, int32_t* indices) {
  const int64_t chunks = static_cast<int64_t>(energy.size());
  std::vector<int64_t> order(chunks);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return energy[a] > energy[b]; });
  std::vector<double> cum(chunks);  // quantize_chunks.h's running sum
  double offset = 0.0;
  for (int64_t start = 0; start < chunks; start += kSumBlock) {
    double local = 0.0;
    for (int64_t j = start; j < std::min(chunks, start + kSumBlock); ++j) {
      local += energy[order[j]];
      cum[j] = offset + local;
    }
    offset += local;
  }
  const double bound = (1.0 - skip) * cum[chunks - 1];
  int64_t below = 0;
  for (int64_t j = 0; j < chunks; ++j) below += cum[j] < bound;
  for (int64_t i = 0; i < k; ++i) indices[i] = static_cast<int32_t>(order[i]);
  std::sort(indices, indices + k);
  return static_cast<int32_t>(std::min(below + 1, chunks));
}

template <typename Q>
void quantize_chosen(const float* e, int64_t n, int64_t chunk, int64_t k, const int32_t* indices, bool add,
                     float* scales, Q* q) {
  const float qmax = static_cast<float>(std::numeric_limits<Q>::max());
  at::parallel_for(0, k, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t lo = static_cast<int64_t>(indices[i]) * chunk, len = std::min(n, lo + chunk) - lo;
      const float s = cpu::chunk_scale(e + lo, len, qmax);
      Q* out = q + i * chunk;
      cpu::round_chunk(e + lo, len, s, qmax, out);
      for (int64_t j = len; j < chunk; ++j) out[j] = 0;  // the last chunk's zero padding
      scales[i] = add ? s : std::numeric_limits<float>::quiet_NaN();  // a non-finite gradient: NaN scales
    }
  });
}

template <typename Q>
void ef_typed(const at::Tensor& grad, const at::Tensor& residual, int64_t chunk, int64_t k, double skip, bool add,
              at::Tensor& payload) {
  const int64_t n = residual.numel(), chunks = (n + chunk - 1) / chunk;
  float* e = residual.mutable_data_ptr<float>();
  std::vector<double> energy(chunks);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "quantize_chunks_ef_cpu", [&] {
    add_and_measure<scalar_t>(grad.const_data_ptr<scalar_t>(), e, n, chunk, add, energy.data());
  });
  uint8_t* bytes = payload.mutable_data_ptr<uint8_t>();
  int32_t* indices = reinterpret_cast<int32_t*>(bytes + 4);
  const int32_t k_next = choose(energy, k, skip, indices);
  std::memcpy(bytes, &k_next, sizeof(k_next));
  float* scales = reinterpret_cast<float*>(bytes + 4 + 4 * k);
  Q* q = reinterpret_cast<Q*>(bytes + 4 + 8 * k);
  quantize_chosen<Q>(e, n, chunk, k, indices, add, scales, q);
  const int64_t used = 4 + 8 * k + k * chunk * static_cast<int64_t>(sizeof(Q));
  std::memset(bytes + used, 0, payload.numel() - used);  // the padding to 4 bytes
}

// One pass over the output: each chunk written once, as zeros or as the sum over the ranks that
// sent it, in rank order from 0.f (the reference's order), divided by the ranks and rounded to
// the output's dtype (as torch's .to() rounds: to nearest, ties to even).
template <typename Q, typename O>
void average_typed(const uint8_t* rows, int64_t ranks, int64_t stride, int64_t n, int64_t chunk, int64_t k, O* out) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  std::vector<int32_t> slot(chunks * ranks, -1);  // [chunk][rank]: where that rank sent it
  for (int64_t r = 0; r < ranks; ++r) {  // indices from other ranks: checked before any write
    const int32_t* indices = reinterpret_cast<const int32_t*>(rows + r * stride + 4);
    for (int64_t i = 0; i < k; ++i) {
      TORCH_CHECK(indices[i] >= 0 && indices[i] < chunks && (i == 0 || indices[i] > indices[i - 1]),
                  "accordion::quantize_chunks_average: rank ", r, "'s payload is not a sparse-chunk payload of this "
                  "layer: its chunk index at position ", i, " is ", indices[i], ", expected ascending indices in "
                  "[0, ", chunks, ")");
      slot[indices[i] * ranks + r] = static_cast<int32_t>(i);
    }
  }
  const float world = static_cast<float>(ranks);
  at::parallel_for(0, chunks, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(chunk);
    for (int64_t c = begin; c < end; ++c) {
      const int64_t lo = c * chunk, len = std::min(n, lo + chunk) - lo;
      const int32_t* from = slot.data() + c * ranks;
      if (std::all_of(from, from + ranks, [](int32_t i) { return i < 0; })) {
        std::fill(out + lo, out + lo + len, static_cast<O>(0.f));  // no rank sent it: 0 / ranks
        continue;
      }
      std::fill(sum.begin(), sum.begin() + len, 0.f);
      for (int64_t r = 0; r < ranks; ++r) {
        const int32_t i = from[r];
        if (i < 0) continue;
        const uint8_t* row = rows + r * stride;
        const float s = reinterpret_cast<const float*>(row + 4 + 4 * k)[i];
        const Q* q = reinterpret_cast<const Q*>(row + 4 + 8 * k) + static_cast<int64_t>(i) * chunk;
        for (int64_t j = 0; j < len; ++j) sum[j] += static_cast<float>(q[j]) * s;
      }
      for (int64_t j = 0; j < len; ++j) out[lo + j] = static_cast<O>(sum[j] / world);
    }
  });
}

template <typename Q>
void settle_typed(float* e, int64_t n, int64_t chunk, int64_t k, const int32_t* indices, const Q* q,
                  const float* scales) {
  at::parallel_for(0, k, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t lo = static_cast<int64_t>(indices[i]) * chunk, len = std::min(n, lo + chunk) - lo;
      const float s = scales[i];
      for (int64_t j = 0; j < len; ++j) e[lo + j] -= static_cast<float>(q[i * chunk + j]) * s;
    }
  });
}

}  // namespace

void quantize_chunks_ef_cpu(const at::Tensor& grad, const at::Tensor& residual, int64_t bits, int64_t chunk,
                            int64_t k, double skip, bool add, at::Tensor& payload) {
  if (bits == 8) {
    ef_typed<int8_t>(grad, residual, chunk, k, skip, add, payload);
  } else {
    ef_typed<int16_t>(grad, residual, chunk, k, skip, add, payload);
  }
}

at::Tensor quantize_chunks_average_cpu(const at::Tensor& rows, int64_t numel, int64_t k, int64_t bits, int64_t chunk,
                                       at::ScalarType dtype, int64_t& k_next) {
  const int64_t ranks = rows.size(0), chunks = (numel + chunk - 1) / chunk;
  const uint8_t* data = rows.const_data_ptr<uint8_t>();
  int32_t most = 1;
  for (int64_t r = 0; r < ranks; ++r) {
    int32_t need;
    std::memcpy(&need, data + r * rows.stride(0), sizeof(need));
    most = std::max(most, need);
  }
  k_next = std::min<int64_t>(most, chunks);
  at::Tensor out = at::empty({numel}, rows.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "quantize_chunks_average_cpu", [&] {
    if (bits == 8) {
      average_typed<int8_t, scalar_t>(data, ranks, rows.stride(0), numel, chunk, k, out.mutable_data_ptr<scalar_t>());
    } else {
      average_typed<int16_t, scalar_t>(data, ranks, rows.stride(0), numel, chunk, k, out.mutable_data_ptr<scalar_t>());
    }
  });
  return out;
}

void quantize_chunks_settle_cpu(const at::Tensor& residual, const at::Tensor& indices, const at::Tensor& q,
                                const at::Tensor& scales, int64_t chunk) {
  const int64_t n = residual.numel(), k = indices.numel(), chunks = (n + chunk - 1) / chunk;
  const int32_t* idx = indices.const_data_ptr<int32_t>();
  for (int64_t i = 0; i < k; ++i) {
    TORCH_CHECK(idx[i] >= 0 && idx[i] < chunks && (i == 0 || idx[i] > idx[i - 1]),
                "accordion::quantize_chunks_settle_: indices must be ascending chunk indices in [0, ", chunks,
                "), got ", idx[i], " at position ", i);
  }
  float* e = residual.mutable_data_ptr<float>();
  const float* s = scales.const_data_ptr<float>();
  if (q.scalar_type() == at::kChar) {
    settle_typed<int8_t>(e, n, chunk, k, idx, q.const_data_ptr<int8_t>(), s);
  } else {
    settle_typed<int16_t>(e, n, chunk, k, idx, q.const_data_ptr<int16_t>(), s);
  }
}

}  // namespace accordion
