"""TopK sparsification with error feedback.

Per layer: ``g = grad + e``; keep the ``k = ceil(ratio * numel)`` entries of largest
magnitude (ties towards the lower index); every rank's values and int32 indices are
gathered, and the result is their **average**: scatter-added, divided by the world size.
The entries not sent stay in ``e`` for later steps. (The Accordion authors' released code
summed instead of averaging and never updated ``e``; both are bugs we do not copy.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import ops, reference
from ..levels import CRITICAL, DENSE, DENSE16, NORMAL, UNCOMPRESSED, Level, check_level, positive_number
from .base import Codec
from ._common import flush_whole, residual_dtype, rounding_error, settle_sent, whole_layer_work, wire_dtype


@dataclass
class TopKState:
    name: str
    shape: torch.Size
    level: Level
    k: int
    residual: torch.Tensor  # flat, numel entries
    # Squared norms of the last step, g and the part sent: 0-d float64 tensors on the
    # residual's device (read by the host only where a policy needs them), or floats.
    g_sq: torch.Tensor | float = 0.0
    kept_sq: torch.Tensor | float = 0.0


class TopK(Codec):
    """Sparsifying codec: keeps the fraction ``ratio`` of entries in normal regimes and
    ``critical_ratio`` in critical ones (``None``: static ``ratio``).

    A layer is compressed only if it has at least 2 dimensions and, at ``ratio``, sends at
    least ``min_compression_rate`` times fewer floats than dense (values and indices both
    count: ``numel >= rate * 2k``); others go through the ordinary dense allreduce.
    """

    def __init__(self, ratio: float = 0.01, critical_ratio: float | None = None, *,
                 min_compression_rate: float = 2.0) -> None:
        self.ratio = float(positive_number("ratio", ratio, upper=1.0))
        self.critical_ratio = self.ratio if critical_ratio is None else float(
            positive_number("critical_ratio", critical_ratio, upper=1.0))
        if self.critical_ratio < self.ratio:  # critical regimes get the gentle level: it keeps more
            raise ValueError(f"critical_ratio must be >= ratio (critical regimes get the gentler level, which keeps "
                             f"more entries), got ratio={ratio!r}, critical_ratio={critical_ratio!r}; did you mean "
                             f"TopK(ratio={critical_ratio!r}, critical_ratio={ratio!r})?")
        self.min_compression_rate = positive_number("min_compression_rate", min_compression_rate)

    def __repr__(self) -> str:
        return f"TopK(ratio={self.ratio}, critical_ratio={self.critical_ratio})"

    def config(self) -> dict:
        return {"codec": "topk", "ratio": self.ratio, "critical_ratio": self.critical_ratio,
                "min_compression_rate": self.min_compression_rate}

    @property
    def adaptive(self) -> bool:
        return self.critical_ratio != self.ratio

    measures_gain = True  # can measure, per step, the gain of any level (policies/base.py: per_step)

    def level_k(self, level: Level, numel: int) -> int:
        """Entries kept of a layer of ``numel`` at ``level``: ``ratio`` (NORMAL),
        ``critical_ratio`` (CRITICAL), ``ceil(numel / f)`` (``Level.factor(f)``), all (DENSE,
        DENSE16)."""
        check_level("level", level)
        if level.kind == "factor":
            return max(1, min(numel, math.ceil(numel / level.compression_factor)))
        if level in UNCOMPRESSED:
            return numel
        ratio = self.critical_ratio if level == CRITICAL else self.ratio
        return max(1, min(numel, math.ceil(ratio * numel)))

    def compressible(self, shape: torch.Size) -> bool:
        numel = math.prod(shape)
        return len(shape) >= 2 and numel >= self.min_compression_rate * 2 * self.level_k(NORMAL, numel)

    def floats_sent(self, state: TopKState) -> int:
        return 2 * state.k

    # --- what a level costs and loses (the network-aware policy) -----------------------------
    levels = (NORMAL, CRITICAL, DENSE)  # the fixed levels a window policy chooses among

    def wire(self, shape: torch.Size, level: Level, itemsize: int = 4) -> tuple[tuple[str, int], ...]:
        """The collectives one layer of ``shape`` costs at ``level``: (kind, bytes per rank).
        A level sent dense (``sends_dense``) is "dense": an allreduce of the layer outside the
        buckets (2 bytes a value at DENSE16); else each rank's k values and int32 indices are
        allgathered in its bucket."""
        numel = math.prod(shape)
        k = self.level_k(level, numel)
        if 2 * k >= numel:
            return (("dense", min(itemsize, 2) * numel if level == DENSE16 else itemsize * numel),)
        return (("allgather", (itemsize + 4) * k),)

    def kernel_work(self, shape: torch.Size, level: Level, itemsize: int = 4) -> tuple[float, ...]:
        """The math one layer of ``shape`` costs at ``level``, in work units (bytes of memory
        read or written; see PowerSGD.kernel_work): the work before its round can be issued,
        then the finishing work. Selected: g = grad + e (3 passes), the top-k selection (its
        two passes over |g|), the k values and indices written and zeroed in e; then the
        gathered entries added into a zeroed result (1 pass plus the entries). Sent whole:
        ``_common.whole_layer_work``."""
        numel = math.prod(shape)
        k = self.level_k(level, numel)
        if 2 * k >= numel:
            return whole_layer_work(numel, level, itemsize)
        entry = k * (2 * itemsize + 4)
        return 5.0 * numel * itemsize + entry, numel * itemsize + entry

    @torch.no_grad()
    def level_errors(self, state: TopKState, grad: torch.Tensor, levels: tuple[Level, ...]) -> list[float]:
        """Squared error ``||g - C(g)||^2`` of compressing ``g = grad + e`` at each of ``levels``:
        exactly the energy of the entries outside the top k (for a level sent dense, what its
        dtype rounds away: 0 in the gradient's own, float16's rounding at DENSE16). As
        PowerSGD's: the squares in the residual's precision (what the encoder selects on),
        only their sums in float64."""
        g = grad.reshape(-1).to(state.residual.dtype) + state.residual
        energy = g.square()
        numel = energy.numel()
        ks = [self.level_k(level, numel) for level in levels]
        sparse = [k for k in ks if 2 * k < numel]
        kept = torch.cumsum(energy.topk(max(sparse), sorted=True).values, 0, dtype=torch.float64) if sparse else None
        total = float(energy.sum(dtype=torch.float64)) if sparse else 0.0
        return [rounding_error(g, wire_dtype(level, grad.dtype)) if 2 * k >= numel
                else max(0.0, total - float(kept[k - 1])) for level, k in zip(levels, ks)]

    def init_state(self, name: str, grad: torch.Tensor, level: Level = NORMAL) -> TopKState:
        residual = torch.zeros(grad.numel(), dtype=residual_dtype(grad.dtype), device=grad.device)
        return TopKState(name, grad.shape, level, self.level_k(level, grad.numel()), residual)

    def set_level(self, state: TopKState, level: Level) -> None:
        state.k = self.level_k(level, state.residual.numel())
        state.level = level

    def trim(self, state: TopKState, values: torch.Tensor, indices: torch.Tensor,
             k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """From an encoded selection, keep only its k largest magnitudes (ties to the lower
        index, as the kernel's), in index order; the others go back into the error feedback.
        Equal to encoding at k directly."""
        if k >= values.numel():
            return values, indices
        order = torch.sort(values.abs(), descending=True, stable=True).indices  # indices ascend: ties ok
        keep, drop = order[:k].sort().values, order[k:]
        state.residual[indices[drop].long()] = values[drop].to(state.residual.dtype)
        state.kept_sq = values[keep].double().square().sum()
        state.k = k
        return values[keep], indices[keep]

    def restore(self, state: TopKState, values: torch.Tensor, indices: torch.Tensor,
                where: torch.Tensor | None = None) -> None:
        """Undo an encode: the selected entries go back into the error feedback, which then
        holds the whole g = grad + e again. With ``where`` (a 0-d bool tensor), only if it is
        True, decided on the device."""
        values = values.to(state.residual.dtype)
        if where is None:
            state.residual[indices.long()] = values
        elif _kernel_ok(state.residual):
            ops.restore_if_(state.residual, indices, values.contiguous(), where)
        else:  # float64: the encode left those entries at zero, so adding is writing
            state.residual.index_add_(0, indices, torch.where(where, values, 0.0))

    def state_to_dict(self, state: TopKState) -> dict:
        """A layer's state as plain values and tensors (copies), for checkpoints."""
        return {"shape": list(state.shape), "level": state.level.to_state(), "k": state.k, "residual": state.residual.clone(),
                "g_sq": float(state.g_sq), "kept_sq": float(state.kept_sq)}

    def state_from_dict(self, name: str, d: dict) -> TopKState:
        shape = torch.Size(d["shape"])
        level, k, residual = Level.from_state(d["level"]), int(d["k"]), d["residual"]
        numel = math.prod(shape)
        # A step a per-step policy sent DENSE keeps the k it was encoded at (any k fits then).
        if (level != DENSE and k != self.level_k(level, numel)) or tuple(residual.shape) != (numel,):
            raise ValueError(f"TopK state of {name!r} does not fit this codec: level {level!r} needs k "
                             f"{self.level_k(level, numel)}, got k {k}, residual {tuple(residual.shape)} "
                             f"(expected {(numel,)})")
        return TopKState(name, shape, level, k, residual.clone(), float(d["g_sq"]), float(d["kept_sq"]))

    def sends_dense(self, state: TopKState) -> bool:
        """At a level keeping half the entries or more, values plus indices would cost more
        than the dense tensor: such a step goes through the ordinary dense allreduce instead
        (which also makes ratio 1.0 exactly Horovod's dense average)."""
        return 2 * state.k >= state.residual.numel()

    def flush_dense(self, state: TopKState, grad: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        """For a dense step: returns ``grad + e`` in the gradient's dtype (float16 at DENSE16),
        to be allreduced as it is (NaN if ``finite`` is False, and then ``e`` is not touched).
        ``e`` holds the whole ``g = grad + e`` until ``settle_dense`` at the end of the step
        (so a skipped step can keep it); then only what the dtype rounded away."""
        out = flush_whole(state.residual, grad, state.level, finite)
        state.g_sq = state.kept_sq = out.double().square().sum()
        return out

    @staticmethod
    def settle_dense(state: TopKState, sent_dtype: torch.dtype, done: torch.Tensor) -> None:
        """After a dense step, if ``done`` (0-d bool: the step was not skipped): ``e`` keeps
        only what ``sent_dtype`` (``flush_dense``'s) rounded away. Decided on the device."""
        settle_sent(state.residual, sent_dtype, done)

    def encode(self, state: TopKState, grad: torch.Tensor,
               finite: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (values, int32 indices) to exchange; updates the error feedback. With
        ``finite`` (0-d bool) False the gradient is not folded in: the selection is from ``e``
        alone (the caller sends NaN in its place, and a skipped step restores it).

        The fused kernel (``accordion::topk_ef``) serves float32 residuals on the CPU and, in a
        build with CUDA kernels, on the GPU; other cases (float64 gradients) use the
        plain-torch reference. The squared norms stay on the device.
        """
        flat = grad.reshape(-1)
        if _kernel_ok(state.residual):
            values, indices, g_sq, kept_sq = ops.topk_ef(flat, state.residual, state.k, finite)
        else:
            if finite is not None:
                flat = flat.masked_fill(~finite, 0.0)
            values, indices, state.residual, g_sq, kept_sq = reference.topk_select(flat, state.residual, state.k)
        state.g_sq, state.kept_sq = g_sq, kept_sq
        return values, indices

    @staticmethod
    def encodes_many(state: TopKState) -> bool:
        """Whether the layer can be encoded with the others of its bucket in one call
        (``encode_many``): its residual is float32 on a device with kernels."""
        return _kernel_ok(state.residual)

    def encode_many(self, states: list[TopKState], grads: list[torch.Tensor], finite: torch.Tensor) -> torch.Tensor:
        """``encode`` for several layers in one kernel call (``accordion::topk_ef_many``):
        returns the bytes their bucket sends (layer by layer, each layer's k values then its
        k int32 indices). ``finite`` (1-d bool, one flag per layer): a layer flagged False
        sends NaN values and keeps its error feedback as it was (nothing to undo)."""
        payload, g_sq, kept_sq = ops.topk_ef_many([g.reshape(-1) for g in grads], [s.residual for s in states],
                                                  [s.k for s in states], finite)
        for state, a, b in zip(states, g_sq.unbind(), kept_sq.unbind()):
            state.g_sq, state.kept_sq = a, b
        return payload

    @staticmethod
    def restore_many(states: list[TopKState], payload: torch.Tensor, ks: list[int], where: torch.Tensor) -> None:
        """Undo ``encode_many`` (it sent ``payload``, at the ``ks`` then) for the layers where
        ``where`` (1-d bool, one per layer) is True, decided on the device."""
        ops.restore_many_if_([s.residual for s in states], payload, ks, where)

    def decode(self, state: TopKState, values: torch.Tensor, indices: torch.Tensor, world_size: int,
               grad_dtype: torch.dtype, bad: torch.Tensor | None = None) -> torch.Tensor:
        """The average of all ranks' sparse vectors, shaped and typed like the gradient. An
        index outside the layer (corrupted data) raises; with ``bad`` (0-d bool) it is
        skipped and sets ``bad`` instead, on the device."""
        numel = state.residual.numel()
        if _kernel_ok(values):
            return ops.sparse_average(values, indices, numel, world_size, grad_dtype, bad).view(state.shape)
        if bad is not None:  # the reference's index_add_ would raise: mask, on the device
            inside = (indices >= 0) & (indices < numel)
            bad |= ~inside.all()
            values, indices = torch.where(inside, values, 0.0), torch.where(inside, indices, 0)
        dense = reference.sparse_average(values, indices, numel, world_size)
        return dense.to(grad_dtype).view(state.shape)


def _kernel_ok(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and ops.has_kernel(t)
