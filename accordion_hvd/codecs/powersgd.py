"""PowerSGD (Vogels et al., 2019): rank-r approximation of each gradient matrix, one power
iteration per step with a warm-started Q, and error feedback.

Per layer, with the gradient viewed as an n x m matrix (shape[0] x the rest):

    M = grad + e                    (e: error feedback, kept between steps)
    P = M Q          -> averaged over ranks (round 1)
    P = orthogonalize(P)
    Q = M^T P        -> averaged over ranks (round 2); kept as the next step's warm start
    M_hat = P Q^T    (the same on every rank: the result)
    e = M - M_hat    (once the step is known not to be skipped)

The codec does the math of each phase (``start``, ``middle``, ``finish``, ``settle``); the
engine does the two averaging rounds for all layers at once in between. Two parts have files
of their own: the same phases for a whole bucket in one kernel call each (powersgd_bucket.py,
the codec's ``bucket``) and what a level costs and loses (powersgd_cost.py, behind ``wire``,
``kernel_work`` and ``level_errors``); a layer's state is powersgd_state.py. Nothing here reads
a tensor on the host: a non-finite gradient is handled with 0-d bool flags on the device.
"""

from __future__ import annotations

import math
import zlib

import torch

from .. import ops, reference
from ..levels import CRITICAL, DENSE, DENSE16, NORMAL, UNCOMPRESSED, Level, check_level, positive_number
from . import powersgd_cost as cost
from .base import Codec
from .powersgd_bucket import BucketPhases
from .powersgd_state import PowerSGDState
from ._common import flush_whole, residual_dtype, settle_sent


