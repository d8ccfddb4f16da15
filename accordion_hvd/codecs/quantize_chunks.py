"""Quantize's sparse chunks (``Quantize(skip_energy=s)``): a step sends only the chunks that
hold most of its energy; the others wait in error feedback.

Why: a layer's gradient is not always spread evenly. An embedding's (vocabulary x width) is
concentrated in the rows of the tokens a batch holds (measured: docs/design.md, "Measured
reasons"), and it is most of a language model's bytes. Quantizing every chunk of it to 8 bits
sends a million near-zero entries a step. This is TopK with memory (Stich et al., NeurIPS
2018) at the granularity of Quantize's chunks, each sent in 8 bits with its scale (QSGD's
buckets).

Per layer and step, with g = grad + e viewed as chunks c of ``chunk`` entries:

    E_c = sum of g_c^2 (float64, a fixed tree)   order the chunks by E, largest first (stable)
    send the first k of that order        k: agreed by every rank at the end of the last step
    k_next = 1 + #{j : cumsum(E sorted)_j < (1 - s) * sum(E)}   this rank's need, sent with them

so that k_next chunks hold at least 1 - s of this step's energy. Every rank reads every other
rank's k_next from the gathered payloads, and the next step sends k = max over ranks (1 at
least, every chunk at most). The first step sends every chunk. Chunks never sent keep
accumulating in e until they are among the largest: nothing is dropped, only delayed.

Every sum here has one order on every device, since a sum's rounding depends on its order
(torch's own reductions pick theirs by CPU and vector width, and a near-tie between two
chunks would then send different chunks from a kernel and from torch):
- E_c (``energies``): the chunk zero-padded to a power of two, then halves added,
  x[:h] + x[h:], down to one entry;
- the running sum in energy order (``running_sum``): in blocks of ``BLOCK`` chunks, each summed
  left to right, plus the block's offset (the blocks before it, summed left to right). A GPU
  runs the blocks in parallel; one running sum left to right would be one thread's work.

One rank's payload (bytes, each part 4-byte aligned):

    k_next (int32) | k chunk indices (int32, ascending) | k scales (float32) | k x chunk integers

The mean of the ranks' dequantized chunks, scattered into place, is every rank's result. The
plain-torch reference is ``reference.quantize_chunks_ef`` and
``reference.quantized_chunks_average``. On the CPU the codec runs the compiled kernels
(csrc/cpu/quantize_chunks.cpp, bit for bit this module's torch ops); elsewhere these torch ops.
The host needs one integer per layer and step: the next step's k, agreed on the device from
the gathered payloads, which sizes the next payload. On a GPU the codec copies it to pinned
memory behind an event and reads it at the layer's next encode (``take_k``, ``agreed_k``); by
then the device is long past it, so no step waits for the device.

``encode``, ``decode`` and ``settle`` are ``Quantize``'s step with sparse chunks, on its
``QuantizeState`` (codecs/quantize.py, which delegates here).
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import ops

_INT = {8: torch.int8, 16: torch.int16}
BLOCK = 1024  # chunks per block of the running sum (module doc)


def check_skip_energy(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"skip_energy must be a number in [0, 1) (the share of a step's energy that may wait in "
                         f"error feedback; 0: every chunk is sent), got {value!r}")
    return float(value)


def payload_bytes(k: int, chunk: int, bits: int) -> int:
    """One rank's payload for ``k`` chunks: the header, the indices, the scales, the integers
    (padded to 4 bytes)."""
    return 4 + 4 * k + 4 * k + -(-k * chunk * bits // 32) * 4


def as_chunks(g: torch.Tensor, chunk: int) -> torch.Tensor:
    """Flat ``g`` as (chunks, chunk) float32, the last chunk zero-padded."""
    chunks = -(-g.numel() // chunk)
    return torch.nn.functional.pad(g.float(), (0, chunks * chunk - g.numel())).view(chunks, chunk)


def energies(chunks: torch.Tensor) -> torch.Tensor:
    """Each chunk's sum of squares in float64, added as the module doc's tree."""
    x = chunks.double().square()
    width = 1 << (x.shape[1] - 1).bit_length()
    x = torch.nn.functional.pad(x, (0, width - x.shape[1]))
    while x.shape[1] > 1:
        half = x.shape[1] // 2
        x = x[:, :half] + x[:, half:]
    return x[:, 0]


def running_sum(x: torch.Tensor) -> torch.Tensor:
    """The running sums of 1-d float64 ``x`` in the module doc's order. ``torch.cumsum`` adds
    left to right on the CPU (on CUDA, as a scan: there the torch path may round apart from
    the reference)."""
    blocks = -(-x.numel() // BLOCK)
    local = torch.cumsum(torch.nn.functional.pad(x, (0, blocks * BLOCK - x.numel())).view(blocks, BLOCK), 1)
    offsets = torch.cat([local.new_zeros(1), torch.cumsum(local[:-1, -1], 0)])
    return (offsets[:, None] + local).reshape(-1)[:x.numel()]


def choose(chunks: torch.Tensor, k: int, skip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the k chunks of largest energy, as ascending int32 indices; this rank's k_next, a
    one-element int32 tensor on the chunks' device: it goes into the payload as it is, never
    read on the host here)."""
    energy = energies(chunks)
    order = torch.sort(energy, descending=True, stable=True).indices
    cum = running_sum(energy[order])
    k_next = ((cum < (1.0 - skip) * cum[-1]).sum() + 1).clamp(max=chunks.shape[0])
    return torch.sort(order[:k]).values.to(torch.int32), k_next.to(torch.int32).reshape(1)


