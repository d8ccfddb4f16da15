"""Run by scripts/install_check.sh under torchrun (2 ranks, Gloo) in a venv that has torch and
the installed accordion_hvd only: the README's DDP hook and DiLoCo each train a small model.
Fails (non-zero exit) if the package is imported from the checkout, if Horovod is there, or if
either run does not learn."""

import importlib.util
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import accordion_hvd as acc

dist.init_process_group("gloo")
rank = dist.get_rank()
where = Path(acc.__file__).resolve()
if "site-packages" not in where.parts:  # (the venv may live inside the checkout, its copy in site-packages)
    sys.exit(f"accordion_hvd was imported from {where}, not from the installed package")
if importlib.util.find_spec("horovod") is not None:
    sys.exit("Horovod is installed here: this check is of an environment with torch only")

torch.manual_seed(0)
centres = torch.randn(4, 32) * 2
labels = torch.randint(0, 4, (2048,))
points = centres[labels] + torch.randn(2048, 32)
share = slice(rank * 1024, (rank + 1) * 1024)  # each rank its half of the data
x_all, y_all = points[share], labels[share]


def make_model() -> torch.nn.Module:
    torch.manual_seed(1)  # the same start on every rank
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def batches(steps: int):
    for step in range(steps):
        at = (step * 32) % 1024
        yield x_all[at:at + 32], y_all[at:at + 32]


def loss_of(model) -> float:
    with torch.no_grad():
        return F.cross_entropy(model(points), labels).item()


# The README's DDP hook
net = make_model()
model = torch.nn.parallel.DistributedDataParallel(net)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
compression = acc.AccordionCompressor(acc.PowerSGD(rank=1, critical_rank=4))
acc.register_ddp_hook(model, compression, optimizer=opt)
before = loss_of(net)
for x, y in batches(150):
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
after = loss_of(net)
if not after < before / 4:
    sys.exit(f"rank {rank}: the DDP hook's run did not learn: loss {before:.3f} -> {after:.3f}")
print(f"rank {rank}: DDP hook: loss {before:.3f} -> {after:.3f}, sent {compression.stats()['bytes_sent']:,} bytes",
      flush=True)

# The README's DiLoCo
model = make_model()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
diloco = acc.DiLoCo(model, opt)
before = loss_of(model)
for x, y in batches(300):
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    diloco.step()
with diloco.synced():
    after = loss_of(model)
if not after < before / 4:
    sys.exit(f"rank {rank}: DiLoCo's run did not learn: loss {before:.3f} -> {after:.3f}")
print(f"rank {rank}: DiLoCo: loss {before:.3f} -> {after:.3f} in {diloco.syncs} rounds "
      f"(accordion_hvd from {where.parent}, torch {torch.__version__}, pid {os.getpid()})", flush=True)
dist.destroy_process_group()
