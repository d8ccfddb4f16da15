"""Horovod's contracts that a compressor could break silently, in real horovodrun jobs:
``op=`` honoured or refused by name (tests/workers/horovod_op_check.py)."""

import pytest

from launch import WORKERS, horovodrun, run_worker, run_worker_in_turn

pytestmark = pytest.mark.horovod

CODECS = ("powersgd", "topk")
# The checks of one world run in one launch, one after another (tests/workers/in_turn.py):
# one start-up per world instead of one per check. The refusals come last in their job.
SUMS = tuple((codec, "sum") for codec in CODECS)
REFUSALS = (("powersgd", "refuse-adasum"), ("powersgd", "refuse-min"), ("topk", "two-optimizers"))
CHECKS = (("topk", "broadcast-state"),)
JOBS = {("gloo", 2): SUMS + tuple((codec, mode) for mode in ("predivide", "passes", "sparse") for codec in CODECS)
        + CHECKS + REFUSALS, ("mpi", 2): SUMS + REFUSALS, ("gloo", 3): SUMS, ("mpi", 3): SUMS}


def _in_turn(codec, mode, backend="gloo", np=2) -> str:
    return run_worker_in_turn("horovod_op_check.py", (codec, mode), JOBS[backend, np], np=np, backend=backend)


@pytest.mark.parametrize("backend,np", [("gloo", 2), ("mpi", 2), ("gloo", 3), ("mpi", 3)])
@pytest.mark.parametrize("codec", CODECS)
def test_op_sum_gives_size_times_the_average_on_every_layer(codec, backend, np):
    out = _in_turn(codec, "sum", backend, np)
    assert out.count(f": OK sum {codec}:") == np, out


@pytest.mark.parametrize("codec", CODECS)
def test_gradient_predivide_factor_still_averages(codec):
    out = _in_turn(codec, "predivide")
    assert out.count(f": OK predivide {codec}:") == 2, out


@pytest.mark.parametrize("codec", CODECS)
def test_backward_passes_per_step_compresses_the_accumulated_gradient(codec):
    out = _in_turn(codec, "passes")
    assert out.count(f": OK passes {codec}:") == 2, out


@pytest.mark.parametrize("codec", CODECS)
def test_a_sparse_gradient_is_left_to_horovod(codec):
    out = _in_turn(codec, "sparse")
    assert out.count(f": OK sparse {codec}\n") == 2, out


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
@pytest.mark.parametrize("mode,named", [("refuse-adasum", "op=hvd.Adasum"), ("refuse-min", "op=hvd.Min")])
def test_an_op_the_codecs_cannot_honour_is_refused_on_every_rank(mode, named, backend):
    out = _in_turn("powersgd", mode, backend)
    assert out.count(f"OK refused: ValueError: AccordionCompressor cannot honour {named}") == 2, out


def test_a_process_set_smaller_than_the_world_is_refused_on_every_rank():
    out = run_worker("horovod_op_check.py", "topk", "process-set", np=3, backend="gloo")
    assert out.count("OK refused: ValueError: AccordionCompressor cannot honour process_set=") == 3, out


def test_horovods_broadcast_optimizer_state_still_knows_its_optimizer_with_this_package_imported():
    """Found by Horovod's own test suite (make peer-tests): test_broadcast_state hung."""
    out = _in_turn("topk", "broadcast-state")
    assert out.count(": OK broadcast-state") == 2, out


def test_one_compressor_for_two_optimizers_is_refused_on_every_rank():
    out = _in_turn("topk", "two-optimizers")
    assert out.count("OK refused: ValueError: AccordionCompressor: this compressor is already bound to another "
                     "hvd.DistributedOptimizer") == 2, out


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
@pytest.mark.parametrize("codec", ["powersgd", "topk"])
def test_a_rank_0_checkpoint_loaded_everywhere_is_refused_and_a_gathered_one_works(codec, backend, tmp_path):
    out = run_worker("checkpoint_owner_check.py", codec, str(tmp_path), np=3, backend=backend)
    assert out.count(f": OK checkpoint owner {codec}") == 3, out


@pytest.mark.parametrize("short,expected", [
    (1, "Diagnosis: rank 1 ("),  # a rank that exited left its exit record
    (0, "Diagnosis: unreachable from rank 1: rank 0 ("),  # rank 0 took the store with it
])
def test_a_rank_that_ran_fewer_steps_is_named_as_exited_not_as_frozen(short, expected):
    result = horovodrun([str(WORKERS / "uneven_steps_check.py"), str(short)], np=2, backend="gloo",
                        env={"ACCORDION_COLLECTIVE_TIMEOUT": "60"})
    out = result.stdout
    assert f"rank {short}: finished 3 steps" in out, out
    failed = [line for line in out.splitlines() if "FAILED AS EXPECTED" in line]
    assert len(failed) == 1 and expected in failed[0] and "has exited" in failed[0], out
    assert "frozen" not in failed[0] and "link is down" not in failed[0], failed[0]
    if short == 1:
        assert "after 3 optimizer steps, while rank 0 waits in its step 4" in failed[0], failed[0]
