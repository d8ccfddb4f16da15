"""Worker run by tests/test_hsdp.py under torchrun (Gloo, 4 ranks): the HSDP front end's
state saved and loaded with ``torch.distributed.checkpoint`` beside the model and optimizer.

1. A run of STEPS steps that never stops (PowerSGD under Accordion, windows of 2 steps,
   momentum SGD), its model, optimizer and compressor saved with DCP after step STEPS // 2.
2. A fresh model, optimizer and compressor on the same mesh, loaded from that checkpoint,
   runs the remaining steps: its parameters, error feedback, levels and step count must equal
   the first run's bit for bit.
3. On another mesh (4 x 1), the same checkpoint loaded with ``allow_partial_load``: the model
   and optimizer load (DCP reshards them), the compressor warns and starts from zero error
   feedback.

Mode ``settled``: the same with the quantization codec under a link gate that has settled on
16-bit dense (as it does where compression does not pay): every module's buffer goes whole, and
its error feedback (accordion_hvd/engine/whole.py) is what must resume bit for bit.

Usage: hsdp_checkpoint_check.py DIR STEPS [accordion|settled]
"""

import logging
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import accordion_hvd as acc
from worker_util import checker, leave_torch_distributed, say

where, steps = sys.argv[1], int(sys.argv[2])
SETTLED = sys.argv[3:] == ["settled"]
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
check = checker(rank)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(2))
        self.head = torch.nn.Linear(32, 8)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def build(shape):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    model = Net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if SETTLED:
        compression = acc.AccordionCompressor(acc.Quantize(bits=8), policy="link-gate")
        gate = compression.engine.policy  # as its trials decide on a link where compression does not pay
        gate.load_state_dict({**gate.state_dict(), "phase": "dense", "dense_s": 1.0, "compressed_s": 1.0})
    else:
        compression = acc.AccordionCompressor(acc.PowerSGD(rank=1, critical_rank=4), interval=2)
    hook = acc.compress_hsdp(model, compression, mesh, optimizer=opt)
    return model, opt, compression, hook


def train(model, opt, start, stop):
    for t in range(start, stop):
        g = torch.Generator().manual_seed(100 * t + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y * (1.0 if t < steps // 2 else 0.2)).backward()
        opt.step()


def snapshot(model, compression):
    params = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    state = compression.state_dict()
    ef = {n: layer["residual"].clone() for n, layer in state["layers"].items()}
    ef.update({f"buffer {key}": entry["e"].clone() for key, entry in state["whole"].items()})
    levels = {n: layer["level"] for n, layer in compression.stats()["layers"].items()}
    return params, ef, levels, state["steps"]


def save(model, opt, hook):
    model_sd, opt_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": opt_sd, "accordion": hook}, checkpoint_id=where)


def load(model, opt, hook, **kwargs):
    model_sd, opt_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": opt_sd, "accordion": hook}
    dcp.load(state, checkpoint_id=where, **kwargs)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


# 1. the run that never stops, saved halfway
model, opt, compression, hook = build((2, size // 2))
train(model, opt, 0, steps // 2)
save(model, opt, hook)
middle = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
middle_ef = snapshot(model, compression)[1]
train(model, opt, steps // 2, steps)
whole = snapshot(model, compression)

# 2. resumed on the same mesh
model, opt, compression, hook = build((2, size // 2))
load(model, opt, hook)
check(compression.stats()["steps"] == steps // 2, f"resumed at step {compression.stats()['steps']}")
loaded = snapshot(model, compression)
for n in middle:
    check(torch.equal(loaded[0][n], middle[n]), f"{n}: the loaded parameters are not the checkpoint's")
for n in middle_ef:
    check(torch.equal(loaded[1][n], middle_ef[n]), f"{n}: the loaded error feedback is not the checkpoint's")
train(model, opt, steps // 2, steps)
resumed = snapshot(model, compression)
for n in whole[0]:
    check(torch.equal(whole[0][n], resumed[0][n]), f"{n}: resumed parameters differ from the run that never stopped")
for n in whole[1]:
    check(torch.equal(whole[1][n], resumed[1][n]), f"{n}: resumed error feedback differs")
check(whole[2] == resumed[2] and whole[3] == resumed[3], f"levels or steps differ: {whole[2:]} vs {resumed[2:]}")
if SETTLED:  # one buffer per FSDP module (two blocks and the root), with error feedback
    buffers = [n for n, e in whole[1].items() if n.startswith("buffer ") and bool(e.abs().sum() > 0)]
    check(len(buffers) == 3, f"buffers with error feedback: {buffers}")
else:
    check(len(set(whole[2].values())) > 1 or "critical" in whole[2].values(), f"levels: {whole[2]}")


# 3. another mesh: the compressor starts again, with a warning
class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


caught = Warnings()
logging.getLogger("accordion_hvd").addHandler(caught)
model, opt, compression, hook = build((size, 1))
load(model, opt, hook, planner=DefaultLoadPlanner(allow_partial_load=True))
check(any("starts again" in m for m in caught.messages), f"no warning on another mesh: {caught.messages}")
check(compression.stats()["steps"] == 0, "another mesh: the compressor's state was loaded")
for n, p in model.named_parameters():  # the model itself loaded, resharded by DCP
    check(torch.equal(p.full_tensor(), middle[n]), f"another mesh: {n} is not the checkpoint's")
train(model, opt, steps // 2, steps // 2 + 2)
check(all(bool(torch.isfinite(p.full_tensor()).all()) for p in model.parameters()), "another mesh: not finite")
say(f"rank {rank}: OK hsdp checkpoint{' (settled)' if SETTLED else ''}: resumed bit for bit after {steps // 2} of {steps} steps on mesh "
    f"2x{size // 2}; on mesh {size}x1 the compressor started again; levels {sorted(set(whole[2].values()))}")
leave_torch_distributed(dist)
