"""Worker run by tests/test_control_plane.py under horovodrun: the control plane for real.

Checks, on every rank:
  - control_plane("auto") picks "mpi" under --mpi and "horovod" under --gloo; under --gloo,
    kind="mpi" starts MPI as a singleton, is refused with a ValueError, and Horovod still works;
  - the compressor's data plane (GlooChannel.control_plane) picks MPI under --mpi and its own
    Gloo group ("torch.distributed") under --gloo, and that group passes the checks below;
  - sum, max and min of rank-dependent vectors (order-sensitive float sums included) match the
    expected values, and every rank holds the same bits (a digest compared by a second reduction);
  - ranks issuing differently named collectives all raise (RuntimeError under MPI, the timeout
    under Horovod) instead of hanging or combining them; under MPI, a collective that no other
    rank joins times out on rank 0, and the job still exits cleanly.
Prints "rank R: mismatch: <ExceptionType>: <message>" and "rank R: OK (KIND, size N)".
Usage: control_plane_check.py BACKEND   (gloo or mpi; run with ACCORDION_COLLECTIVE_TIMEOUT=10)
"""

import gc
import hashlib
import logging
import math
import sys

import horovod.torch as hvd
import numpy as np
import torch

from accordion_hvd.comm import liveness
from accordion_hvd.comm.control import HorovodControlPlane, control_plane
from accordion_hvd.comm.gloo import GlooChannel
from worker_util import checker, say

backend = sys.argv[1]
hvd.init()
rank, size = hvd.rank(), hvd.size()
logging.basicConfig(level=logging.INFO, format=f"rank {rank} log: %(name)s: %(message)s")
check = checker(rank)

plane = control_plane()
say(f"rank {rank}: auto chose {plane.kind}")
check(plane.kind == {"mpi": "mpi", "gloo": "horovod"}[backend], f"auto chose {plane.kind} under --{backend}")
check((plane.rank, plane.size) == (rank, size), f"plane rank/size {plane.rank}/{plane.size}")

if backend == "gloo":
    try:  # starts MPI in this process (a singleton world of size 1) and must refuse it
        control_plane("mpi")
        check(False, "control_plane('mpi') accepted a singleton MPI world under --gloo")
    except ValueError as exc:
        check(f"MPI's world (size 1, rank 0) is not Horovod's (size {size}, rank {rank})" in str(exc), str(exc))
    from mpi4py import MPI
    check(MPI.Is_initialized() and MPI.COMM_WORLD.Get_size() == 1, "MPI is not a singleton")
    # Horovod (Gloo) still works with MPI initialised beside it.
    check(hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="after-mpi").item() == size, "Horovod broken")


def vector(r):
    """Rank r's values: integers (exact sums), floats spanning 16 decades (order-sensitive sums)."""
    rng = np.random.default_rng(1000 + r)
    floats = rng.standard_normal(300) * 10.0 ** rng.integers(-8, 9, 300)
    return np.concatenate([[r + 1, (r + 1) ** 2, -r, 1e16 if r == 0 else 1.0], floats])


def digest(array):
    """48 bits of the array's bytes: exact as a float64."""
    return float(int.from_bytes(hashlib.blake2b(array.tobytes(), digest_size=6).digest(), "little"))


def same_bits_everywhere(p, array, name):
    d = digest(array)
    return p.allreduce([d, -d], name, op="max").tolist() == [d, -d]  # max == min == mine


channel = GlooChannel()  # kept: its store and heartbeat live as long as the channel
dropped = GlooChannel()  # dropped: its heartbeat stops, and the kept channel's is the live one again
del dropped
gc.collect()
check(liveness._current is channel._heartbeat, "a dropped Gloo channel's heartbeat is still the live one")
channel_plane = channel.control_plane()
check(channel_plane.kind == {"mpi": "mpi", "gloo": "torch.distributed"}[backend],
      f"the Gloo channel's control plane is {channel_plane.kind} under --{backend}")
everyone = np.stack([vector(r) for r in range(size)])
planes = [plane] + ([HorovodControlPlane()] if plane.kind == "mpi" else [channel_plane])
for p in planes:
    mine = vector(rank)
    inputs = {"sum": mine, "max": torch.from_numpy(mine), "min": mine.tolist()}  # numpy, torch, list
    for op, values in inputs.items():
        got = p.allreduce(values, f"check.{op}", op=op)
        check(got.dtype == np.float64 and got.shape == mine.shape, f"{p.kind} {op}: {got.dtype} {got.shape}")
        check(np.array_equal(mine, vector(rank)), f"{p.kind} {op} changed its input")
        if op == "sum":
            ints = [sum(r + 1 for r in range(size)), sum((r + 1) ** 2 for r in range(size)), -sum(range(size))]
            check(got[:3].tolist() == ints, f"{p.kind} sum of integers: {got[:3]} != {ints}")
            bound = 4 * size * np.finfo(float).eps * np.abs(everyone).sum(0)
            exact = np.array([math.fsum(everyone[:, i]) for i in range(everyone.shape[1])])
            check(np.all(np.abs(got - exact) <= bound), f"{p.kind} sum off by {np.max(np.abs(got - exact) - bound)}")
        else:
            expected = everyone.max(0) if op == "max" else everyone.min(0)
            check(np.array_equal(got, expected), f"{p.kind} {op} differs from the exact {op}")
        check(same_bits_everywhere(p, got, f"digest.{op}"), f"{p.kind} {op}: ranks got different bits")
    say(f"rank {rank}: {p.kind} sum/max/min correct, same bits on all {size} ranks")

# The last rank issues a different collective: every rank must raise, none may hang.
name = "tick" if rank < size - 1 else "tock"
try:
    plane.allreduce([1.0, 2.0], name)
    check(False, f"{plane.kind}: a name mismatch went through")
except (RuntimeError, TimeoutError) as exc:
    say(f"rank {rank}: mismatch: {type(exc).__name__}: {exc}")
hvd.allreduce(torch.zeros(1), name="reported")  # every rank has printed before any exits
if plane.kind == "horovod":  # after a timeout the plane refuses to go on, at once
    try:
        plane.allreduce([1.0], "next")
        check(False, "the plane went on after a timeout")
    except RuntimeError as exc:
        check("timed out before" in str(exc), str(exc))
else:  # MPI detected the mismatch in a completed round: the plane is still in step
    check(plane.allreduce([1.0], "next").tolist() == [size], "MPI plane broken after a mismatch")
    # A collective no other rank joins: rank 0 times out (and exits cleanly with it pending).
    lonely = control_plane("mpi", timeout=2)
    if rank == 0:
        try:
            lonely.allreduce([1.0], "lonely")
            check(False, "a collective no other rank joined completed")
        except TimeoutError as exc:
            say(f"rank {rank}: lonely: {exc}")
    hvd.allreduce(torch.zeros(1), name="lonely-done")
say(f"rank {rank}: OK ({plane.kind}, size {size})")