class PowerSGD(Codec):
    """Low-rank codec: ``rank`` in normal regimes, ``critical_rank`` in critical ones.

    Args:
        rank: rank of the approximation in normal regimes (aggressive compression).
        critical_rank: rank in critical regimes (gentle); ``None`` means static ``rank``.
        min_compression_rate: a layer is compressed only if, at ``rank``, it sends at least
            this many times fewer floats than dense, ``n*m >= rate * (n+m) * rank``; smaller
            layers go through the ordinary dense allreduce (PyTorch's PowerSGD rule).
        seed: seed of the initial Q matrices; identical on all ranks, per layer name.
        eps: added to column norms in Gram-Schmidt, so zero columns stay finite.
    """

    def __init__(self, rank: int = 1, critical_rank: int | None = None, *,
                 min_compression_rate: float = 2.0, seed: int = 0, eps: float = 1e-8) -> None:
        self.rank = positive_number("rank", rank, integer=True)
        self.critical_rank = rank if critical_rank is None else positive_number("critical_rank", critical_rank, integer=True)
        if self.critical_rank < self.rank:  # critical regimes get the gentle level: it sends more
            raise ValueError(f"critical_rank must be >= rank (critical regimes get the gentler, higher rank), got "
                             f"rank={rank!r}, critical_rank={critical_rank!r}; did you mean "
                             f"PowerSGD(rank={critical_rank!r}, critical_rank={rank!r})?")
        self.min_compression_rate = positive_number("min_compression_rate", min_compression_rate)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.seed = seed
        self.eps = positive_number("eps", eps)
        self.bucket = BucketPhases(self.eps)  # the phases for a whole bucket (the exchange's fast path)

    def __repr__(self) -> str:
        return f"PowerSGD(rank={self.rank}, critical_rank={self.critical_rank})"

    def config(self) -> dict:
        return {"codec": "powersgd", "rank": self.rank, "critical_rank": self.critical_rank,
                "min_compression_rate": self.min_compression_rate, "seed": self.seed, "eps": self.eps}

    @property
    def adaptive(self) -> bool:
        return self.critical_rank != self.rank

    levels = (NORMAL, CRITICAL, DENSE)  # the levels this codec has (DENSE: M itself, averaged in the P round)
    measures_gain = False         # no per-step gain measurement (policies/base.py: per_step)

    # --- which layers ---------------------------------------------------------------------
    @staticmethod
    def matrix_shape(shape: torch.Size) -> tuple[int, int]:
        return shape[0], math.prod(shape[1:])

    def compressible(self, shape: torch.Size) -> bool:
        if len(shape) < 2 or math.prod(shape) == 0:
            return False
        n, m = self.matrix_shape(shape)
        r = min(self.rank, n, m)
        return n * m >= self.min_compression_rate * (n + m) * r

    def level_rank(self, level: Level, shape: torch.Size) -> int:
        """The rank a layer of ``shape`` uses at ``level`` (NORMAL or CRITICAL; 0 for DENSE and
        DENSE16)."""
        n, m = self.matrix_shape(shape)
        check_level("level", level, allowed=self.levels + (DENSE16,))
        if level in UNCOMPRESSED:
            return 0
        return min(self.critical_rank if level == CRITICAL else self.rank, n, m)

    def floats_sent(self, state: PowerSGDState) -> int:
        n, m = state.residual.shape
        return n * m if state.level in UNCOMPRESSED else (n + m) * state.rank

    # --- what a level costs and loses (powersgd_cost.py) -------------------------------------
    def wire(self, shape: torch.Size, level: Level, itemsize: int = 4) -> tuple[tuple[str, int], ...]:
        """The collectives one layer of ``shape`` costs at ``level`` (codecs/base.py)."""
        n, m = self.matrix_shape(shape)
        return cost.wire(n, m, self.level_rank(level, shape), level, itemsize)

    def kernel_work(self, shape: torch.Size, level: Level, itemsize: int = 4) -> tuple[float, ...]:
        """The math one layer of ``shape`` costs at ``level``, in work units (powersgd_cost.py)."""
        n, m = self.matrix_shape(shape)
        return cost.kernel_work(n, m, self.level_rank(level, shape), level, itemsize)

    @torch.no_grad()
    def level_errors(self, state: PowerSGDState, grad: torch.Tensor, levels: tuple[Level, ...]) -> list[float]:
        """Squared error ``||M - M_hat||^2`` of compressing ``M = grad + e`` at each of
        ``levels``, from the layer's seeded start columns (powersgd_cost.py says how)."""
        n, m = state.residual.shape
        M = grad.reshape(n, m).to(state.residual.dtype) + state.residual
        ranks = [self.level_rank(level, state.shape) for level in levels]
        start = self._fresh_columns(state.name, m, 0, max(ranks), M.dtype, M.device)
        return cost.level_errors(M, grad.dtype, levels, ranks, start)

    # --- state ------------------------------------------------------------------------------
    def init_state(self, name: str, grad: torch.Tensor, level: Level = NORMAL) -> PowerSGDState:
        n, m = self.matrix_shape(grad.shape)
        dtype = residual_dtype(grad.dtype)
        rank = self.level_rank(NORMAL if level in UNCOMPRESSED else level, grad.shape)  # a Q for later
        residual = torch.zeros(n, m, dtype=dtype, device=grad.device)
        q = _as_transposed(self._fresh_columns(name, m, 0, rank, dtype, grad.device))
        return PowerSGDState(name, grad.shape, level, rank, residual, q)

    def set_level(self, state: PowerSGDState, level: Level) -> None:
        """Change a layer's rank: keep the Q columns it has, add fresh seeded ones (the same on
        every rank) or drop the last ones. Error feedback is kept. At DENSE the layer keeps its
        Q (unused), so a return to a compressed level warm-starts from it."""
        state.level = check_level("level", level, allowed=self.levels + (DENSE16,))
        if level in UNCOMPRESSED:
            return
        rank = self.level_rank(level, state.shape)
        if rank > state.rank:
            extra = self._fresh_columns(state.name, state.q.shape[0], state.rank, rank, state.q.dtype, state.q.device)
            state.q = torch.cat([state.q.t(), extra.t()]).t()
        elif rank < state.rank:
            state.q = state.q.t()[:rank].contiguous().t()
        state.rank = rank

    def state_to_dict(self, state: PowerSGDState) -> dict:
        """A layer's state as plain values and tensors (copies), for checkpoints."""
        return {"shape": list(state.shape), "level": state.level.to_state(), "rank": state.rank,
                "residual": state.residual.clone(),
                "qt": state.q.t().clone(memory_format=torch.contiguous_format)}  # a copy: finish_many updates Q in place

    def state_from_dict(self, name: str, d: dict) -> PowerSGDState:
        shape = torch.Size(d["shape"])
        n, m = self.matrix_shape(shape)
        level, rank = Level.from_state(d["level"]), int(d["rank"])
        residual, qt = d["residual"], d["qt"]
        expected = rank if level in UNCOMPRESSED else self.level_rank(level, shape)  # keeps its last Q
        if rank != expected or not 0 < rank <= min(n, m) or tuple(residual.shape) != (n, m) \
                or tuple(qt.shape) != (rank, m):
            raise ValueError(f"PowerSGD state of {name!r} does not fit this codec: level {level!r} needs rank "
                             f"{self.level_rank(level, shape)}, got rank {rank}, residual {tuple(residual.shape)} "
                             f"(expected {(n, m)}), Q^T {tuple(qt.shape)}")
        return PowerSGDState(name, shape, level, rank, residual.clone(), qt.clone().t())

    def _fresh_columns(self, name: str, m: int, first: int, last: int, dtype, device) -> torch.Tensor:
        """Columns first..last-1 of a layer's initial Q: column j depends only on (seed, name, j)."""
        cols = []
        for j in range(first, last):
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) * 1009 + j)
            cols.append(torch.randn(m, 1, generator=gen, dtype=torch.float64))
        if not cols:
            return torch.zeros(m, 0, dtype=dtype, device=device)
        return torch.cat(cols, dim=1).to(dtype=dtype, device=device)

    # --- the phases of a step ---------------------------------------------------------------
    def start(self, state: PowerSGDState, grad: torch.Tensor, finite: torch.Tensor | None = None) -> torch.Tensor:
        """M = grad + e (into the residual buffer); returns P = M Q, to be averaged (at DENSE,
        a copy of M itself: the residual keeps M until ``settle_dense``). With ``finite``
        (0-d bool) False the gradient is not added (M = e) and P is NaN, so that every rank
        sees the fault in the averaged P."""
        ops.ef_add_(grad.reshape(state.residual.shape), state.residual, finite)
        p = state.residual.clone() if state.level == DENSE else state.residual @ state.q
        if finite is not None:
            ops.fill_if_([p], ~finite, float("nan"))
        return p

    @staticmethod
    def sends_dense(state: PowerSGDState) -> bool:
        """At DENSE16 a layer goes whole through Horovod's allreduce in float16 (the P round's
        buffer is float32); at DENSE it rides in its bucket's P round."""
        return state.level == DENSE16

    @staticmethod
    def flush_dense(state: PowerSGDState, grad: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        """For a DENSE16 step: M = grad + e (e holds it until ``settle_sent``), returned in
        float16 (NaN if ``finite`` is False; then e is not touched), shaped like ``grad``."""
        return flush_whole(state.residual, grad, state.level, finite)

    @staticmethod
    def settle_sent(state: PowerSGDState, sent_dtype: torch.dtype, done: torch.Tensor) -> None:
        """After a DENSE16 step: if it went through, e keeps what ``sent_dtype`` rounded away;
        if it was skipped, all of M."""
        settle_sent(state.residual, sent_dtype, done)

    @staticmethod
    def finish_dense(state: PowerSGDState, m_avg: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """A DENSE layer's result: the average of every rank's M, shaped and typed like
        ``grad``. Its residual still holds this rank's M (a skipped step keeps it)."""
        return m_avg.reshape(state.shape).to(grad.dtype)

    @staticmethod
    def settle_dense(state: PowerSGDState, done: torch.Tensor) -> None:
        """A DENSE layer's step: if it went through (``done``, 0-d bool), everything was sent,
        e = 0; if it was skipped e keeps M."""
        ops.fill_if_([state.residual], done)

    def middle(self, states: list[PowerSGDState], p_avgs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Orthogonalizes every layer's averaged P (in one kernel call); returns each layer's
        Q^T = P^T M (rank x m), to be averaged. (Q^T rather than Q: BLAS reads M in its own
        row-major order then, faster on CPUs than M^T P; measured: docs/design.md, "Measured
        reasons".)"""
        ps = [p.contiguous() for p in p_avgs]
        on_kernel = [p.dtype in (torch.float32, torch.float64) and ops.has_kernel(p) for p in ps]
        ops.orthogonalize_([p for p, k in zip(ps, on_kernel) if k], self.eps)
        for p, k in zip(ps, on_kernel):
            if not k:  # e.g. CUDA tensors in a build without CUDA kernels
                reference.orthogonalize_(p, self.eps)
        qs = []
        for state, p in zip(states, ps):
            state.p = p
            qs.append(p.t() @ state.residual)
        return qs

    def finish(self, state: PowerSGDState, qt_avg: torch.Tensor, grad: torch.Tensor,
               ok: torch.Tensor | None = None) -> torch.Tensor:
        """With the averaged Q^T: M_hat = P Q^T, the next step's Q; returns M_hat shaped and
        typed like ``grad``. ``e = M - M_hat`` is left to ``settle``, once the step is known
        not to be skipped. With ``ok`` (0-d bool) False, some rank's gradient was not finite
        and P and Q^T are NaN: M_hat is zero and Q is kept, decided on the device.

        ``grad`` is this step's gradient, already folded into e by ``start`` and not needed
        any more: when it is a contiguous tensor of the residual's dtype, M_hat is written
        into its memory, so the step allocates no gradient-sized buffer.
        """
        qt_avg = qt_avg.contiguous()
        p, state.p = state.p, None
        if ok is None:
            state.q = qt_avg.t()
        else:  # P and Q^T are small: masking them costs nothing next to the products
            state.q = torch.where(ok, qt_avg, state.q.t()).t()
            bad = ~ok
            p, qt_avg = p.masked_fill_(bad, 0.0), qt_avg.masked_fill(bad, 0.0)
        state.factors = (p, qt_avg)
        e = state.residual
        if grad.dtype == e.dtype and grad.is_contiguous() and not grad.requires_grad:
            torch.mm(p, qt_avg, out=grad.view(e.shape))
            return grad
        return (p @ qt_avg).to(grad.dtype).view(state.shape)

    @staticmethod
    def settle(state: PowerSGDState, done: torch.Tensor | None = None) -> None:
        """e = M - M_hat when the step went through (``done``, 0-d bool, True; None: it did);
        a skipped step leaves e = M (nothing lost). BLAS updates e in place (``addmm_``: one
        pass over e, no M_hat buffer), with Q^T times the flag: on the device, and exactly
        ``e - P Q^T`` when it is 1."""
        factors, state.factors = state.factors, None
        if factors is None:
            return
        p, qt = factors
        state.residual.addmm_(p, qt if done is None else qt * done, alpha=-1)


def _as_transposed(q: torch.Tensor) -> torch.Tensor:
    """The same (m, r) matrix, stored as contiguous (r, m)."""
    return q.t().contiguous().t()
