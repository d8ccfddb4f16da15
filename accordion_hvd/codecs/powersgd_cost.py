"""What a PowerSGD level costs and loses, for the network-aware policy (the codec protocol's
optional ``NETWORK`` methods: codecs/base.py), as functions of a layer's matrix shape (n x m)
and rank; ``PowerSGD.wire``, ``kernel_work`` and ``level_errors`` (powersgd.py) call them."""

from __future__ import annotations

import torch

from ..levels import DENSE, DENSE16, UNCOMPRESSED, Level
from ._common import rounding_error, whole_layer_work, wire_dtype


def wire(n: int, m: int, r: int, level: Level, itemsize: int = 4) -> tuple[tuple[str, int], ...]:
    """The collectives an n x m layer costs at ``level`` (rank ``r``): (kind, bytes per rank)
    for P (n x r) and for Q (m x r), both averaged; at DENSE, M (n x m) in the P round;
    at DENSE16, M in float16 through Horovod's allreduce, outside the buckets ("dense")."""
    if level == DENSE:  # M itself, in its bucket's P round; no Q round
        return (("allreduce", itemsize * n * m),)
    if level == DENSE16:
        return (("dense", min(itemsize, 2) * n * m),)
    return ("allreduce", itemsize * n * r), ("allreduce", itemsize * m * r)


def kernel_work(n: int, m: int, r: int, level: Level, itemsize: int = 4) -> tuple[float, ...]:
    """The math an n x m layer costs at ``level`` (rank ``r``), in work units (a byte of memory
    read or written, or a multiply-add, counted alike: the kernels are memory-bound on the CPU,
    and one rate, which the network-aware probe measures, prices both): the work before each of
    ``wire``'s rounds can be issued, then the finishing work (result and error feedback).

    M = grad + e and P = M Q (3 passes over M, nmr); orthogonalization and Q^T = P^T M (1 pass,
    nmr); M_hat = P Q^T into the result (1 pass, nmr) and e -= M_hat (3 passes). Sent whole:
    ``_common.whole_layer_work``."""
    nm = n * m
    if level in UNCOMPRESSED:
        return whole_layer_work(nm, level, itemsize)
    return 3.0 * nm * itemsize + nm * r, nm * itemsize + nm * r + n * r * r, 4.0 * nm * itemsize + nm * r


@torch.no_grad()
def level_errors(M: torch.Tensor, grad_dtype: torch.dtype, levels: tuple[Level, ...], ranks: list[int],
                 start: torch.Tensor) -> list[float]:
    """Squared error ``||M - M_hat||^2`` of compressing ``M`` (n x m, grad + e) at each of
    ``levels`` (ranks ``ranks``; 0: sent whole), from ``start`` (m x max(ranks), the layer's
    seeded initial Q).

    Two subspace iterations: P = orth(M Q0), P = orth(M M^T P); then ``M_hat = P P^T M`` is the
    projection onto P, whose error is ``||M||^2 - ||P^T M||^2``. Orthogonalization keeps a
    column's span independent of the columns after it, so one run at the largest rank gives
    every smaller rank's error from its first columns. This is what PowerSGD's warm-started
    power iteration approaches after a few steps (and never below the best rank-r error, the
    tail of M's singular values); it costs four n x m x r products.

    The products run in M's precision (float32 for 16- and 32-bit gradients) and only the sums
    of squares in float64: in float64 throughout they cost several times as much for a change
    of the errors far below what a level's choice reads (measured: docs/design.md, "Measured
    reasons")."""
    if max(ranks) == 0:
        return [_whole_error(M, level, grad_dtype) for level in levels]
    p = torch.linalg.qr(M @ start).Q
    p = torch.linalg.qr(M @ (M.t() @ p)).Q
    kept = torch.cumsum((p.t() @ M).square().sum(dim=1, dtype=torch.float64), 0)
    total = float(M.square().sum(dtype=torch.float64))
    # rank 0: sent whole, exact but for what float16 rounds away at DENSE16
    return [max(0.0, total - float(kept[r - 1])) if r > 0 else _whole_error(M, level, grad_dtype)
            for level, r in zip(levels, ranks)]


def _whole_error(M: torch.Tensor, level: Level, grad_dtype: torch.dtype) -> float:
    """The error of sending M whole: none at DENSE (in the float32 P round), float16's
    rounding at DENSE16."""
    return rounding_error(M, wire_dtype(level, grad_dtype)) if level == DENSE16 else 0.0
