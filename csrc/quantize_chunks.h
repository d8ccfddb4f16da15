// Quantize's sparse chunks (Quantize(skip_energy=s); accordion_hvd/codecs/quantize_chunks.py
// says why and the rule): the payload's layout and the argument checks shared by every backend.
// The plain-torch reference is reference.quantize_chunks_ef / quantized_chunks_average.
//
// One rank's payload for k chunks of `chunk` entries (each part 4-byte aligned):
//   k_next (int32) | k chunk indices (int32, ascending) | k scales (float32) | k x chunk integers
// (int8 at 8 bits, int16 at 16), zero-padded to a multiple of 4 bytes.
//
// A chunk's energy is the sum of g^2 in float64, added as a fixed tree: the chunk zero-padded
// to P (the least power of two >= chunk), then x[i] += x[i + h] for h = P/2, ..., 1. Every
// backend and the reference add in that order, so every device picks the same chunks. The
// running sum of the energies in descending order, which sets k_next, is added in blocks of
// kSumBlock: within a block left to right, plus the block's offset (the sums of the blocks
// before it, left to right), so that a GPU sums the blocks in parallel.
#pragma once

#include <ATen/ATen.h>

#include "ops.h"
#include "quantize_chunks_layout.h"

namespace accordion {

inline void check_chunk_count(int64_t k, int64_t numel, int64_t chunk, const char* op) {
  const int64_t chunks = (numel + chunk - 1) / chunk;
  TORCH_CHECK(numel >= 1, op, ": the layer must have at least one entry, got numel ", numel);
  TORCH_CHECK(k >= 1 && k <= chunks, op, ": k (the chunks sent) must be in [1, ", chunks, "] for ", numel,
              " entries in chunks of ", chunk, ", got ", k);
}

inline void check_quantize_chunks_ef_args(const at::Tensor& grad, const at::Tensor& residual, int64_t bits,
                                          int64_t chunk, int64_t k, double skip,
                                          const std::optional<at::Tensor>& finite) {
  constexpr const char* op = "accordion::quantize_chunks_ef_";
  check_ef_add_args(grad, residual, op);
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous() && residual.dim() == 1, op,
              ": residual must be a contiguous 1-d float32 tensor, got ", residual.scalar_type(), " ",
              residual.sizes());
  check_quantize_levels(bits, chunk, op);
  check_chunk_count(k, residual.numel(), chunk, op);
  TORCH_CHECK(skip >= 0.0 && skip < 1.0, op, ": skip (the share of energy that may wait) must be in [0, 1), got ",
              skip);
  check_finite_flag(finite, grad, op);
}

inline void check_quantize_chunks_average_args(const at::Tensor& rows, int64_t numel, int64_t k, int64_t bits,
                                               int64_t chunk, at::ScalarType dtype) {
  constexpr const char* op = "accordion::quantize_chunks_average";
  check_quantize_levels(bits, chunk, op);
  check_chunk_count(k, numel, chunk, op);
  TORCH_CHECK(rows.layout() == at::kStrided && rows.scalar_type() == at::kByte && rows.dim() == 2 &&
              rows.stride(1) == 1 && rows.stride(0) % 4 == 0, op, ": rows must be a 2-d uint8 tensor (ranks x "
              "payload bytes) whose rows are contiguous and 4-byte aligned, got ", rows.scalar_type(), " ",
              rows.sizes(), " with strides ", rows.strides());
  TORCH_CHECK(rows.size(0) >= 1, op, ": rows must hold at least one rank's payload");
  TORCH_CHECK(rows.size(1) == quantize_chunks_payload_bytes(k, chunk, bits), op, ": each row must be a payload of ",
              quantize_chunks_payload_bytes(k, chunk, bits), " bytes for ", k, " chunks of ", chunk, " at ", bits,
              " bits, got ", rows.size(1));
  TORCH_CHECK(at::isFloatingType(dtype), op, ": dtype must be a floating-point type, got ", dtype);
}

inline void check_quantize_chunks_settle_args(const at::Tensor& residual, const at::Tensor& indices,
                                              const at::Tensor& q, const at::Tensor& scales, int64_t chunk,
                                              const at::Tensor& done) {
  constexpr const char* op = "accordion::quantize_chunks_settle_";
  check_contiguous_float(residual, op, "residual");
  TORCH_CHECK(residual.dim() == 1, op, ": residual must be 1-d, got ", residual.sizes());
  TORCH_CHECK(chunk >= 1, op, ": chunk must be >= 1, got ", chunk);
  TORCH_CHECK(indices.layout() == at::kStrided && indices.scalar_type() == at::kInt && indices.dim() == 1 &&
              indices.is_contiguous(), op, ": indices must be a contiguous 1-d int32 tensor, got ",
              indices.scalar_type(), " ", indices.sizes());
  check_chunk_count(indices.numel(), residual.numel(), chunk, op);
  TORCH_CHECK(q.layout() == at::kStrided && (q.scalar_type() == at::kChar || q.scalar_type() == at::kShort) &&
              q.dim() == 1 && q.is_contiguous() && q.numel() == indices.numel() * chunk, op,
              ": q must be a contiguous 1-d int8 or int16 tensor of indices x chunk = ", indices.numel() * chunk,
              " entries, got ", q.scalar_type(), " ", q.sizes());
  check_contiguous_float(scales, op, "scales");
  TORCH_CHECK(scales.numel() == indices.numel(), op, ": scales must have one entry per index (", indices.numel(),
              "), got ", scales.numel());
  TORCH_CHECK(done.layout() == at::kStrided && done.dim() == 0 && done.scalar_type() == at::kBool, op,
              ": done must be a 0-d bool tensor, got a ", done.dim(), "-d ", done.scalar_type(), " tensor");
  for (const at::Tensor* t : {&indices, &q, &scales, &done}) check_same_device(residual, *t, op, "every argument");
}

}  // namespace accordion