def pack(k_next: torch.Tensor, indices: torch.Tensor, scales: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """One rank's payload bytes (module doc); ``k_next`` as ``choose`` returns it."""
    header = k_next
    pad = -(-q.numel() * q.element_size() // 4) * 4 - q.numel() * q.element_size()
    return torch.cat([header.view(torch.uint8), indices.view(torch.uint8), scales.view(torch.uint8),
                      q.reshape(-1).view(torch.uint8), torch.zeros(pad, dtype=torch.uint8, device=q.device)])


def unpack(row: torch.Tensor, k: int, chunk: int, bits: int):
    """(k_next, indices, scales, q) of one rank's payload: views of ``row`` (uint8)."""
    at = 4 + 8 * k
    return (row[:4].view(torch.int32), row[4:4 + 4 * k].view(torch.int32), row[4 + 4 * k:at].view(torch.float32),
            row[at:at + k * chunk * bits // 8].view(_INT[bits]))


def average(rows: torch.Tensor, numel: int, k: int, chunk: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's payload (a (ranks, bytes) uint8 block) -> (the mean of their dequantized
    chunks in place, flat float32; the next step's k, the largest k_next of any rank, a 0-d
    int64 tensor on the rows' device)."""
    chunks = -(-numel // chunk)
    total = torch.zeros(chunks, chunk, dtype=torch.float32, device=rows.device)
    needs = []
    for row in rows:  # in rank order: the same sums on every rank
        k_next, indices, scales, q = unpack(row, k, chunk, bits)
        total.index_add_(0, indices.long(), q.view(k, chunk).float() * scales[:, None])
        needs.append(k_next)
    ranks = torch.full((), rows.shape[0], dtype=total.dtype, device=total.device)  # (quantize.quantize_flat says why)
    return (total / ranks).reshape(-1)[:numel], torch.cat(needs).max().clamp(1, chunks).long()


def scattered(indices: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, numel: int, chunk: int) -> torch.Tensor:
    """What this rank sent, dequantized, in place in a flat float32 tensor of ``numel``."""
    chunks = -(-numel // chunk)
    out = torch.zeros(chunks, chunk, dtype=torch.float32, device=q.device)
    out[indices] = q.view(-1, chunk).float() * scales[:, None]
    return out.reshape(-1)[:numel]


def encode(state, grad: torch.Tensor, finite: torch.Tensor, *, chunk: int, skip: float, fused: bool,
           quantize: Callable, generator) -> torch.Tensor:
    """g = grad + e into ``state.residual`` (not where ``finite`` is False) and this rank's
    payload; what was sent kept in ``state.sent`` until ``settle``. ``fused``: the compiled
    kernel (bit for bit the torch ops below); ``quantize``: codecs/quantize.py's
    ``quantize_flat`` (passed in: that module imports this one)."""
    if agreed_k(state) is None:  # the first step: every chunk
        state.k = -(-state.residual.numel() // chunk)
    if fused:  # csrc/cpu/quantize_chunks.cpp
        payload = ops.quantize_chunks_ef_(grad.reshape(-1), state.residual, state.bits, chunk, state.k, skip, finite)
        _, indices, scales, q = unpack(payload, state.k, chunk, state.bits)
        state.sent, state.nbytes = (indices, q, scales), payload.numel()
        return payload
    chunks = as_chunks(ops.ef_add_(grad.reshape(-1), state.residual, finite), chunk)
    indices, k_next = choose(chunks, state.k, skip)
    q, scales = quantize(chunks.index_select(0, indices).reshape(-1), state.bits, chunk, generator)
    state.sent = (indices, q, scales)
    payload = pack(k_next, indices, torch.where(finite, scales, float("nan")), q)
    state.nbytes = payload.numel()
    return payload


def decode(state, rows: torch.Tensor, chunk: int, grad_dtype: torch.dtype) -> torch.Tensor:
    """Every rank's payload -> their mean in the gradient's dtype and shape; the next k taken."""
    numel = state.residual.numel()
    if ops.has_kernel(rows, "quantize_chunks_average") and rows.stride(-1) == 1 and rows.stride(0) % 4 == 0:
        mean, k_next = ops.quantize_chunks_average(rows, numel, state.k, state.bits, chunk, grad_dtype)
    else:
        mean, k_next = average(rows, numel, state.k, chunk, state.bits)
    take_k(state, k_next)
    return mean.to(grad_dtype).view(state.shape)


def settle(state, done: torch.Tensor, chunk: int, fused: bool) -> None:
    """End of step: where it went through (``done``), e -= what was sent (only the sent chunks
    change); else e keeps g."""
    if fused:
        ops.quantize_chunks_settle_(state.residual, *state.sent, chunk, done)
    else:
        sent = scattered(*state.sent, state.residual.numel(), chunk).to(state.residual.dtype)
        state.residual.sub_(torch.where(done, sent, torch.zeros_like(sent)))
    state.sent = None


def take_k(state, k_next: torch.Tensor) -> None:
    """The next step's k, agreed on the device (``decode``). On the CPU it is read now. On CUDA
    it is copied to pinned host memory behind an event and read at the layer's next encode: the
    step's decode is queued before the next step's backward, so by then the event has long
    passed and reading it never waits."""
    if k_next.device.type == "cpu":
        state.k, state.k_pending = int(k_next), None
        return
    host = torch.empty((), dtype=torch.int64, pin_memory=True)
    host.copy_(k_next, non_blocking=True)
    arrived = torch.cuda.Event()
    arrived.record()
    state.k_pending = (host, arrived)


def agreed_k(state) -> int | None:
    """``state.k``, once what ``take_k`` sent on its way has arrived."""
    if state.k_pending is not None:
        host, arrived = state.k_pending
        arrived.synchronize()
        state.k, state.k_pending = int(host), None
    return state.k
