"""The control plane: reductions every rank sees bit for bit, never pairing different
collectives, never hanging. On the simulated world, the MPI name tags on their own, and for
real under horovodrun (MPI with 2 and 3 ranks, Gloo with 2)."""

import functools
import random
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from accordion_hvd.comm import SimulatedWorld
from accordion_hvd.comm.channel import TIMEOUT_ENV
from accordion_hvd.comm.control import (SimulatedControlPlane, _tag_bits, _tag_head, _tags, _tags_agree,
                                        control_plane)
from launch import run_worker


def on_every_rank(size, fn, timeout=10):
    """Run fn(plane) on every rank of a simulated world; each rank's result or exception."""
    def worker(rank, channel):
        try:
            return fn(SimulatedControlPlane(channel.world, rank))
        except Exception as exc:
            return exc
    return SimulatedWorld(size, timeout=timeout).run(worker)


def rank_values(rank):
    """Rank-dependent, with sums that depend on the order (magnitudes over 16 decades)."""
    gen = np.random.default_rng(rank)
    return gen.standard_normal(50) * 10.0 ** gen.integers(-8, 9, 50)


# --- the simulated plane -------------------------------------------------------------------
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_sum_max_min_are_exact_and_the_same_bits_on_every_rank(size):
    everyone = [rank_values(r) for r in range(size)]
    expected = {"sum": functools.reduce(np.add, everyone),  # in rank order
                "max": np.max(everyone, axis=0), "min": np.min(everyone, axis=0)}

    def fn(plane):
        mine = rank_values(plane.rank)
        # numpy, a float32 torch tensor that requires grad (as float64 exactly), a list
        out = {"sum": plane.allreduce(mine, "norms"),
               "max": plane.allreduce(torch.tensor(mine, requires_grad=True), "norms.max", op="max"),
               "min": plane.allreduce(mine.tolist(), "norms.min", op="min")}
        assert np.array_equal(mine, rank_values(plane.rank))  # inputs untouched
        return out

    results = on_every_rank(size, fn)
    for rank, out in enumerate(results):
        assert not isinstance(out, Exception), out
        for op, got in out.items():
            assert got.dtype == np.float64 and got.shape == (50,)
            assert got.tobytes() == expected[op].tobytes(), (rank, op)
    if size > 1:
        assert results[0]["sum"] is not results[1]["sum"]  # every rank owns its result


def test_integers_bools_and_empty_vectors_are_reduced_as_float64():
    out = on_every_rank(3, lambda p: (p.allreduce([p.rank, 1, True], "counts"),
                                      p.allreduce(torch.tensor([p.rank], dtype=torch.int64), "ints", op="max"),
                                      p.allreduce(np.zeros(0), "empty")))
    for counts, ints, empty in out:
        assert counts.tolist() == [3.0, 3.0, 3.0] and counts.dtype == np.float64
        assert ints.tolist() == [2.0] and empty.shape == (0,)


def test_different_names_raise_on_every_rank_naming_the_collectives():
    out = on_every_rank(3, lambda p: p.allreduce([1.0], "lr" if p.rank < 2 else "norms"))
    for exc in out:
        assert isinstance(exc, RuntimeError)
        assert str(exc) == ("ranks issued different collectives: rank 0 'control:lr', rank 1 'control:lr', "
                            "rank 2 'control:norms'")


def test_different_lengths_raise_on_every_rank():
    out = on_every_rank(2, lambda p: p.allreduce(np.ones(3 + p.rank), "norms"))
    for exc in out:
        assert isinstance(exc, RuntimeError)
        assert str(exc) == "control collective 'norms': the ranks passed different lengths [3, 4]"


def test_a_rank_that_never_joins_makes_the_others_time_out_and_stop():
    def fn(plane):
        if plane.rank == 1:
            return "skipped"
        start = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            plane.allreduce([1.0], "norms")
        assert time.monotonic() - start < 3
        with pytest.raises(RuntimeError, match="cannot run 'lr' on rank 0: collective 'norms' timed out before"):
            plane.allreduce([1.0], "lr")  # out of step for good: refused at once
        return str(info.value)
    out = on_every_rank(2, fn, timeout=0.5)
    assert out[1] == "skipped"
    assert out[0].startswith("AccordionCompressor: collective 'norms' did not complete within 0.5 s on rank 0 "
                             "(world size 2)."), out[0]


