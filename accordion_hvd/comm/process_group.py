"""A data plane on ``torch.distributed`` process groups (Gloo or NCCL), with lanes.

The collectives that carry compressed gradients under both front ends: under Horovod the
groups are built from Horovod's world (comm/gloo.py), under DDP they are new groups of the
model's ranks (accordion_hvd/ddp.py). A collective starts on the
group's worker threads the moment it is issued; ranks pair collectives by the order they
issue them on a group, which the exchange keeps identical on every rank (accordion_hvd/
exchange/). A **lane** is a further group of the same ranks: collectives on different lanes
pair independently, so a rank may interleave its issues on two lanes in any order
(PowerSGD's Q rounds start when each bucket's P average is back, a matter of timing).

Every wait has the channel's timeout, and the groups' own timeout is the same, so a
collective that a rank never issues fails on every rank with a ``TimeoutError`` naming it.

Every collective is **timed** (``take_timings``): from its issue to its completion, which a
callback on the group's future stamps on the group's worker thread, not when the training
thread gets round to looking. comm/link.py fits the network's latency and bandwidth to them.
"""

from __future__ import annotations

import collections
import datetime
import time
from dataclasses import dataclass

import torch

from .channel import Channel, collective_timeout_error

MAX_TIMINGS = 4096  # kept until taken; older ones are dropped (nobody measures the link)


@dataclass
class Timing:
    """One collective: issued as the ``seq``-th on lane ``lane``; ``kind`` "allreduce" (of
    ``nbytes``) or "allgather" (``nbytes`` from each rank); ``issued`` and ``done`` are
    ``time.perf_counter()`` stamps (``done`` None while in flight or when it failed)."""
    lane: str
    seq: int
    name: str
    kind: str
    nbytes: int
    issued: float
    done: float | None = None

    def _stamp(self, future) -> None:
        """The future's callback, on the group's worker thread when the collective completes:
        stamps the time unless it failed (the future is complete: ``wait`` returns at once)."""
        done = time.perf_counter()
        try:
            future.wait()
        except Exception:  # a failed collective is no timing; its waiter raises the error
            return
        self.done = done


def timeout_delta(seconds: float) -> datetime.timedelta:
    """A group's timeout: ``timedelta`` cannot hold math.inf ("wait forever"), a week stands in."""
    return datetime.timedelta(seconds=min(seconds, 7 * 24 * 3600.0))


