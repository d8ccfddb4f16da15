"""The FSDP2 (HSDP) front end (accordion_hvd/hsdp.py) under a real ``torchrun`` (Gloo, 4
processes: 2 "nodes" of 2): the NumPy reference of the whole data path (FSDP's
reduce-scatter within a node, our codec across nodes) for PowerSGD, TopK and Quantize,
Accordion's levels agreed by every rank, and what registration refuses."""

import re

import pytest

from launch import run_ddp_worker


@pytest.mark.torchrun
@pytest.mark.parametrize("mode", ["powersgd", "topk", "quantize", "accordion"])
def test_hsdp_matches_the_numpy_reference(mode):
    out = run_ddp_worker("hsdp_reference_check.py", mode, "12", np=4, timeout=300)
    assert out.count(f": OK {mode} ") == 4, out
    if mode == "accordion":  # the rule switched levels (and every rank held the same, checked per step)
        assert "levels ['critical', 'dense', 'normal']" in out, out


BAD = {  # case -> (exception, what the message must say)
    "not-sharded": ("TypeError", "model must be sharded with FSDP2's fully_shard"),
    "one-dim-mesh": ("ValueError", "mesh must be a 2-D DeviceMesh with dimensions ('replicate', 'shard')"),
    "native-hsdp": ("ValueError", "was sharded over the 2-D mesh: FSDP would all-reduce it across nodes itself"),
    "reduce-dtype": ("ValueError", "reduce dtype torch.bfloat16 with parameters in torch.float32"),
    "not-a-compressor": ("TypeError", "compressor must be an acc.AccordionCompressor, got str"),
    "bound-elsewhere": ("ValueError", "already bound to another model"),
    "settings-differ": ("ValueError", "ranks were started with different compressor settings"),
}


@pytest.mark.torchrun
def test_bad_input_is_refused_at_registration_alike_on_every_rank():
    out = run_ddp_worker("hsdp_bad_input_check.py", np=4, timeout=300)
    for name, (kind, text) in BAD.items():
        lines = sorted(re.findall(rf"rank (\d): {name}: (.*)", out))
        assert [r for r, _ in lines] == ["0", "1", "2", "3"], (name, out)
        messages = {message for _, message in lines}
        assert len(messages) == 1, f"{name}: ranks raised different errors: {messages}"
        message = messages.pop()
        assert message.startswith(f"{kind}: ") and text in message, (name, message)