@pytest.mark.parametrize("values,op,name,error,message", [
    ([1.0], "mean", "lr", ValueError, "op must be 'sum', 'max' or 'min', got 'mean'"),
    ([1.0], "sum", "", ValueError, "name must be a non-empty str, got ''"),
    ([1.0], "sum", 7, ValueError, "name must be a non-empty str, got 7"),
    (np.ones((2, 2)), "sum", "lr", ValueError, "values must be 1-D, got shape (2, 2)"),
    (3.0, "sum", "lr", ValueError, "values must be 1-D, got shape ()"),
    ([[1.0], [1.0, 2.0]], "sum", "lr", ValueError, "values must be a 1-D sequence of real numbers"),
    (["1.0"], "sum", "lr", TypeError, "values must be real numbers, got dtype <U3"),
    ([None], "sum", "lr", TypeError, "values must be real numbers, got dtype object"),
    (np.ones(2, complex), "sum", "lr", TypeError, "values must be real numbers, got dtype complex128"),
    (torch.ones(2, dtype=torch.complex64), "sum", "lr", TypeError,
     "values must be real numbers, got a torch.complex64"),
])
def test_bad_arguments_are_named_before_any_communication(values, op, name, error, message):
    # A world of 2 in which rank 1 never calls: any communication would time out instead.
    plane = SimulatedControlPlane(SimulatedWorld(2, timeout=5), 0)
    start = time.monotonic()
    with pytest.raises(error, match=re.escape(message)):
        plane.allreduce(values, name, op=op)
    assert time.monotonic() - start < 1


def test_control_plane_rejects_unknown_kinds_and_needs_horovod_initialised():
    with pytest.raises(ValueError, match="kind must be 'auto', 'mpi' or 'horovod', got 'simulated'"):
        control_plane("simulated")
    hvd = pytest.importorskip("horovod.torch")
    if hvd.is_initialized():
        pytest.skip("Horovod was initialised in this process by another test")
    with pytest.raises(ValueError, match=r"call hvd.init\(\) first"):
        control_plane()


def test_auto_never_starts_mpi_when_horovod_runs_without_it():
    # In a fresh process: whether MPI starts shows in sys.modules (mpi4py.MPI initialises it).
    code = ("import sys, types; from accordion_hvd.comm.control import _why_not_mpi; "
            "print(_why_not_mpi(types.SimpleNamespace(mpi_enabled=lambda: False), start_mpi=False)); "
            "print('mpi4py.MPI' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["Horovod runs without MPI (a horovodrun --gloo launch), so MPI's world would be "
                                "each process alone", "False"]


def test_importing_the_package_does_not_start_mpi():
    code = "import sys, accordion_hvd, accordion_hvd.comm.control; print('mpi4py.MPI' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# --- MPI's name tags, without MPI: simulate the reduction in any order -------------------
def reduce_heads(heads, op, order):
    """What MPI computes from every rank's head, adding float64 numbers in the given order."""
    heads = np.array(heads)[order]
    if op != "sum":
        return (heads.max(0) if op == "max" else heads.min(0)).tolist()
    return functools.reduce(np.add, heads).tolist()


@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 1023])
def test_tags_agree_exactly_when_every_rank_issued_the_same_collective(size, op):
    rng = random.Random(size)
    order = rng.sample(range(size), size)
    same = [_tag_head(_tags("norms", 10, size), op)] * size
    assert _tags_agree(reduce_heads(same, op, order), op, size)
    if size == 1:
        return
    for other in [_tags("lr", 10, size), _tags("norms", 11, size)]:  # another name, another length
        heads = list(same)
        heads[rng.randrange(size)] = _tag_head(other, op)
        assert not _tags_agree(reduce_heads(heads, op, order), op, size)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 1000, 2 ** 13 - 1, 2 ** 13, 2 ** 20])
