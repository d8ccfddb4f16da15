"""The data-plane interface the compressor needs: named, asynchronous, batched collectives.

Every collective carries a name. Ranks pair collectives by name, so a rank that issued a
different sequence (a different layer set, another level) fails loudly instead of summing
the wrong tensors.

Nothing may hang: ``wait`` gives up after a timeout (``ACCORDION_COLLECTIVE_TIMEOUT``
seconds, default 300) and raises a ``TimeoutError`` naming the collective, because a
collective that another rank never submits would otherwise block every rank forever.
"""

from __future__ import annotations

import math
import numbers
import os
import time
from typing import Any, Callable

import torch

Handle = Any  # opaque, channel-specific

TIMEOUT_ENV = "ACCORDION_COLLECTIVE_TIMEOUT"
DEFAULT_TIMEOUT = 300.0

# wait_for polls with a growing pause: quick for collectives that are about to finish, cheap
# (1000 polls/s at most) for long ones, and never more than _MAX_PAUSE late.
_FIRST_PAUSE, _MAX_PAUSE = 1e-5, 1e-3


try:
    from horovod.common.exceptions import HorovodInternalError
except ImportError:  # the math and the unit tests run without Horovod
    HorovodInternalError = RuntimeError


class CollectiveTimeout(TimeoutError, HorovodInternalError):
    """A collective did not complete within the collective timeout. A ``TimeoutError``, and
    Horovod's ``HorovodInternalError`` so that Horovod Elastic treats it as a lost worker
    (restores the last commit, re-forms the world) instead of ending the job."""


class Channel:
    """The data plane's contract: subclass it. The three collectives below are required;
    the rest are optional, with the defaults written here (a channel overrides what it has)."""

    rank: int
    size: int
    timeout: float  # seconds a wait() may take before it raises TimeoutError

    def allreduce_mean_async(self, tensors: list[torch.Tensor], name: str) -> Handle:
        """Start averaging each tensor over all ranks (one batched round)."""
        raise NotImplementedError

    def allgather_async(self, tensor: torch.Tensor, name: str) -> Handle:
        """Start concatenating every rank's 1-D ``tensor`` (same length everywhere), rank order."""
        raise NotImplementedError

    def wait(self, handle: Handle) -> Any:
        """Finish a collective: a list of averaged tensors, or the gathered tensor.

        Raises ``collective_timeout_error(...)`` if it does not complete within ``timeout``
        seconds (usually: another rank never submitted a collective of that name)."""
        raise NotImplementedError

    # --- optional -----------------------------------------------------------------------------
    def test(self, handle: Handle) -> bool:
        """Whether a collective has completed, never waiting. Default False (not known: a
        channel whose collectives happen in ``wait``); callers then wait in their fixed order."""
        return False

    def lane(self, name: str) -> "Channel":
        """A channel whose collectives pair independently of this one's (exchange/buckets.py
        ``lane``). Default: this channel itself (one that pairs collectives by name needs none)."""
        return self

    def control_plane(self):
        """The control plane that goes with this channel, or None (default: comm/planes.py
        chooses one)."""
        return None

    def note_step(self, step: int) -> None:
        """The optimizer step this rank is in now, for a failure's diagnosis (default: unused)."""

    def forget_handles(self) -> None:
        """The world was re-formed: collectives in flight will never complete (default: nothing kept)."""

    def close(self) -> None:
        """This channel is replaced (a re-formed world): release what it holds (default: nothing)."""


def check_channel(what: str, channel) -> None:
    """A channel given by a caller is a ``Channel`` (else a TypeError naming ``what``)."""
    if not isinstance(channel, Channel):
        raise TypeError(f"{what} must be an accordion_hvd.comm.channel.Channel (subclass it: the three collectives "
                        f"are required, the rest have defaults), got {type(channel).__name__}")


def collective_timeout(timeout: float | None = None) -> float:
    """Seconds a collective may take: ``timeout`` if given, else $ACCORDION_COLLECTIVE_TIMEOUT,
    else 300. ``math.inf`` waits forever."""
    source = "timeout"
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV, "").strip()
        if not raw:
            return DEFAULT_TIMEOUT
        source = TIMEOUT_ENV
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{source} must be a number of seconds, got {type(timeout).__name__}")
    if math.isnan(timeout) or timeout <= 0:
        raise ValueError(f"{source} must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def collective_timeout_error(name: str, rank: int, size: int, timeout: float) -> "CollectiveTimeout":
    """The error every channel raises when a collective does not complete in time. It says
    which ranks stopped answering when the data plane keeps heartbeats (comm/liveness.py)."""
    from .liveness import diagnose  # torch.distributed, imported only on the way out

    head = f"AccordionCompressor: collective {name!r} did not complete within {timeout:g} s on rank {rank} " \
           f"(world size {size})"
    why = diagnose()
    if "not responding" in why or "unreachable" in why:
        return CollectiveTimeout(f"{head}: {why}. The job cannot go on without that rank; under Horovod Elastic "
                                 f"it resumes from the last commit once the rank is reachable again.")
    return CollectiveTimeout(
        f"{head}. Usually the ranks disagree on their configuration or on which layers get "
        f"compressed (different models, or parameters that require gradients on some ranks only), so "
        f"another rank never submitted {name!r}. If a rank is merely slow, raise {TIMEOUT_ENV} (seconds)."
        + (f" Diagnosis: {why}." if why else ""))


def wait_for(done: Callable[[], bool], name: str, rank: int, size: int, timeout: float) -> None:
    """Poll ``done()`` until it returns True; after ``timeout`` seconds raise
    ``collective_timeout_error``. Every wait on a collective goes through here, never through a
    blocking wait (``hvd.synchronize``, ``MPI_Wait``), which would hang forever on a collective
    that another rank never submits."""
    if not poll_until(done, time.monotonic() + timeout):
        raise collective_timeout_error(name, rank, size, timeout)


def poll_until(done: Callable[[], bool], deadline: float = math.inf) -> bool:
    """Call ``done()`` with growing sleeps between calls (the CPU stays free for others) until
    it returns True, or until ``time.monotonic()`` passes ``deadline``; returns which."""
    pause = _FIRST_PAUSE
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, _MAX_PAUSE)
    return True
