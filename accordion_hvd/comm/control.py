"""The control plane: small float64 reductions whose result every rank sees bit for bit.

The regime controller reduces a few numbers per detection point (per-layer gradient norms,
the learning rate, counters) and every rank applies the same deterministic rule to the
result, so all ranks switch levels in the same step. So the reductions must give every rank
the same bits, never combine two different collectives, and never hang (every wait polls
with a deadline, $ACCORDION_COLLECTIVE_TIMEOUT). Four implementations of one protocol:
``MPIControlPlane`` (mpi4py, apart from Horovod's traffic), ``HorovodControlPlane`` (for
``horovodrun --gloo``, where every process sees an MPI world of size 1, and a controller
trusting MPI would let the ranks diverge silently), ``ProcessGroupControlPlane`` (a
``torch.distributed`` Gloo group: the DDP front end, and the compressor's own Gloo data
plane under ``--gloo``) and ``SimulatedControlPlane`` (unit tests). ``control_plane()`` picks
MPI where MPI's world is Horovod's, else the caller's ``fallback``, else Horovod.

Why a fallback before Horovod's collectives: each of them waits for Horovod's background
cycle and its negotiation (horovod/patches.py), several times longer than MPI's or a Gloo
group's allreduce of a few floats. A window's end issues up to five of them (the norms; the
network-aware policy's ready times, link and level errors), and a per-step policy one every
step: through Horovod that was a visible share of a step (measured: docs/design.md,
"Measured reasons"). The compressor's Gloo data plane has a group for them (comm/gloo.py).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Callable, Protocol

import numpy as np
import torch

from .channel import collective_timeout, wait_for
from .process_group import timeout_delta

log = logging.getLogger("accordion_hvd.control")
_OPS = ("sum", "max", "min")
_ABANDONED: list = []  # MPI requests of timed-out collectives: freeing an active one is erroneous
_announced = False  # control_plane("auto") logs its choice once per process


class ControlPlane(Protocol):
    kind: str  # "mpi", "horovod" or "simulated"
    rank: int
    size: int
    timeout: float  # seconds a collective may take before it raises TimeoutError

    def allreduce(self, values, name: str, op: str = "sum") -> np.ndarray:
        """Reduce the 1-D vector ``values`` (numpy, torch or a list of real numbers) over all
        ranks with ``op`` ("sum", "max" or "min"): a new float64 array, the same bits on every
        rank. Every rank must issue the same collectives (name and length) in the same order."""


def _as_float64(values) -> np.ndarray:
    """A private float64 copy of ``values``: simulated ranks read each other's after the
    exchange, when the caller may already be changing its own array."""
    if isinstance(values, torch.Tensor):
        if values.is_complex():
            raise TypeError(f"values must be real numbers, got a {values.dtype} tensor")
        values = values.detach().to("cpu", torch.float64).numpy()
    try:
        array = np.asarray(values)
    except ValueError as exc:  # a ragged list
        raise ValueError(f"values must be a 1-D sequence of real numbers ({exc})") from None
    if array.dtype.kind not in "biuf":
        raise TypeError(f"values must be real numbers, got dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"values must be 1-D, got shape {tuple(array.shape)}")
    return array.astype(np.float64, copy=True)


class _Plane:
    """What all planes share: argument checks, and no use after a timeout (a collective is then
    pending on some ranks only, so the ranks are out of step for good)."""
    _stuck: str | None = None

    def allreduce(self, values, name: str, op: str = "sum") -> np.ndarray:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        if op not in _OPS:
            raise ValueError(f"op must be 'sum', 'max' or 'min', got {op!r}")
        values = _as_float64(values)
        if self._stuck is not None:
            raise RuntimeError(f"control plane: cannot run {name!r} on rank {self.rank}: collective "
                               f"{self._stuck!r} timed out before and the ranks are out of step")
        try:
            return self._allreduce(values, name, op)
        except TimeoutError:
            self._stuck = name
            raise


# --- MPI: collectives pair by order, so each carries a tag of its name, reduced with it ----
def _tag_bits(size: int) -> int:
    """The most bits b with size * (2**b)**2 <= 2**53: float64 sums of h and h*h over the
    ranks are then sums of integers below 2**53, exact in any order."""
    return (53 - size.bit_length()) // 2


def _tags(name: str, count: int, size: int) -> list[int]:
    """Two integers below 2**_tag_bits(size) from the collective's name and length."""
    digest = int.from_bytes(hashlib.blake2b(f"{name}\0{count}".encode(), digest_size=8).digest(), "little")
    mask = (1 << _tag_bits(size)) - 1
    return [digest & mask, (digest >> 32) & mask]