def test_tag_sums_stay_exact_at_the_largest_tags(size):
    bits = _tag_bits(size)
    biggest = 2 ** bits - 1
    assert size * biggest ** 2 < 2 ** 53  # every partial float64 sum of h*h is an exact integer
    assert bits >= 16  # two tags: two different collectives pass with odds 2**-32 at worst
    assert all(0 <= t <= biggest for n in range(200) for t in _tags(f"layer{n}", n, size))
    # Every rank with the largest tag, summed one rank at a time in float64: still agree...
    s1 = s2 = 0.0
    for h in [biggest] * min(size, 5000):
        s1, s2 = s1 + h, s2 + float(h * h)
    s1, s2 = s1 + float((size - min(size, 5000)) * biggest), s2 + float((size - min(size, 5000)) * biggest ** 2)
    assert _tags_agree([s1, s2, s1, s2], "sum", size)
    # ...and one rank at biggest - 1 is still seen.
    if size > 1:
        assert not _tags_agree([s1 - 1, s2 - 2 * biggest + 1, s1, s2], "sum", size)


def test_tags_catch_ranks_whose_plain_sums_agree():
    # Tags h-1, h+1, h, h sum to 4h like four h's: the squares tell them apart.
    h = 1000
    heads = [_tag_head([t, h], "sum") for t in (h - 1, h + 1, h, h)]
    assert sum(hd[0] for hd in heads) == 4 * h
    assert not _tags_agree(reduce_heads(heads, "sum", [0, 1, 2, 3]), "sum", 4)


# --- under horovodrun -----------------------------------------------------------------------
def lines_by_rank(out):
    """{rank: [message, ...]} from the "rank R: ..." lines (launcher tags removed)."""
    plain = re.sub(r"\[[\d,]+\]<std(?:out|err)>:", "", out)
    found = {}
    for m in re.finditer(r"^rank (\d+)(?::| log:) (.*)$", plain, re.M):
        found.setdefault(int(m.group(1)), []).append(m.group(2))
    return found


@pytest.mark.horovod
@pytest.mark.parametrize("backend,np_", [("mpi", 2), ("mpi", 3), ("gloo", 2)])
def test_control_plane_under_horovodrun(backend, np_):
    start = time.monotonic()
    out = run_worker("control_plane_check.py", backend, np=np_, backend=backend, timeout=120,
                     env={TIMEOUT_ENV: "10"})
    kind = {"mpi": "mpi", "gloo": "horovod"}[backend]
    lines = lines_by_rank(out)
    assert sorted(lines) == list(range(np_)), out
    for rank, said in lines.items():
        assert f"auto chose {kind}" in said, out
        assert f"{kind} sum/max/min correct, same bits on all {np_} ranks" in said, out
        assert f"OK ({kind}, size {np_})" in said, out
        if backend == "mpi":
            assert f"horovod sum/max/min correct, same bits on all {np_} ranks" in said, out  # explicit kind
            assert ("accordion_hvd.control: accordion_hvd control plane: MPI (mpi4py), whose world is "
                    f"Horovod's (size {np_})") in said, out
        else:
            assert ("accordion_hvd.control: accordion_hvd control plane: Horovod's collectives, because Horovod runs "
                    "without MPI (a horovodrun --gloo launch), so MPI's world would be each process alone") in said, out
            # the compressor's own Gloo group, which its data plane offers in place of Horovod's collectives
            assert f"torch.distributed sum/max/min correct, same bits on all {np_} ranks" in said, out
        name = "tick" if rank < np_ - 1 else "tock"
        mismatch = [s for s in said if s.startswith("mismatch: ")]
        assert len(mismatch) == 1, out
        if backend == "mpi":  # seen in the round itself, at once
            assert mismatch[0] == (f"mismatch: RuntimeError: control collective {name!r} on rank {rank}: the ranks "
                                   f"issued different control collectives (names or lengths) in the same round; "
                                   f"every rank must issue the same ones in the same order"), out
            lonely = [s for s in said if s.startswith("lonely: ")]  # rank 0 alone, timing out
            assert len(lonely) == (rank == 0), out
            assert all(s.startswith("lonely: AccordionCompressor: collective 'lonely' did not complete within "
                                    f"2 s on rank 0 (world size {np_}).") for s in lonely), out
        else:  # Horovod pairs by name: each rank waits for its own, then times out
            assert mismatch[0].startswith(f"mismatch: CollectiveTimeout: AccordionCompressor: collective "
                                          f"'acc.ctl.{name}' did not complete within 10 s on rank {rank}"), out
    assert time.monotonic() - start < 60
