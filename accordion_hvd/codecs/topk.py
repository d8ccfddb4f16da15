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
from ..levels import CRITICAL, DENSE, NORMAL, Level, check_level, positive_number
from ._common import residual_dtype


@dataclass
class TopKState:
    name: str
    shape: torch.Size
    level: Level
    k: int
    residual: torch.Tensor  # flat, numel entries
    g_sq: float = 0.0       # squared norms of the last step: g, and the part sent
    kept_sq: float = 0.0


class TopK:
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
        ``critical_ratio`` (CRITICAL), ``ceil(numel / f)`` (``Level.factor(f)``), all (DENSE)."""
        check_level("level", level)
        if level.kind == "factor":
            return max(1, min(numel, math.ceil(numel / level.compression_factor)))
        if level == DENSE:
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
        buckets; else each rank's k values and int32 indices are allgathered in its bucket."""
        numel = math.prod(shape)
        k = self.level_k(level, numel)
        if 2 * k >= numel:
            return (("dense", itemsize * numel),)
        return (("allgather", (itemsize + 4) * k),)

    @torch.no_grad()
    def level_errors(self, state: TopKState, grad: torch.Tensor, levels: tuple[Level, ...]) -> list[float]:
        """Squared error ``||g - C(g)||^2`` of compressing ``g = grad + e`` at each of ``levels``:
        exactly the energy of the entries outside the top k (0 for a level sent dense). As
        PowerSGD's: the squares in the residual's precision (what the encoder selects on),
        only their sums in float64."""
        energy = (grad.reshape(-1).to(state.residual.dtype) + state.residual).square()
        numel = energy.numel()
        ks = [self.level_k(level, numel) for level in levels]
        sparse = [k for k in ks if 2 * k < numel]  # the others are sent dense: no error
        if not sparse:
            return [0.0] * len(levels)
        kept = torch.cumsum(energy.topk(max(sparse), sorted=True).values, 0, dtype=torch.float64)
        total = float(energy.sum(dtype=torch.float64))
        return [0.0 if 2 * k >= numel else max(0.0, total - float(kept[k - 1])) for k in ks]

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
        state.kept_sq = values[keep].double().square().sum().item()
        state.k = k
        return values[keep], indices[keep]

    def restore(self, state: TopKState, values: torch.Tensor, indices: torch.Tensor) -> None:
        """Undo an encode: the selected entries go back into the error feedback, which then
        holds the whole g = grad + e again."""
        state.residual[indices.long()] = values.to(state.residual.dtype)

    def state_to_dict(self, state: TopKState) -> dict:
        """A layer's state as plain values and tensors (copies), for checkpoints."""
        return {"shape": list(state.shape), "level": state.level.to_state(), "k": state.k, "residual": state.residual.clone(),
                "g_sq": state.g_sq, "kept_sq": state.kept_sq}

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

    def flush_dense(self, state: TopKState, grad: torch.Tensor) -> torch.Tensor:
        """For a dense step: returns ``grad + e`` in the gradient's dtype, to be allreduced as
        it is. ``e`` holds the whole ``g = grad + e`` until ``settle_dense`` at the end of the
        step (so a skipped step can keep it); then only what the dtype rounded away."""
        g = ops.ef_add_(grad.reshape(-1), state.residual)
        out = g.to(grad.dtype, copy=True)  # never g itself: Horovod averages it in place
        state.g_sq = state.kept_sq = out.double().square().sum().item()
        return out.view(grad.shape)

    @staticmethod
    def settle_dense(state: TopKState, grad_dtype: torch.dtype) -> None:
        """After a dense step went through: ``e`` keeps only what ``grad_dtype`` rounded away."""
        e = state.residual
        if grad_dtype == e.dtype:
            e.zero_()
        else:
            e.sub_(e.to(grad_dtype).to(e.dtype))

    def poisoned(self, state: TopKState) -> tuple[torch.Tensor, torch.Tensor]:
        """What a rank sends for a layer whose gradient is not finite: NaN values (so every
        rank sees the fault in the exchanged data) at valid indices; ``e`` is not touched."""
        state.g_sq = state.kept_sq = float("nan")
        return (torch.full((state.k,), float("nan"), dtype=state.residual.dtype, device=state.residual.device),
                torch.zeros(state.k, dtype=torch.int32, device=state.residual.device))

    def encode(self, state: TopKState, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (values, int32 indices) to exchange; updates the error feedback.

        The fused kernel (``accordion::topk_ef``) serves float32 residuals on the CPU and, in a
        build with CUDA kernels, on the GPU; other cases (float64 gradients) use the
        plain-torch reference.
        """
        flat = grad.reshape(-1)
        if _kernel_ok(state.residual):
            values, indices, g_sq, kept_sq = ops.topk_ef(flat, state.residual, state.k)
        else:
            values, indices, state.residual, g_sq, kept_sq = reference.topk_select(flat, state.residual, state.k)
        state.g_sq, state.kept_sq = g_sq.item(), kept_sq.item()
        return values, indices

    def decode(self, state: TopKState, values: torch.Tensor, indices: torch.Tensor, world_size: int,
               grad_dtype: torch.dtype) -> torch.Tensor:
        """The average of all ranks' sparse vectors, shaped and typed like the gradient."""
        numel = state.residual.numel()
        if _kernel_ok(values):
            return ops.sparse_average(values, indices, numel, world_size, grad_dtype).view(state.shape)
        dense = reference.sparse_average(values, indices, numel, world_size)
        return dense.to(grad_dtype).view(state.shape)


def _kernel_ok(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and ops.has_kernel(t)
