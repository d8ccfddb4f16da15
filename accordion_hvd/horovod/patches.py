"""Everything the Horovod front end changes in Horovod itself, in one place, applied only
when Horovod first calls an ``AccordionCompressor`` (importing the package changes nothing),
except the construction check, which changes nothing for any other compression.

**Checking an optimizer as it is built** (``install_construction_check``). Horovod calls the
compressor only at the first backward, and only on the ranks inside the optimizer's process
set: a refusal raised there (an op or a process set the compressor cannot honour, one
compressor for two optimizers) would reach some ranks and leave the others waiting in
Horovod's collectives. So ``hvd.DistributedOptimizer`` is wrapped where ``horovod.torch`` was
imported before this package or before a compressor was made: an optimizer built with ours is checked right
after Horovod builds it, on every rank that builds it, before any collective. Any other
compression passes through untouched.

**How the optimizer waits** (``install_polite_wait``). ``DistributedOptimizer.synchronize()``
waits on every gradient's handle with ``hvd.synchronize``, which busy-waits; with "sleep"
(the default) it polls with growing sleeps instead (comm/horovod.py, ``polite_synchronize``),
so a waiting rank leaves the CPU to the ranks still in backward. Process-wide: Horovod's
optimizer module calls one ``synchronize``.

**Keeping gradients off Horovod's data path** (``install_bypass``). Horovod's optimizer
hands whatever ``compress`` returns to ``allreduce_async_`` and later gives the result and
the context to ``decompress``. The compressor exchanges every floating-point gradient on its
own data plane, so what it returns is a placeholder (``placeholder``): an empty tensor that
carries nothing. Submitting it to Horovod anyway would cost a negotiation round and a
background-loop cycle per step for no data (measured: docs/design.md, "Measured reasons"),
so the optimizer module's ``allreduce_async_`` and ``grouped_allreduce_async_`` are wrapped:
a placeholder (or a group of nothing but placeholders) gets a ``LocalResult`` handle, which
Horovod's ``synchronize`` returns at once (``optimizer_synchronize`` below). Every other tensor, and any
caller other than Horovod's optimizer, goes to Horovod as before.

**Horovod's background cycle** (``quiet_horovod_cycle``): the user's choice, before
``hvd.init()``.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch

from ..comm.horovod import polite_synchronize

WAIT_ENV = "ACCORDION_HOROVOD_WAIT"  # overrides wait=: "sleep" ("poll" too) or "spin" (Horovod's own)
WAIT_MODES = ("sleep", "spin")
CYCLE_ENV = "HOROVOD_CYCLE_TIME"     # Horovod's own setting, read once by hvd.init()
# Horovod's background loop wakes every cycle and runs a small collective with every other
# rank, work or not: at Horovod's default of 1 ms that costs a visible share of a core per
# worker (measured: docs/design.md, "Measured reasons"). Our gradients, compressed or
# not, travel on our own Gloo group (comm/gloo.py) and none reaches Horovod's loop in a
# step (``install_bypass`` below), so a cycle of 20 ms costs our steps nothing; it only
# delays what still goes through Horovod (broadcasts, a job's own collectives). It is the
# user's choice, made explicitly with ``quiet_horovod_cycle()`` before ``hvd.init()``:
# importing the package changes nothing, so a plain Horovod baseline in the same script
# runs at Horovod's own default.
QUIET_CYCLE_MS = 20

_PLACEHOLDER = "_accordion_placeholder"  # attribute marking the tensors compress() returns for no data

log = logging.getLogger("accordion_hvd.horovod")


class LocalResult:
    """A handle for a collective that never reached Horovod: it is its own result.

    Horovod's optimizer calls ``handle()`` on a callable handle and ``synchronize(handle)``
    on a grouped one; ``optimizer_synchronize`` returns ``value`` for it either way."""

    __slots__ = ("value",)

    def __init__(self, value) -> None:
        self.value = value

    def __call__(self):
        return self.value


_wait_mode = "sleep"  # how optimizer_synchronize waits for Horovod's own collectives


def optimizer_synchronize(handle):
    """What Horovod's optimizer module calls as ``synchronize``: a ``LocalResult``'s value, or
    Horovod's result waited for politely (sleeping) or Horovod's way (spinning)."""
    if isinstance(handle, LocalResult):
        return handle.value
    if _wait_mode == "sleep":
        return polite_synchronize(handle)
    import horovod.torch.mpi_ops as hvd_mpi_ops
    return hvd_mpi_ops.synchronize(handle)


def installed_wait() -> str | None:
    """How Horovod's optimizer waits now: "sleep", "spin", or None (untouched: Horovod's own)."""
    import horovod.torch.optimizer as hvd_optimizer
    return _wait_mode if hvd_optimizer.synchronize is optimizer_synchronize else None


def quiet_horovod_cycle(ms: float = QUIET_CYCLE_MS) -> bool:
    """Make Horovod's background loop wake every ``ms`` milliseconds instead of every 1 ms
    (its default), for a job whose gradients all go through ``AccordionCompressor``: call it
    before ``hvd.init()``, which reads ``$HOROVOD_CYCLE_TIME`` once. It saves the CPU that the
    idle loop burns (docs/horovod-cycle.md: what it costs and saves, measured) and delays
    whatever still goes through Horovod by up to ``ms`` (broadcasts, your own
    ``hvd.allreduce`` calls, gradients of an optimizer without our compressor).

    A value already in the environment (the user's, or the launcher's) is kept. Returns
    whether the cycle is now ``ms``. Raises ``RuntimeError`` after ``hvd.init()``: the
    setting would silently do nothing."""
    positive = ms if isinstance(ms, (int, float)) and not isinstance(ms, bool) and ms > 0 else None
    if positive is None:
        raise ValueError(f"ms must be a positive number of milliseconds, got {ms!r}")
    hvd = sys.modules.get("horovod.torch")
    try:
        initialized = hvd is not None and hvd.is_initialized()
    except Exception:  # noqa: BLE001 - a half-imported Horovod: treat as not initialized
        initialized = False
    if initialized:
        raise RuntimeError("quiet_horovod_cycle() must be called before hvd.init(): Horovod reads "
                           f"${CYCLE_ENV} once, when it starts")
    current = os.environ.get(CYCLE_ENV)
    if current:
        log.info("%s=%s kept (set in the environment)", CYCLE_ENV, current)
        return current == f"{ms:g}"
    os.environ[CYCLE_ENV] = f"{ms:g}"
    return True


def cycle_hint() -> str | None:
    """The hint for a job whose every gradient goes through our compressor at Horovod's
    default cycle (None when the cycle was chosen: ``$HOROVOD_CYCLE_TIME`` or autotuning set)."""
    if os.environ.get(CYCLE_ENV) or os.environ.get("HOROVOD_AUTOTUNE"):
        return None
    return (f"AccordionCompressor carries every gradient of this job, yet Horovod's background loop still wakes every "
            f"1 ms (its default cycle) and burns CPU that forward and backward need: measured on ResNet-18 (2 nodes, "
            f"100 Mbit/s) our step was 1.29x PyTorch's powerSGD_hook at 1 ms, 1.06x at 20 ms. Call "
            f"acc.quiet_horovod_cycle() before hvd.init(), or launch with {CYCLE_ENV}={QUIET_CYCLE_MS} "
            f"(docs/horovod-cycle.md)")


def install_construction_check(on_build) -> None:
    """Wrap ``hvd.DistributedOptimizer`` (module doc): ``on_build(compression, optimizer)``
    runs right after Horovod builds an optimizer, before it is returned; it raises to refuse
    it. Process-wide and idempotent; nothing happens before ``horovod.torch`` is imported."""
    hvd = sys.modules.get("horovod.torch")
    hvd_optimizer = sys.modules.get("horovod.torch.optimizer")
    if hvd is None or hvd_optimizer is None or getattr(hvd.DistributedOptimizer, "_accordion_check", False):
        return
    import functools
    import inspect

    build = hvd.DistributedOptimizer
    signature = inspect.signature(build)

    # functools.wraps keeps Horovod's __module__ too: hvd.broadcast_optimizer_state compares an
    # optimizer's __module__ with DistributedOptimizer's to tell Horovod's optimizer from a
    # plain one, and steps a plain one; with another __module__ it would step Horovod's on one
    # rank only, a collective no other rank joins (a hang, found by Horovod's own test suite).
    @functools.wraps(build)
    def DistributedOptimizer(*args, **kwargs):  # noqa: N802 - Horovod's name
        optimizer = build(*args, **kwargs)
        on_build(signature.bind(*args, **kwargs).arguments.get("compression"), optimizer)
        return optimizer

    DistributedOptimizer._accordion_check = True
    hvd.DistributedOptimizer = hvd_optimizer.DistributedOptimizer = DistributedOptimizer


def check_wait(wait: str) -> str:
    if wait not in WAIT_MODES:
        raise ValueError(f"wait must be 'sleep' or 'spin', got {wait!r}")
    return wait


def install_polite_wait(wait: str = "sleep") -> bool:
    """How ``hvd.DistributedOptimizer`` waits on its collectives, process-wide: "sleep"
    (``polite_synchronize``) or "spin" (Horovod's own busy wait); $ACCORDION_HOROVOD_WAIT
    overrides ``wait``. Idempotent. Returns whether the polite wait is on."""
    env = os.environ.get(WAIT_ENV, "").strip().lower()
    if env:
        if env not in ("sleep", "poll", "spin"):
            raise ValueError(f"{WAIT_ENV} must be 'sleep' (or 'poll') or 'spin', got {env!r}")
        wait = "sleep" if env == "poll" else env
    global _wait_mode
    check_wait(wait)
    import horovod.torch.optimizer as hvd_optimizer

    polite = wait == "sleep"
    if hvd_optimizer.synchronize is not optimizer_synchronize or _wait_mode != wait:
        hvd_optimizer.synchronize = optimizer_synchronize
        _wait_mode = wait
        log.info("Horovod's DistributedOptimizer now %s while it waits for a collective (wait=%r; $%s overrides)",
                 "sleeps between polls" if polite else "spins", wait, WAIT_ENV)
    return polite


def placeholder(like: torch.Tensor) -> torch.Tensor:
    """An empty tensor for Horovod's optimizer to carry instead of a gradient that travels on
    the compressor's own data plane; with ``install_bypass`` it never reaches Horovod."""
    empty = like.new_empty(0)
    setattr(empty, _PLACEHOLDER, True)
    return empty


def is_placeholder(tensor: Any) -> bool:
    return getattr(tensor, _PLACEHOLDER, False) is True


def install_bypass() -> None:
    """Wrap the collectives Horovod's optimizer module issues so that placeholders skip
    Horovod (see module doc). Process-wide and idempotent."""
    import horovod.torch.optimizer as hvd_optimizer

    if getattr(hvd_optimizer.allreduce_async_, "_accordion_bypass", False):
        return
    horovod_allreduce, horovod_grouped = hvd_optimizer.allreduce_async_, hvd_optimizer.grouped_allreduce_async_

    def allreduce_async_(tensor, *args, **kwargs):
        if is_placeholder(tensor):
            return LocalResult(tensor)
        return horovod_allreduce(tensor, *args, **kwargs)

    def grouped_allreduce_async_(tensors, *args, **kwargs):
        if tensors and all(is_placeholder(t) for t in tensors):
            return LocalResult(list(tensors))
        return horovod_grouped(tensors, *args, **kwargs)

    for wrapper, original in ((allreduce_async_, horovod_allreduce), (grouped_allreduce_async_, horovod_grouped)):
        wrapper._accordion_bypass = True
        wrapper.__wrapped__ = original
        wrapper.__doc__ = f"Horovod's {original.__name__}, except for the compressor's placeholders (accordion_hvd)."
    hvd_optimizer.allreduce_async_ = allreduce_async_
    hvd_optimizer.grouped_allreduce_async_ = grouped_allreduce_async_
