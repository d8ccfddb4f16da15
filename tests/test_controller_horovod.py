"""The regime controller under real horovodrun: its decisions go over MPI when MPI's world
is Horovod's (--mpi), over its own Gloo group under --gloo (where every process sees
an MPI world of size 1), and ranks with very different local norms switch levels together."""

import pytest

from launch import run_worker

pytestmark = pytest.mark.horovod


@pytest.mark.parametrize("backend,np,plane", [("mpi", 2, "mpi"), ("mpi", 3, "mpi"), ("gloo", 2, "torch.distributed")])
def test_all_ranks_switch_together_over_the_right_control_plane(backend, np, plane):
    out = run_worker("controller_check.py", "24", np=np, backend=backend)
    assert out.count(f": OK control plane {plane}, windows 8, levels seen ['critical', 'dense', 'normal']") == np, out
