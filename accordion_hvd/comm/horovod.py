"""The data plane through Horovod's named asynchronous collectives (Gloo, MPI or NCCL), and
``polite_synchronize``: Horovod's wait with a sleep instead of a spin, a timeout and a
diagnosis.

``hvd.synchronize`` (Horovod 0.28.1, PyTorch) busy-waits, burning a whole core for as long as
the collective takes (measured: docs/design.md, "Measured reasons"); on a machine
whose cores are shared, a rank that waits steals the CPU that the ranks it waits for need.
``polite_synchronize`` polls with growing sleeps instead (``poll_until``: at most 1 ms late).
Installing it in Horovod's optimizer, and every other change to Horovod's own behaviour, is
the Horovod front end's (accordion_hvd/horovod/patches.py).
"""

from __future__ import annotations

import logging
import time

import torch

from . import liveness
from .channel import Channel, HorovodInternalError, collective_timeout, collective_timeout_error, poll_until, wait_for

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


def _with_diagnosis(text: str) -> str:
    why = liveness.diagnose()
    return f"{text} Diagnosis: {why}." if why else text


class HorovodChannel(Channel):
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