class ProcessGroupChannel(Channel):
    """Collectives on ``group`` (a ``torch.distributed`` ProcessGroup), rank ``rank`` of
    ``size``; ``lanes``: name -> a group of the same ranks. ``timeout`` in seconds."""

    def __init__(self, group, rank: int, size: int, timeout: float, lanes: dict | None = None) -> None:
        self.rank, self.size, self.timeout = rank, size, timeout
        self._group = group
        self._delta = timeout_delta(timeout)
        self._issued = [0]  # collectives issued so far on every lane (tests count them per step)
        self._lane_name, self._seq = "main", [0]  # this lane's name, collectives issued on it
        self._timings: collections.deque[Timing] = collections.deque(maxlen=MAX_TIMINGS)  # every lane's
        self._lanes = {name: self._view(name, g) for name, g in (lanes or {}).items()}

    def _view(self, name: str, group) -> "ProcessGroupChannel":
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)  # the same ranks, timeout, counter and timings
        view._group, view._lanes, view._lane_name, view._seq = group, {}, name, [0]
        return view

    @property
    def issued(self) -> int:
        return self._issued[0]

    def lane(self, name: str) -> "ProcessGroupChannel":
        """The channel's lane ``name`` (see module doc)."""
        if name not in self._lanes:
            raise ValueError(f"{type(self).__name__} has no lane {name!r} (lanes: {', '.join(self._lanes) or 'none'})")
        return self._lanes[name]

    def allreduce_mean_async(self, tensors: list[torch.Tensor], name: str):
        """One collective for the whole list: the tensors are packed into one buffer."""
        flat = torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) != 1 else tensors[0].reshape(-1).clone()
        timing = self._timing(name, "allreduce", flat)
        try:
            work = self._group.allreduce([flat])
        except RuntimeError as exc:
            raise self._failure(name, exc) from exc
        self._time(work, timing)
        return ("allreduce", name, work, flat, [t.shape for t in tensors])

    def allgather_async(self, tensor: torch.Tensor, name: str):
        tensor = tensor.reshape(-1).contiguous()
        out = torch.empty(self.size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        timing = self._timing(name, "allgather", tensor)
        try:
            work = self._group.allgather([list(out.chunk(self.size))], [tensor])
        except RuntimeError as exc:
            raise self._failure(name, exc) from exc
        self._time(work, timing)
        return ("allgather", name, work, out, None)

    def _timing(self, name: str, kind: str, tensor: torch.Tensor) -> Timing:
        self._issued[0] += 1
        self._seq[0] += 1
        return Timing(self._lane_name, self._seq[0], name, kind, tensor.numel() * tensor.element_size(),
                      time.perf_counter())

    def _time(self, work, timing: Timing) -> None:
        self._timings.append(timing)
        try:
            work.get_future().then(timing._stamp)
        except (AttributeError, RuntimeError):  # a backend without futures: this one goes untimed
            pass

    @property
    def lane_names(self) -> list[str]:
        """Every lane's name, the main group ("main") first."""
        return ["main", *self._lanes]

    def timings(self) -> list[Timing]:
        """The timed collectives kept so far (every lane's; ``done`` None while in flight).
        A lane's ``seq`` numbers are the same on every rank: ranks pair collectives by them."""
        return list(self._timings)

    def forget_timings(self, through: dict[str, int]) -> None:
        """Drop each lane's timings up to and including seq ``through[lane]``."""
        kept = [t for t in self._timings if t.seq > through.get(t.lane, 0)]
        self._timings.clear()
        self._timings.extend(kept)

    def test(self, handle) -> bool:
        """Whether the collective has completed (never waits; a failed one counts as
        completed: ``wait`` raises its error)."""
        return handle[2].is_completed()

    def wait(self, handle):
        kind, name, work, out, shapes = handle
        try:
            work.wait(self._delta)
        except RuntimeError as exc:
            raise self._failure(name, exc) from exc
        if kind == "allgather":
            return out
        out.div_(self.size)
        if len(shapes) == 1:
            return [out.view(shapes[0])]
        return [part.view(shape) for part, shape in zip(out.split([s.numel() for s in shapes]), shapes)]

    def _failure(self, name: str, exc: RuntimeError) -> Exception:
        """A collective that timed out raises the channel's TimeoutError; any other failure a
        RuntimeError naming the collective (front ends may raise their own kind instead)."""
        text = str(exc)
        if "timed out" in text.lower() or "timeout" in text.lower():
            return collective_timeout_error(name, self.rank, self.size, self.timeout)
        return RuntimeError(f"AccordionCompressor: collective {name!r} failed on rank {self.rank} "
                            f"(world size {self.size}): {text}")

    def forget_handles(self) -> None:
        """The world was re-formed; these groups belong to the old one (nothing to forget)."""


def new_channel(ranks: list[int], timeout: float, backend: str,
                lanes: tuple[str, ...] = ()) -> ProcessGroupChannel | None:
    """A channel of ``ranks`` (global ranks, in the group's order) on new process groups: one
    for the data and one per lane, each carrying nothing else (so a framework's own
    collectives never pair with ours). ``new_group`` is collective: every rank of the job
    calls this, in the same order, and a rank outside ``ranks`` gets None."""
    import torch.distributed as dist

    delta = timeout_delta(timeout)
    data = dist.new_group(ranks, timeout=delta, backend=backend)
    made = {lane: dist.new_group(ranks, timeout=delta, backend=backend) for lane in lanes}
    me = dist.get_rank()
    if me not in ranks:
        return None
    return ProcessGroupChannel(data, ranks.index(me), len(ranks), timeout, lanes=made)
