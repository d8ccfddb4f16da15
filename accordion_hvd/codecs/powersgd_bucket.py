"""PowerSGD's phases for a whole bucket, one kernel call each (the fast path of
exchange/powersgd.py; ``start``, ``middle``, ``finish`` and ``settle`` in powersgd.py are the
same phases layer by layer, for what the kernels do not take). A part of ``PowerSGD``
(powersgd.py): the codec's ``bucket``, with the one setting it needs (``eps``)."""

from __future__ import annotations

import torch

from .. import ops
from ..levels import UNCOMPRESSED
from .powersgd_state import PowerSGDState

_BUCKET_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what powersgd_finish_many_ writes


class BucketPhases:
    """``PowerSGD``'s bucket phases (module doc)."""

    def __init__(self, eps: float) -> None:
        self.eps = eps  # added to column norms in Gram-Schmidt (PowerSGD's argument)

    @staticmethod
    def encodes_many(state: PowerSGDState) -> bool:
        """Whether the layer goes through the bucket ops (``start_many`` ... ``settle_many``):
        compressed, a float32 residual on a device with kernels, a rank they take. (float64
        layers and ranks above ``ops.MAX_BUCKET_RANK`` go layer by layer; so does a DENSE
        layer, whose M itself is its P.)"""
        e = state.residual
        return (state.level not in UNCOMPRESSED and e.dtype == torch.float32 and ops.has_kernel(e)
                and state.rank <= ops.MAX_BUCKET_RANK)

    @staticmethod
    def start_many(states: list[PowerSGDState], grads: list[torch.Tensor], finite: torch.Tensor) -> torch.Tensor:
        """``start`` for a bucket in one call: M = grad + e into each residual and every P,
        one after the other in one flat float32 tensor (the bucket's P payload). ``finite``
        (1-d bool, one flag per layer): a layer flagged False keeps its e and sends NaN."""
        return ops.powersgd_p_many([g.contiguous() for g in grads], [s.residual for s in states],
                                   [s.q.t() for s in states], finite)

    def middle_many(self, states: list[PowerSGDState], p_avgs: list[torch.Tensor]) -> torch.Tensor:
        """``middle`` for a bucket: orthogonalizes every averaged P (one call), keeps it for
        ``finish_many``, and returns every layer's Q^T = P^T M (r x m) in one flat float32
        tensor (the bucket's Q^T payload)."""
        ops.orthogonalize_(p_avgs, self.eps)
        for state, p in zip(states, p_avgs):
            state.p = p
        return ops.powersgd_qt_many(p_avgs, [s.residual for s in states])

    @staticmethod
    def finish_many(states: list[PowerSGDState], qt_avgs: list[torch.Tensor], grads: list[torch.Tensor],
                    ok: torch.Tensor | None) -> list[torch.Tensor]:
        """``finish`` for a bucket: each M_hat = P Q^T in one call, written into the gradient's
        memory where it can be (as ``finish``), and each Q^T (the next step's warm start) set to
        the average in place; with ``ok`` (0-d bool) False the results are zero and every Q is
        kept. ``settle_many`` needs ``ok`` again."""
        outs = [g if g.is_contiguous() and not g.requires_grad and g.dtype in _BUCKET_OUT_DTYPES
                else torch.empty(g.shape, dtype=g.dtype, device=g.device) for g in grads]
        ps, qts = [s.p for s in states], [s.q.t() for s in states]
        ops.powersgd_finish_many_([s.residual for s in states], outs, qts, ps, qt_avgs, ok)
        for state, p, qt in zip(states, ps, qts):
            state.p, state.factors = None, (p, qt)
        return outs

    @staticmethod
    def settle_many(states: list[PowerSGDState], done: torch.Tensor) -> None:
        """``settle`` for a bucket: e = M - M_hat in every residual when ``done`` (0-d bool:
        the step went through, and no rank's gradient was non-finite), in one call."""
        factors = [s.factors for s in states]
        for state in states:
            state.factors = None
        ops.powersgd_settle_many_([s.residual for s in states], [f[0] for f in factors], [f[1] for f in factors], done)
