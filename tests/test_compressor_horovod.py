"""AccordionCompressor inside the stock hvd.DistributedOptimizer, in real horovodrun jobs."""

import pytest

from launch import run_worker_in_turn

pytestmark = pytest.mark.horovod

CODECS = ("powersgd", "topk")
# The runs of one world in one launch, one after another (tests/workers/in_turn.py); the
# "named" modes last: they disable the frame lookup for the rest of the process.
FRAMES = tuple((codec, "30") for codec in CODECS)
JOBS = {("gloo", 2): FRAMES + (("powersgd", "20", "class"), ("topk", "20", "groups"), ("powersgd", "20", "named"),
                               ("powersgd", "20", "named-groups")),
        ("mpi", 2): FRAMES, ("gloo", 3): FRAMES, ("mpi", 3): FRAMES}


def _in_turn(args, backend="gloo", np=2) -> str:
    return run_worker_in_turn("compressor_check.py", args, JOBS[backend, np], np=np, backend=backend)


@pytest.mark.parametrize("backend,np", [("gloo", 2), ("mpi", 2), ("gloo", 3), ("mpi", 3)])
@pytest.mark.parametrize("codec", CODECS)
def test_trains_identically_on_every_rank(codec, backend, np):
    out = _in_turn((codec, "30"), backend, np)
    assert out.count(f" (frame {codec})") == np, out


def test_the_class_itself_as_compression():
    out = _in_turn(("powersgd", "20", "class"))
    assert out.count("OK Quantize(bits=8, critical_bits=8, skip_energy=0.05)") == 2, out


@pytest.mark.parametrize("mode,codec", [("named", "powersgd"), ("groups", "topk"), ("named-groups", "powersgd")])
def test_names_from_named_parameters_and_horovods_grouped_path(mode, codec):
    """named_parameters= (no frame lookup: the worker makes it fail) and groups= (Horovod's
    grouped allreduce calls compress from a comprehension) train alike on every rank."""
    out = _in_turn((codec, "20", mode))
    assert out.count(f" ({mode} {codec})") == 2, out
