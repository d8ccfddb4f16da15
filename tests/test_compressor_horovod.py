"""AccordionCompressor inside the stock hvd.DistributedOptimizer, in real horovodrun jobs."""

import pytest

from launch import run_worker

pytestmark = pytest.mark.horovod


@pytest.mark.parametrize("backend,np", [("gloo", 2), ("mpi", 2), ("gloo", 3), ("mpi", 3)])
@pytest.mark.parametrize("codec", ["powersgd", "topk"])
def test_trains_identically_on_every_rank(codec, backend, np):
    out = run_worker("compressor_check.py", codec, "30", np=np, backend=backend)
    assert out.count(": OK ") == np, out


def test_the_class_itself_as_compression():
    out = run_worker("compressor_check.py", "powersgd", "20", "class", np=2, backend="gloo")
    assert out.count("OK Quantize(bits=8, critical_bits=8, skip_energy=0.05)") == 2, out


@pytest.mark.parametrize("mode,codec", [("named", "powersgd"), ("groups", "topk"), ("named-groups", "powersgd")])
def test_names_from_named_parameters_and_horovods_grouped_path(mode, codec):
    """named_parameters= (no frame lookup: the worker makes it fail) and groups= (Horovod's
    grouped allreduce calls compress from a comprehension) train alike on every rank."""
    out = run_worker("compressor_check.py", codec, "20", mode, np=2, backend="gloo")
    assert out.count(": OK ") == 2, out
