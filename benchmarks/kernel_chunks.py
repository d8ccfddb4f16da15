"""Quantize's sparse chunks for benchmarks/kernels.py: a layer's inputs, our kernels' step
(csrc/cpu/quantize_chunks.cpp) and the codec's torch-op path it replaces, and the bytes each
must move.

The gradient is an embedding's: a fifth of its rows (chunks of 512) are hot, the rest 20x
smaller, so that ``skip_energy=0.05`` sends about a fifth of the chunks (k from the layer's
first step, as the codec agrees it). *step* is one rank's work per layer: encode (e += grad,
energies, the choice, the payload) and settle (e -= what was sent); *average* the decode of
four ranks' payloads.
"""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace

import torch

from accordion_hvd import ops
from accordion_hvd.codecs import quantize_chunks as sparse
from accordion_hvd.codecs.quantize import quantize_flat

CHUNK, BITS, SKIP, WORLD = 512, 8, 0.05, 4


def embedding_grad(n: int, dtype: torch.dtype, device, seed: int = 0) -> torch.Tensor:
    return _embedding_grad(n, seed).to(device=device, dtype=dtype, copy=True)  # the pool's entries differ


@lru_cache(maxsize=8)
def _embedding_grad(n: int, seed: int) -> torch.Tensor:
    """Made once per size (a large one takes seconds on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    rows = -(-n // CHUNK)
    g = torch.randn(rows, CHUNK, generator=gen) * 0.05
    g[torch.randperm(rows, generator=gen)[:rows // 5]] *= 20
    return g.view(-1)[:n].clone()


@lru_cache(maxsize=8)
def first_k(n: int) -> int:
    """The chunk count the codec would agree for the layer's second step."""
    payload = ops.quantize_chunks_ef_(_embedding_grad(n, 0), torch.zeros(n), BITS, CHUNK, -(-n // CHUNK), SKIP)
    return int(payload[:4].view(torch.int32))


def step_inputs(n, dtype, device):
    grad = embedding_grad(n, dtype, device)
    residual = torch.randn(n, device=device) * 1e-3
    return grad, residual, residual.clone(), first_k(n), torch.tensor(True, device=device)


def step_ours(grad, residual, _pristine, k, done):
    payload = ops.quantize_chunks_ef_(grad, residual, BITS, CHUNK, k, SKIP, done)
    _, indices, scales, q = sparse.unpack(payload, k, CHUNK, BITS)
    ops.quantize_chunks_settle_(residual, indices, q, scales, CHUNK, done)
    return payload


def step_torch(grad, residual, _pristine, k, done):
    """The codec's own torch-op path (quantize_chunks.encode and settle, unfused)."""
    state = SimpleNamespace(residual=residual, bits=BITS, k=k, k_pending=None, sent=None, nbytes=None)
    payload = sparse.encode(state, grad, done, chunk=CHUNK, skip=SKIP, fused=False, quantize=quantize_flat,
                            generator=None)
    sparse.settle(state, done, CHUNK, fused=False)
    return payload


def step_restore(grad, residual, pristine, k, done):
    residual.copy_(pristine)


def step_bytes(n, dtype):
    """grad read, e read and written (the add, and the energies from cache); the chosen chunks
    read again, their integers written, and e read and written again when settling."""
    k = max(1, -(-n // CHUNK) // 5)
    return n * (torch.finfo(dtype).bits // 8 + 8) + k * CHUNK * (4 + BITS // 8 + 8)


def average_inputs(n, dtype, device):
    return _rows(n).to(device, copy=True), n, first_k(n), dtype  # a copy each: the pool's entries differ


@lru_cache(maxsize=8)
def _rows(n: int) -> torch.Tensor:
    return torch.stack([ops.quantize_chunks_ef_(_embedding_grad(n, r), torch.zeros(n), BITS, CHUNK, first_k(n), SKIP)
                        for r in range(WORLD)])


def average_ours(rows, n, k, dtype):
    return ops.quantize_chunks_average(rows, n, k, BITS, CHUNK, dtype)[0]


def average_torch(rows, n, k, dtype):
    return sparse.average(rows, n, k, CHUNK, BITS)[0].to(dtype)


def average_bytes(n, dtype):
    """Every rank's payload read; the output written (zeros, then the sent chunks added)."""
    k = max(1, -(-n // CHUNK) // 5)
    return WORLD * sparse.payload_bytes(k, CHUNK, BITS) + n * (torch.finfo(dtype).bits // 8)
