"""Worker run by tests/test_ddp_hook.py under torchrun: register_ddp_hook refuses, at
registration and on every rank, a process group whose ranks differ from the model's and a
model that has already run a backward; and the hook averages, uncompressed and with a warning, a parameter it was not told about at
registration, never handing it another parameter's result."""

import logging

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import accordion_hvd as acc
from worker_util import checker, say

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
check = checker(rank)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 4))
ddp = DistributedDataParallel(model)

only_rank0 = dist.new_group([0])  # a collective: every rank makes it
try:
    acc.register_ddp_hook(ddp, acc.AccordionCompressor(acc.PowerSGD(2)), process_group=only_rank0)
    check(False, "a process group of other ranks was accepted")
except ValueError as exc:
    check("process_group has ranks [0]" in str(exc) and f"ranks {list(range(size))}" in str(exc), f"unclear: {exc}")

# A hook told about every parameter but the first layer's weight: that one is averaged as it
# is (plain DDP average), the others go through the compressor.
compression = acc.AccordionCompressor(acc.PowerSGD(2))
hook = acc.register_ddp_hook(ddp, compression)
unknown = model[0].weight
del hook._names[id(unknown)]


class Recorder(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


recorder = Recorder()
logging.getLogger("accordion_hvd.ddp").addHandler(recorder)
x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
ddp(x).sum().backward()
local = torch.autograd.grad(model(x).sum(), unknown)[0]
dist.all_reduce(local)
check(torch.allclose(unknown.grad, local / size, atol=1e-6), "the unknown parameter's gradient is not the plain average")
check(any("did not have when the hook was registered" in m for m in recorder.messages), f"no warning: {recorder.messages}")
check("0.weight" not in compression.stats()["layers"], "the unknown parameter reached the compressor")
check("2.weight" in compression.stats()["layers"], "the known parameters did not")

# Registered after the model's first backward: refused, naming what to do, on every rank.
late = DistributedDataParallel(torch.nn.Linear(8, 8))
late(torch.randn(2, 8)).sum().backward()
try:
    acc.register_ddp_hook(late, acc.AccordionCompressor(acc.PowerSGD(2)))
    check(False, "a hook registered after the first backward was accepted")
except RuntimeError as exc:
    check("before the model's first backward" in str(exc), f"unclear: {exc}")
# Every rank done before any tears its groups down: a rank that exits while another still
# holds open Gloo pairs to it can abort that one (SIGABRT in Gloo's I/O loop).
dist.barrier()
dist.destroy_process_group()
say(f"rank {rank}: OK")
