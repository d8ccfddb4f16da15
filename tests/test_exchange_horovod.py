"""The exchange engine under horovodrun: how many collectives a step issues."""

import pytest

from launch import run_worker

pytestmark = pytest.mark.horovod


@pytest.mark.parametrize("backend,np", [("gloo", 2), ("mpi", 3)])
@pytest.mark.parametrize("codec,policy", [("powersgd", "static"), ("powersgd", "accordion"), ("topk", "static")])
def test_collectives_per_step(codec, policy, backend, np):
    out = run_worker("collectives_check.py", codec, policy, np=np, backend=backend)
    assert out.count(": OK ") == np, out


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_gloo_channel_averages_gathers_and_times_out(backend):
    out = run_worker("gloo_channel_check.py", np=2, backend=backend)
    assert out.count(": OK gloo channel") == 2, out