def _tag_head(tags: list[int], op: str) -> list[float]:
    """What a rank reduces ahead of its values: (h, h*h) per tag for sum, (h, -h) for max/min."""
    return [float(x) for h in tags for x in ((h, h * h) if op == "sum" else (h, -h))]


def _tags_agree(head, op: str, size: int) -> bool:
    """Had every rank the same tags? Sum: S1 = sum(h), S2 = sum(h*h) satisfy S1**2 <= size*S2
    (Cauchy-Schwarz) with equality iff all h are equal; compared in Python ints, exactly.
    Max: max(h) == -max(-h) == min(h). Min: min(h) == -min(-h) == max(h)."""
    pairs = [(int(head[i]), int(head[i + 1])) for i in range(0, len(head), 2)]
    return all(a * a == size * b if op == "sum" else a == -b for a, b in pairs)


class MPIControlPlane(_Plane):
    """mpi4py on a private duplicate of COMM_WORLD, non-blocking (Idup, Iallreduce) and polled
    with a deadline: a rank that never joins makes the others raise, not hang.

    MPI pairs collectives by their order, not by name, so every reduction carries tags of its
    name and length (``_tags_agree``): ranks that issued different collectives all raise
    instead of combining them. Open MPI's non-blocking allreduce (libnbc) reduces each element
    once and sends it to all ranks, so they get the same bits (tests/workers checks it)."""
    kind = "mpi"

    def __init__(self, timeout: float | None = None) -> None:
        from mpi4py import MPI  # initialises MPI unless Horovod did (never at package import)

        self._MPI = MPI
        self.timeout = collective_timeout(timeout)
        self.rank, self.size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
        self._comm, request = MPI.COMM_WORLD.Idup()  # Dup is a collective too: no blocking
        self._wait(request, "acc.ctl.dup")

    def _wait(self, request, name: str) -> None:
        def done() -> bool:
            if self._MPI.Is_finalized():  # Horovod finalises MPI when it shuts down
                raise RuntimeError(f"control collective {name!r}: MPI was finalized while rank {self.rank} "
                                   f"waited (Horovod shut down: did another rank fail?)")
            try:
                return request.Test()
            except self._MPI.Exception as exc:  # e.g. a truncation: ranks passed different lengths
                raise RuntimeError(f"control collective {name!r} failed on rank {self.rank}: "
                                   f"{exc.Get_error_string()}") from None
        try:
            wait_for(done, name, self.rank, self.size, self.timeout)
        except TimeoutError:
            _ABANDONED.append(request)
            raise

    def _allreduce(self, values: np.ndarray, name: str, op: str) -> np.ndarray:
        head = _tag_head(_tags(name, len(values), self.size), op)
        send = np.concatenate([head, values])  # tags first: they line up even if lengths differ
        recv = np.empty_like(send)
        self._wait(self._comm.Iallreduce(send, recv, op=self._ops[op]), name)
        if not _tags_agree(recv[:len(head)], op, self.size):
            raise RuntimeError(f"control collective {name!r} on rank {self.rank}: the ranks issued different "
                               f"control collectives (names or lengths) in the same round; every rank must "
                               f"issue the same ones in the same order")
        return recv[len(head):]


