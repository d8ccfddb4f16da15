"""AccordionCompressor in the stock hvd.DistributedOptimizer against an independent NumPy
reference, under real horovodrun (Gloo and MPI, 2 and 3 ranks).

The worker (tests/workers/numpy_reference_check.py) trains parameters W with loss
sum(W * G[r, t]) and SGD lr=1.0, so every step's applied update is the decompressed
gradient, and checks it after every step against PowerSGD / TopK recomputed in float64
NumPy for all ranks (error feedback, warm-started Q, Gram-Schmidt, ties to the lower
index, averaging): see the worker's docstring for the exact algorithm and tolerances.
These tests fail on wrong averaging (sum instead of mean), missing error feedback, a Q
that is not carried over between steps, wrong tie-breaking or a wrong k, and on any
parameter difference between ranks.
"""

import pytest

from launch import run_worker, run_worker_in_turn

pytestmark = pytest.mark.horovod

WORLDS = [("gloo", 2), ("mpi", 2), ("gloo", 3), ("mpi", 3)]
STEPS = "6"
MODES = ("powersgd", "topk", "quantize", "quantize-sparse")
SWITCH_MODES = ("powersgd-switch", "topk-switch", "quantize-switch")
# Every mode of the two tests below runs in one launch per world, one after another
# (tests/workers/in_turn.py): one start-up instead of seven.
IN_TURN = tuple((mode, STEPS) for mode in MODES) + tuple((mode, "8") for mode in SWITCH_MODES)


def _run(mode, backend, np, env=None, steps=STEPS):
    out = run_worker("numpy_reference_check.py", mode, steps, np=np, backend=backend, env=env)
    assert out.count(f": OK {mode} ") == np, out
    return out


def _run_in_turn(mode, backend, np, steps):
    out = run_worker_in_turn("numpy_reference_check.py", (mode, steps), IN_TURN, np=np, backend=backend)
    assert out.count(f": OK {mode} ") == np, out


@pytest.mark.parametrize("backend,np", WORLDS)
@pytest.mark.parametrize("mode", MODES)
def test_matches_numpy_reference(mode, backend, np):
    _run_in_turn(mode, backend, np, STEPS)


# Levels switched by the policy mid-run (PowerSGD rank 1 -> 4 -> 1 -> 4, TopK 10% -> 20% -> ...),
# every step against the reference following the same schedule.
@pytest.mark.parametrize("backend,np", WORLDS)
@pytest.mark.parametrize("mode", SWITCH_MODES)
def test_level_switches_match_numpy_reference(mode, backend, np):
    _run_in_turn(mode, backend, np, "8")


# TopK at ratio 1.0: a level that keeps half the entries or more goes through Horovod's own
# dense allreduce (values plus indices would cost more), with the error feedback folded in;
# the result must be Horovod's dense average, bit for bit, on any number of ranks. Tensor
# fusion is turned off so that the optimizer's allreduce and the worker's own check
# allreduce sum in the same order (Gloo's ring cuts a fused buffer differently from a lone
# tensor, which changes the rounding on 3 ranks even for uncompressed training).
@pytest.mark.parametrize("backend,np", [("gloo", 2), ("mpi", 2), ("gloo", 3), ("mpi", 3)])
def test_topk_full_ratio_is_horovods_dense_average_bit_for_bit(backend, np):
    _run("topk-full", backend, np, env={"HOROVOD_FUSION_THRESHOLD": "0"})


# The same checks with parameters and gradients on the GPU: the CUDA kernels inside the real
# Horovod data path (2 ranks sharing one GPU; Horovod stages CUDA tensors through the host
# when it has no GPU operations of its own). On a GPU machine with Horovod built.
@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["powersgd", "topk", "topk-full"])
def test_matches_numpy_reference_on_the_gpu(mode):
    import torch

    import accordion_hvd

    if not (torch.cuda.is_available() and accordion_hvd.with_cuda):
        pytest.skip("needs a CUDA GPU and accordion_hvd built with its CUDA kernels")
    out = _run(mode, "gloo", 2, env={"ACCORDION_TEST_DEVICE": "cuda", "HOROVOD_FUSION_THRESHOLD": "0"})
    print(out)  # the ranks' reports, for the GPU log (pytest -rA)
    assert out.count(" on cuda, size 2") == 2, out  # both ranks really trained on the GPU
