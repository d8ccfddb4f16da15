"""Plain-torch reference implementations of every ``accordion::`` kernel.

Each function here defines what the matching op must compute; tests compare the compiled
kernels (CPU and CUDA) against these. They are also what a reader should look at first to
understand an op. They are not a fallback for a missing build.
"""

from __future__ import annotations

import torch


def ef_add(grad: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """Error-feedback add: ``grad + residual`` in the residual's dtype.

    The residual may be float32 while the gradient is float16/bfloat16 (error feedback is
    accumulated in higher precision); otherwise both have the same dtype.
    """
    return residual + grad.to(residual.dtype)


def topk_select(grad: torch.Tensor, residual: torch.Tensor, k: int):
    """Fused TopK with error feedback, as the ``accordion::topk_ef`` kernel must compute it.

    ``g = grad + residual`` (flattened); keep the ``k`` entries of largest magnitude, ties
    broken towards the lower index; return ``(values, indices, new_residual, g_sq, kept_sq)``:
    indices ascending as int32, values ``g[indices]`` in the residual's dtype, the new
    residual ``g`` with the kept entries zeroed, and the squared L2 norms (float64) of ``g``
    and of its kept part, which the policies use.
    """
    g = ef_add(grad, residual).reshape(-1)
    if not 0 <= k <= g.numel():
        raise ValueError(f"k must be in [0, {g.numel()}], got {k}")
    # A stable descending sort keeps equal magnitudes in index order: lower index wins.
    chosen = torch.sort(g.abs(), descending=True, stable=True).indices[:k]
    indices = torch.sort(chosen).values
    values = g[indices]
    new_residual = g.clone()
    new_residual[indices] = 0
    g_sq = g.double().square().sum()
    kept_sq = values.double().square().sum()
    return values, indices.to(torch.int32), new_residual.view_as(residual), g_sq, kept_sq


def sparse_average(values: torch.Tensor, indices: torch.Tensor, numel: int, world_size: int) -> torch.Tensor:
    """Sum every rank's (values, indices) into a dense vector of ``numel``, divided by world size.

    ``values`` and ``indices`` are the concatenation over ranks; additions happen in that order.
    """
    out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    out.index_add_(0, indices.long(), values)
    return out.div_(world_size)


def orthogonalize_(p: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``p`` (n x r), in place; a zero column stays finite.

    As in PyTorch's PowerSGD hook: each column is normalized (with ``eps`` added to its norm)
    and then removed from the columns after it.
    """
    for i in range(p.shape[1]):
        col = p[:, i : i + 1]
        col.div_(col.norm() + eps)
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1 :]
            rest.sub_(col @ (col.t() @ rest))
    return p


def powersgd_p(grad: torch.Tensor, residual: torch.Tensor, qt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PowerSGD's first phase for one layer (``accordion::powersgd_p_many`` does a bucket):
    ``M = grad + residual`` (residual n x m; grad of n * m entries) and ``P = M Q``, with Q
    given as Q^T (r x m). Returns ``(M, P)``."""
    m = ef_add(grad.reshape(residual.shape), residual)
    return m, m @ qt.t()


def powersgd_qt(p: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """PowerSGD's second product, ``Q^T = P^T M`` (r x m) (``accordion::powersgd_qt_many``)."""
    return p.t() @ m


def powersgd_approx(p: torch.Tensor, qt: torch.Tensor) -> torch.Tensor:
    """The rank-r approximation ``M_hat = P Q^T`` (``accordion::powersgd_finish_many_``
    writes it to the gradient; ``accordion::powersgd_settle_many_`` subtracts it from e)."""
    return p @ qt


def quantize_ef(grad: torch.Tensor, residual: torch.Tensor, bits: int, chunk: int):
    """One step of Quantize with error feedback, as the codec must compute it (nearest
    rounding): ``g = grad + residual`` (flattened, in the residual's dtype); per chunk of
    ``chunk`` consecutive entries (the last one may be shorter) the scale ``s = max|g| /
    (2^(bits-1) - 1)`` (float32; a chunk of zeros has scale 0 and sends zeros), ``q =
    round(g / s)`` half to even, as an int8 (bits 8) or int16 (bits 16) tensor; returns
    ``(q, scales, new_residual)`` with ``new_residual = g - q * s``."""
    g = residual.reshape(-1) + grad.reshape(-1).to(residual.dtype)
    qmax = 2 ** (bits - 1) - 1
    qs, scales, sent = [], [], []
    for start in range(0, g.numel(), chunk):
        part = g[start:start + chunk].float()
        s = part.abs().max() / qmax
        q = (part / s).round() if s > 0 else torch.zeros_like(part)
        qs.append(q.to(torch.int8 if bits == 8 else torch.int16))
        scales.append(s)
        sent.append(q * s)
    q, scales = torch.cat(qs), torch.stack(scales).float()
    return q, scales, g - torch.cat(sent).to(g.dtype)


def quantized_average(payloads: list[tuple[torch.Tensor, torch.Tensor]], chunk: int) -> torch.Tensor:
    """What every rank gets from Quantize's exchange: the mean over ranks of each rank's
    dequantized ``(q, scales)``, in float32."""
    total = 0
    for q, scales in payloads:
        total = total + q.float() * scales.repeat_interleave(chunk)[:q.numel()]
    return total / len(payloads)


def quantize_chunks_ef(grad: torch.Tensor, residual: torch.Tensor, bits: int, chunk: int, k: int, skip: float):
    """One step of Quantize with sparse chunks (``skip_energy``; codecs/quantize_chunks.py), as
    the codec must compute it: ``g = grad + residual``; the chunks ordered by their energy
    (sum of squares in float64), largest first, ties by position; the first ``k`` of them
    quantized as ``quantize_ef`` does (the last chunk zero-padded); ``k_next``, the fewest of
    that order holding at least ``1 - skip`` of the energy. Every sum is added in one fixed
    order (``tree_sum``, ``running_sum``). Returns ``(indices (ascending, int32), q, scales, k_next,
    new_residual)``, the new residual being g less what was sent."""
    g = residual.reshape(-1) + grad.reshape(-1).to(residual.dtype)
    n = g.numel()
    parts = [torch.cat([g[s:s + chunk].float(), torch.zeros(max(0, s + chunk - n))]) for s in range(0, n, chunk)]
    energy = [tree_sum(part.double().square()) for part in parts]
    order = sorted(range(len(parts)), key=lambda c: (-energy[c], c))
    cum = running_sum([energy[c] for c in order])
    k_next = 1 + sum(1 for value in cum if value < (1.0 - skip) * cum[-1])
    indices = sorted(order[:k])
    q, scales, _ = quantize_ef(torch.cat([parts[c] for c in indices]), torch.zeros(k * chunk), bits, chunk)
    sent = torch.zeros(len(parts) * chunk)
    for i, c in enumerate(indices):
        sent[c * chunk:(c + 1) * chunk] = q[i * chunk:(i + 1) * chunk].float() * scales[i]
    return torch.tensor(indices, dtype=torch.int32), q, scales, min(k_next, len(parts)), g - sent[:n].to(g.dtype)


def running_sum(values: list[float], block: int = 1024) -> list[float]:
    """Running sums of ``values`` in blocks of ``block``: within a block left to right, plus the
    block's offset, the sum of the blocks before it left to right."""
    out, offset = [], 0.0
    for start in range(0, len(values), block):
        local = 0.0
        for value in values[start:start + block]:
            local += value
            out.append(offset + local)
        offset += local
    return out


def tree_sum(x: torch.Tensor) -> float:
    """The sum of 1-d ``x`` added as a fixed tree: zero-padded to a power of two, then the
    second half added to the first until one entry is left."""
    x = torch.cat([x, x.new_zeros((1 << (x.numel() - 1).bit_length()) - x.numel())])
    while x.numel() > 1:
        half = x.numel() // 2
        x = x[:half] + x[half:]
    return float(x[0])


def quantized_chunks_average(payloads: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], numel: int,
                             chunk: int) -> torch.Tensor:
    """What every rank gets from sparse chunks: the mean over ranks of each rank's
    ``(indices, q, scales)`` dequantized in place, in float32."""
    total = torch.zeros(-(-numel // chunk) * chunk)
    for indices, q, scales in payloads:
        for i, c in enumerate(indices.tolist()):
            total[c * chunk:(c + 1) * chunk] += q[i * chunk:(i + 1) * chunk].float() * scales[i]
    return total[:numel] / len(payloads)


def flush_whole(grad: torch.Tensor, residual: torch.Tensor, dtype: torch.dtype, finite: bool = True):
    """A layer or flat buffer sent whole, as ``accordion::flush_whole`` must compute it:
    returns ``(out, new_residual)``: ``g = residual + grad`` (float32) becomes the residual
    (kept until ``settle_sent``), sent as ``g`` in ``dtype``; if not ``finite``, the residual
    stays as it was and ``out`` is NaN."""
    if not finite:
        return torch.full(residual.shape, float("nan"), dtype=dtype), residual.clone()
    g = ef_add(grad, residual)
    return g.to(dtype), g


def settle_sent(residual: torch.Tensor, dtype: torch.dtype, done: bool = True) -> torch.Tensor:
    """After a step that sent ``residual`` (which held all of g) whole in ``dtype``, as
    ``accordion::settle_sent_`` must compute it: the new residual, what ``dtype`` rounded
    away if the step went through (``done``), else all of g."""
    if not done:
        return residual.clone()
    return residual - residual.to(dtype).to(residual.dtype)



def sign_ef(grad: torch.Tensor, residual: torch.Tensor, finite: bool = True):
    """One step of Sign's encode (1 bit per entry with error feedback: codecs/sign.py), as
    ``accordion::sign_ef_`` must compute it: ``g = grad + residual`` (flattened, float32; not
    if ``finite`` is False: then g is the residual and the scale NaN). The payload, as uint8
    bytes: the float32 scale ``s = sqrt(sum(g^2) / n)`` (the sum in float64: the kernel's
    order of addition may differ, so the scale may differ in its last bit), then bit ``i`` of
    byte ``j`` set where ``g[8j + i] >= 0`` (a +1; -1 where it is negative or NaN), the bytes
    zero-padded to a multiple of 4. Returns ``(payload, g)``."""
    g = residual.reshape(-1).float() + (grad.reshape(-1).float() if finite else 0)
    n = g.numel()
    scale = (g.double().square().sum() / n).sqrt().float() if n else torch.zeros((), dtype=torch.float32)
    if not finite:
        scale = torch.full((), float("nan"))
    bits = torch.zeros(-(-n // 32) * 32, dtype=torch.uint8)
    bits[:n] = (g >= 0).to(torch.uint8)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    packed = (bits.view(-1, 8) * weights).sum(dim=1).to(torch.uint8)
    return torch.cat([scale.reshape(1).view(torch.uint8), packed]), g


def sign_average(rows: torch.Tensor, numel: int) -> torch.Tensor:
    """What every rank gets from Sign's exchange: the mean over the rows (one rank's
    ``sign_ef`` payload each) of ``s * (+1 or -1)``, added in rank order in float32, then
    divided by the number of rows."""
    total = torch.zeros(numel, dtype=torch.float32)
    shifts = torch.arange(8, dtype=torch.uint8)
    for row in rows:
        scale = row[:4].view(torch.float32)
        bits = ((row[4:].unsqueeze(1) >> shifts) & 1).reshape(-1)[:numel]
        total += torch.where(bits.bool(), 1.0, -1.0) * scale
    return total / torch.full((), rows.shape[0], dtype=torch.float32)