class HorovodControlPlane(_Plane):
    """Horovod's allreduce of a CPU float64 tensor, named "acc.ctl.NAME". Horovod pairs
    collectives by name: ranks that issued different ones each wait for their own and time out,
    and Horovod itself rejects different lengths."""
    kind = "horovod"

    def __init__(self, timeout: float | None = None) -> None:
        import horovod.torch as hvd

        self._hvd = hvd
        self.timeout = collective_timeout(timeout)
        self.rank, self.size = hvd.rank(), hvd.size()
        self._ops = {"sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min}

    def _allreduce(self, values: np.ndarray, name: str, op: str) -> np.ndarray:
        name = f"acc.ctl.{name}"
        handle = self._hvd.allreduce_async(torch.from_numpy(values), name=name, op=self._ops[op])
        wait_for(lambda: self._hvd.poll(handle), name, self.rank, self.size, self.timeout)
        return self._hvd.synchronize(handle).numpy()


class ProcessGroupControlPlane(_Plane):
    """An allreduce of a CPU float64 tensor on a ``torch.distributed`` Gloo group (the DDP
    front end's control plane, accordion_hvd/ddp.py). Gloo pairs collectives by order, so
    every reduction carries tags of its name and length, as on MPI; its ring allreduce reduces
    each element on one rank and passes the result on, so every rank gets the same bits."""
    kind = "torch.distributed"

    def __init__(self, group, rank: int, size: int, timeout: float | None = None, *,
                 failure: Callable[[str, RuntimeError], Exception] | None = None) -> None:
        """``failure(name, error)``: the exception to raise for a collective that failed (the
        Horovod data plane's: Horovod's error kind, so that Elastic recovers); default a
        RuntimeError naming the collective."""
        import torch.distributed as dist

        self._group, self.rank, self.size = group, rank, size
        self._failure = failure
        self.timeout = collective_timeout(timeout)
        self._ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        self._options = dist.AllreduceOptions

    def _allreduce(self, values: np.ndarray, name: str, op: str) -> np.ndarray:
        head = _tag_head(_tags(name, len(values), self.size), op)
        buffer = torch.from_numpy(np.concatenate([head, values]))
        options = self._options()
        options.reduceOp = self._ops[op]
        try:
            work = self._group.allreduce([buffer], options)
            wait_for(work.is_completed, name, self.rank, self.size, self.timeout)
            work.wait()
        except RuntimeError as exc:
            if self._failure is not None:
                raise self._failure(name, exc) from None
            raise RuntimeError(f"control collective {name!r} failed on rank {self.rank}: {exc}") from None
        result = buffer.numpy()
        if not _tags_agree(result[:len(head)], op, self.size):
            raise RuntimeError(f"control collective {name!r} on rank {self.rank}: the ranks issued different "
                               f"control collectives (names or lengths) in the same round; every rank must "
                               f"issue the same ones in the same order")
        return result[len(head):].copy()


class SimulatedControlPlane(_Plane):
    """Rank ``rank`` of a ``SimulatedWorld`` (use one per rank thread). Reduces in rank order,
    the same computation on every rank, so the results are bit-identical like the real ones."""
    kind = "simulated"

    def __init__(self, world, rank: int) -> None:
        self._world, self.rank, self.size = world, rank, world.size

    @property
    def timeout(self) -> float:
        return self._world.timeout

    def _allreduce(self, values: np.ndarray, name: str, op: str) -> np.ndarray:
        everyone = self._world.exchange(self.rank, "control", name, values)
        if len({len(v) for v in everyone}) > 1:
            raise RuntimeError(f"control collective {name!r}: the ranks passed different lengths "
                               f"{[len(v) for v in everyone]}")
        return {"sum": np.add, "max": np.maximum, "min": np.minimum}[op].reduce(np.stack(everyone))


def _why_not_mpi(hvd, start_mpi: bool) -> str | None:
    """None if mpi4py's COMM_WORLD is Horovod's world on this rank, else why not."""
    if not start_mpi and not hvd.mpi_enabled():
        # horovodrun --gloo: MPI would start as a singleton, each process alone; don't start it.
        return "Horovod runs without MPI (a horovodrun --gloo launch), so MPI's world would be each process alone"
    try:
        from mpi4py import MPI
    except ImportError as exc:
        return f"mpi4py cannot be imported ({exc})"
    size, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    if (size, rank) != (hvd.size(), hvd.rank()):
        hint = ", as under horovodrun --gloo, where every process sees an MPI world of size 1" if size == 1 else ""
        return f"MPI's world (size {size}, rank {rank}) is not Horovod's (size {hvd.size()}, rank {hvd.rank()}){hint}"
    return None


def control_plane(kind: str = "auto", *, timeout: float | None = None,
                  fallback: Callable[[], ControlPlane] | None = None) -> ControlPlane:
    """The control plane of this Horovod job; call it on every rank, after ``hvd.init()``.

    kind: "auto" (MPI where MPI's world is Horovod's, as under ``horovodrun --mpi``; otherwise,
    e.g. under ``--gloo``, ``fallback()`` if given, else Horovod's collectives), "mpi"
    (ValueError if MPI's world is not Horovod's) or "horovod". For tests, build
    ``SimulatedControlPlane(world, rank)`` directly.
    timeout: seconds per collective; default $ACCORDION_COLLECTIVE_TIMEOUT, else 300.
    fallback: builds a plane over Horovod's ranks without MPI (the compressor's Gloo group:
    comm/gloo.py), called on every rank alike; faster than Horovod's collectives (module doc).
    """
    global _announced
    if kind not in ("auto", "mpi", "horovod"):
        raise ValueError(f"kind must be 'auto', 'mpi' or 'horovod', got {kind!r} "
                         f"(a simulated plane is built as SimulatedControlPlane(world, rank))")
    import horovod.torch as hvd

    if not hvd.is_initialized():
        raise ValueError("control_plane() must agree with Horovod's ranks: call hvd.init() first")
    if kind == "horovod":
        return HorovodControlPlane(timeout)
    why_not = _why_not_mpi(hvd, start_mpi=(kind == "mpi"))
    if kind == "mpi":
        if why_not:
            raise ValueError(f"control_plane('mpi'): {why_not}; use kind='auto' or 'horovod'")
        return MPIControlPlane(timeout)
    # Every rank must pick the same plane: agree over Horovod, in one tiny collective.
    horovod = HorovodControlPlane(timeout)
    use_mpi = horovod.allreduce([why_not is None], "choose", op="min")[0] == 1
    if not use_mpi and why_not is None:
        why_not = "MPI's world is not Horovod's on another rank"
    if use_mpi:
        chosen, what = MPIControlPlane(timeout), f"MPI (mpi4py), whose world is Horovod's (size {hvd.size()})"
    elif fallback is not None:
        chosen = fallback()
        what = f"a Gloo group of Horovod's ranks ({chosen.kind}), because {why_not}"
    else:
        chosen, what = horovod, f"Horovod's collectives, because {why_not}"
    if not _announced:
        _announced = True
        log.info("accordion_hvd control plane: %s", what)
    return chosen


def new_control_plane(ranks: list[int], timeout: float) -> ProcessGroupControlPlane:
    """The control plane of ``ranks`` (every rank of the job calls it, in the same order as
    its other ``new_group`` calls, and must be one of ``ranks``): a new Gloo group, since
    control values are host arrays whatever backend carries the data."""
    import torch.distributed as dist

    group = dist.new_group(ranks, timeout=timeout_delta(timeout), backend="gloo")
    return ProcessGroupControlPlane(group, ranks.index(dist.get_rank()), len(ranks), timeout)
