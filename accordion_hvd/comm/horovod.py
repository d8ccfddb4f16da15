"""The real data plane: Horovod's named asynchronous collectives (Gloo, MPI or NCCL).

Also the fix for a cost of Horovod itself: ``hvd.synchronize`` (Horovod 0.28.1, PyTorch)
busy-waits, burning a whole core for as long as the collective takes (measured: 0.50 s of
CPU in a 0.51 s wait for a late rank). ``DistributedOptimizer.synchronize()`` waits on every
gradient's handle that way. On a machine whose cores are shared (several workers per node,
data-loader processes, the emulated cluster) a rank that waits steals the CPU that the
ranks it waits for need to finish their backward pass, so every step is slower.
``install_polite_wait("sleep")`` makes the optimizer poll with growing sleeps instead
(``poll_until``: at most 1 ms late); results and errors are Horovod's own. It is process-wide
(Horovod's optimizer module calls one ``synchronize``): ``AccordionCompressor(wait=...)``
installs it when Horovod first calls the compressor, and the training CLI for every method.

The same hook lets a collective skip Horovod altogether: a ``LocalResult`` handed to the
optimizer as a handle is its own result (accordion_hvd/horovod_seam.py uses it for the
gradients that the compressor exchanges on its own data plane).
"""

from __future__ import annotations

import logging
import os
import sys
import time

import torch

from . import liveness
from .channel import HorovodInternalError, collective_timeout, collective_timeout_error, poll_until, wait_for

WAIT_ENV = "ACCORDION_HOROVOD_WAIT"  # overrides wait=: "sleep" ("poll" too) or "spin" (Horovod's own)
WAIT_MODES = ("sleep", "spin")
CYCLE_ENV = "HOROVOD_CYCLE_TIME"     # Horovod's own setting, read once by hvd.init()
# Horovod's background loop wakes every cycle and runs a small collective with every other
# rank, work or not: at Horovod's default of 1 ms that cost 15-25% of a core per worker on
# the emulated cluster (benchmarks/results/step-profile.md). Our gradients, compressed or
# not, travel on our own Gloo group (comm/gloo.py) and none reaches Horovod's loop in a
# step (accordion_hvd/horovod_seam.py), so a cycle of 20 ms costs our steps nothing; it only
# delays what still goes through Horovod (broadcasts, a job's own collectives). It is the
# user's choice, made explicitly with ``quiet_horovod_cycle()`` before ``hvd.init()``:
# importing the package changes nothing, so a plain Horovod baseline in the same script
# runs at Horovod's own default.
QUIET_CYCLE_MS = 20

log = logging.getLogger("accordion_hvd.comm")


HOROVOD_LOOP = "horovod.allreduce"  # how errors name Horovod's own collectives (which one is not known here)


def polite_synchronize(handle):
    """``hvd.synchronize(handle)``, sleeping between polls instead of spinning, and giving up
    after the collective timeout instead of never; a failure names the ranks that stopped
    answering (comm/liveness.py)."""
    import horovod.torch as hvd

    timeout = collective_timeout()
    try:
        done = poll_until(lambda: hvd.poll(handle), time.monotonic() + timeout)
    except (RuntimeError, ValueError):  # not a live handle: Horovod's synchronize says what it is
        done = True
    if not done:
        raise collective_timeout_error(HOROVOD_LOOP, hvd.rank(), hvd.size(), timeout)
    try:
        return hvd.synchronize(handle)
    except HorovodInternalError as exc:
        raise HorovodInternalError(_with_diagnosis(f"{HOROVOD_LOOP} failed on rank {hvd.rank()}: {exc}")) from exc


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


def _with_diagnosis(text: str) -> str:
    why = liveness.diagnose()
    return f"{text} Diagnosis: {why}." if why else text


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


class HorovodChannel:
    """Horovod's collectives, with a timeout on every wait.

    Args:
        timeout: seconds a collective may take before ``wait`` raises ``TimeoutError``;
            default $ACCORDION_COLLECTIVE_TIMEOUT, else 300. ``hvd.synchronize`` would block
            forever on a collective that another rank never submits.
    """

    def __init__(self, timeout: float | None = None) -> None:
        import horovod.torch as hvd  # imported here: the math and the tests need no Horovod

        self._hvd = hvd
        self.timeout = collective_timeout(timeout)
        self._names: dict[int, str] = {}  # handle -> collective name, until waited on

    @property
    def rank(self) -> int:
        return self._hvd.rank()

    @property
    def size(self) -> int:
        return self._hvd.size()

    def allreduce_mean_async(self, tensors: list[torch.Tensor], name: str):
        # One grouped collective: Horovod negotiates and fuses the group as a unit.
        handle = self._hvd.grouped_allreduce_async(tensors, op=self._hvd.Average, name=name)
        self._names[handle] = name
        return handle

    def allgather_async(self, tensor: torch.Tensor, name: str):
        handle = self._hvd.allgather_async(tensor, name=name)
        self._names[handle] = name
        return handle

    def forget_handles(self) -> None:
        """Horovod Elastic re-formed the world: handles in flight will never complete."""
        self._names.clear()

    def test(self, handle) -> bool:
        """Whether the collective has completed (never waits)."""
        return bool(self._hvd.poll(handle))

    def wait(self, handle):
        name = self._names.pop(handle, "<unnamed>")
        wait_for(lambda: self._hvd.poll(handle), name, self.rank, self.size, self.timeout)
        return self._hvd.synchronize(handle)
