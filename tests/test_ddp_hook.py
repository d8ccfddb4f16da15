"""The DDP front end (accordion_hvd/ddp.py): AccordionCompressor as a DDP comm hook, under a
real ``torchrun`` (Gloo), checked against the same NumPy reference as the Horovod path
(tests/workers/numpy_reference_check.py with FRONT "ddp"), and its registration errors."""

import pytest
import torch

import accordion_hvd as acc
from launch import run_ddp_worker


@pytest.mark.torchrun
@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("mode", ["powersgd", "topk"])
def test_ddp_hook_matches_numpy_reference(mode, np):
    out = run_ddp_worker("numpy_reference_check.py", mode, "6", "ddp", np=np)
    assert out.count(f": OK {mode} ") == np, out


def test_registering_on_a_model_not_wrapped_in_ddp_names_the_argument():
    with pytest.raises(TypeError, match="ddp_model must be a torch.nn.parallel.DistributedDataParallel, got Linear"):
        acc.register_ddp_hook(torch.nn.Linear(2, 2), acc.AccordionCompressor())


def test_a_compressor_serves_one_model():
    compressor = acc.AccordionCompressor()
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    compressor.bind(first, channel=None, control=None)
    compressor.bind(first, channel=None, control=None)  # the same model again: fine
    with pytest.raises(ValueError, match="already bound to another model"):
        compressor.bind(second, channel=None, control=None)
