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

from launch import run_worker

pytestmark = pytest.mark.horovod

WORLDS = [("gloo", 2), ("mpi", 2), ("gloo", 3), ("mpi", 3)]
STEPS = "6"


def _run(mode, backend, np):
    out = run_worker("numpy_reference_check.py", mode, STEPS, np=np, backend=backend)
    assert out.count(f": OK {mode} ") == np, out


@pytest.mark.parametrize("backend,np", WORLDS)
@pytest.mark.parametrize("mode", ["powersgd", "topk"])
def test_matches_numpy_reference(mode, backend, np):
    _run(mode, backend, np)


# TopK at ratio 1.0 sends every entry through the compressed path; the result must be
# Horovod's own dense average, bit for bit. On 3 ranks it is not (1 ulp in a third to a half
# of the entries): the codec divides the rank-order sum by the world size
# (reference.sparse_average), while Horovod computes Average as its backend's sum times
# float32(1/size); and Gloo's ring allreduce does not even sum in rank order. On 2 ranks both
# differences vanish (a + b == b + a, x / 2 == x * 0.5), so it passes there.
_FULL_RATIO_NOT_EXACT = pytest.mark.xfail(
    strict=True, reason="TopK(ratio=1.0) on 3 ranks differs from hvd.allreduce(op=Average) by 1 ulp: "
                        "x / size instead of Horovod's x * (1/size), and rank-order sum vs the backend's")


@pytest.mark.parametrize("backend,np", [
    ("gloo", 2), ("mpi", 2),
    pytest.param("gloo", 3, marks=_FULL_RATIO_NOT_EXACT),
    pytest.param("mpi", 3, marks=_FULL_RATIO_NOT_EXACT),
])
def test_topk_full_ratio_is_horovods_dense_average_bit_for_bit(backend, np):
    _run("topk-full", backend, np)
