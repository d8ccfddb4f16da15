"""The seam between the Horovod front end (horovod/compressor.py) and Horovod's
``DistributedOptimizer``: which parameter a gradient is, which optimizer, which ``op``.

Horovod calls ``compression.compress(tensor)`` with the gradient only; the front end needs to
know which parameter it is (error feedback and levels are per layer, and results are handed
out by name, never by hook order, which differs between ranks). Two ways, both here:

* ``GradientNames``, when the user passes ``named_parameters=`` to ``AccordionCompressor``
  (the same as to ``hvd.DistributedOptimizer``): the parameter whose ``.grad`` *is* the
  tensor. Horovod hands ``p.grad`` itself to ``compress`` (grouped or not). The search
  starts where the previous step's order says the next gradient will be, so a step costs
  O(parameters), not O(parameters^2), even though torch makes new gradient tensors every
  step.
* ``horovod_parameter``, the fallback for the one-line usage: the parameter is read from
  Horovod's calling frame (``_allreduce_grad_async(self, p)``, or the comprehension of
  ``_grouped_allreduce_grad_async``) and its name from the optimizer's own
  ``_parameter_names``, the name Horovod itself uses for the collective. Exact, independent
  of hook order, and it fails loudly if called from anywhere else; but it reads Horovod's
  private frames, so a future Horovod may break it where ``named_parameters=`` will not.

Either way, Horovod's optimizer is looked for in the calling frames once (``find_optimizer``)
for its learning rates, which the regime controller watches.

Keeping gradients off Horovod's data path is horovod/patches.py.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable

import torch

_MAX_DEPTH = 6  # frames between compress() and Horovod's method that calls it


class GradientNames:
    """Which of ``named_parameters`` a gradient belongs to, by identity.

    Args:
        named_parameters: (name, parameter) pairs, as ``model.named_parameters()`` gives.
    """

    def __init__(self, named_parameters: Iterable[tuple[str, torch.Tensor]]) -> None:
        try:
            pairs = list(named_parameters)
        except TypeError:
            raise TypeError(f"named_parameters must be an iterable of (name, parameter) pairs, as "
                            f"model.named_parameters() gives; got {type(named_parameters).__name__}") from None
        seen: set[str] = set()
        for i, pair in enumerate(pairs):
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                    and isinstance(pair[1], torch.Tensor)):
                raise TypeError(f"named_parameters[{i}] must be a (str, torch.Tensor) pair, got {pair!r:.80}")
            if pair[0] in seen:
                raise ValueError(f"named_parameters has the name {pair[0]!r} twice")
            seen.add(pair[0])
        if not pairs:
            raise ValueError("named_parameters is empty")
        self._pairs = pairs
        self._order = list(range(len(pairs)))  # where to look first: the last step's arrival order
        self._pending = list(self._order)      # this step: parameters whose gradient has not come yet
        self._arrived: list[int] = []

    def name_of(self, grad: torch.Tensor) -> str:
        """The name of the parameter whose ``.grad`` is ``grad`` (once per step each)."""
        for j, i in enumerate(self._pending):
            if self._pairs[i][1].grad is grad:
                del self._pending[j]
                self._arrived.append(i)
                return self._pairs[i][0]
        raise RuntimeError(
            "AccordionCompressor: compress() got a gradient that is not the .grad of any parameter in "
            "named_parameters (or that parameter's gradient was compressed already this step); pass "
            "AccordionCompressor the same named_parameters as hvd.DistributedOptimizer")

    def end_step(self) -> None:
        """The step is over: next step, look in this step's arrival order first."""
        pending = set(self._pending)
        self._order = self._arrived + [i for i in self._order if i in pending]
        self._pending, self._arrived = list(self._order), []

    def forget_step(self) -> None:
        """The step was dropped (Elastic): start the next one afresh, keeping the learned order."""
        self._pending, self._arrived = list(self._order), []


def horovod_parameter() -> tuple[str, Any]:
    """The name of the parameter whose gradient Horovod is compressing, and Horovod's
    optimizer, from the calling frames (see module doc)."""
    frame = sys._getframe(2)  # skip this function and compress()
    param = None
    for _ in range(_MAX_DEPTH):
        if frame is None:
            break
        local = frame.f_locals
        if param is None and isinstance(local.get("p"), torch.Tensor):
            param = local["p"]
        owner = local.get("self")
        if param is not None and owner is not None and hasattr(owner, "_parameter_names"):
            name = owner._parameter_names.get(param)
            if name is not None:
                return name, owner
        frame = frame.f_back
    raise RuntimeError(
        "AccordionCompressor.compress() must be called by horovod.torch.DistributedOptimizer "
        "(pass it as compression=...): it could not find which parameter this gradient belongs to. "
        "Pass named_parameters= to AccordionCompressor, or call compress_named(name, tensor) directly.")


def find_optimizer() -> Any | None:
    """Horovod's ``DistributedOptimizer`` calling ``compress``, if it is in the calling frames."""
    frame = sys._getframe(2)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and hasattr(owner, "_parameter_names") and hasattr(owner, "param_groups"):
            return owner
        frame = frame.f_back
    return None


# Horovod's reduction ops that the compressor can honour, and how: it always computes the
# average over all ranks, and a sum is that average times the number of ranks.
_OP_NAMES = ("Average", "Sum", "Adasum", "Min", "Max", "Product")


def horovod_op_name(optimizer: Any) -> str:
    """The ``op`` Horovod's optimizer reduces with, by name ("Average", "Sum", "Adasum", ...).

    Horovod builds its Adasum optimizer (``op=hvd.Adasum`` on more than one rank) as another
    class, with no ``op`` attribute, which compresses each parameter's *delta* after a local
    step, not its gradient: it is recognised by the starting models it keeps."""
    import horovod.torch as hvd

    if hasattr(optimizer, "_starting_models"):
        return "Adasum"
    op = getattr(optimizer, "op", hvd.Average)
    return next((name for name in _OP_NAMES if getattr(hvd, name, None) == op), repr(op))


def reduction_scale(optimizer: Any) -> float:
    """What the compressor's averages are multiplied by to give what Horovod's optimizer
    asked for: 1 for ``op=hvd.Average`` (also with ``gradient_predivide_factor``, which only
    splits the same average into a pre- and a post-scale), ``hvd.size()`` for ``op=hvd.Sum``.
    Any other op, and a process set smaller than the world, is refused with a ValueError
    naming the argument (the same on every rank that runs the optimizer), before any
    collective (ranks outside a process set never call the compressor): a compressed
    gradient cannot be reduced with Adasum, Min, Max or Product, and the compressor's data
    plane reduces over all of Horovod's ranks."""
    if optimizer is None:  # compress() called outside Horovod's optimizer: the average, as documented
        return 1.0
    import horovod.torch as hvd

    op = horovod_op_name(optimizer)
    if op not in ("Average", "Sum"):
        raise ValueError(f"AccordionCompressor cannot honour op=hvd.{op} of hvd.DistributedOptimizer: compressed "
                         f"gradients can only be averaged (op=hvd.Average, the default) or summed (op=hvd.Sum); "
                         f"pass one of those, or use compression=hvd.Compression.none with op=hvd.{op}")
    ranks = getattr(getattr(optimizer, "process_set", None), "ranks", None)  # None or []: the global set
    if ranks and sorted(ranks) != list(range(hvd.size())):
        raise ValueError(f"AccordionCompressor cannot honour process_set= of hvd.DistributedOptimizer (ranks "
                         f"{sorted(ranks)} of {hvd.size()}): its data plane reduces over all of Horovod's ranks; "
                         f"use the global process set (the default)")
    return float(hvd.size()) if op == "Sum" else 1.0


def bypass_allowed(optimizer: Any) -> str | None:
    """Why Horovod's optimizer must still carry the uncompressed gradients (None: it need
    not). Once ``reduction_scale`` has accepted the optimizer's op and process set, our
    data plane can carry them too (a sum is the average scaled); only an optimizer that
    was not found keeps them on Horovod."""
    if optimizer is None:
        return "Horovod's optimizer was not found in the calling frames"
    return None
