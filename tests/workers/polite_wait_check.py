"""Worker run by tests/test_horovod.py under horovodrun: Horovod's DistributedOptimizer, with
accordion_hvd's polite wait installed, waits for a late rank without spinning a core, and
its results are Horovod's own; AccordionCompressor(wait=...) installs the wait it names.

Rank 1 arrives one second late to each collective; rank 0 measures the CPU time its main
thread spends waiting (a busy wait costs about as much CPU as wall time, a polite one a
few percent). Exits non-zero, with a message, on the first violated expectation.
"""

import os
import time

import horovod.torch as hvd
import torch

import accordion_hvd as acc
from accordion_hvd.comm.horovod import polite_synchronize
from accordion_hvd.horovod.patches import WAIT_ENV, install_polite_wait, installed_wait
from worker_util import checker, say

hvd.init()
rank, size = hvd.rank(), hvd.size()
check = checker(rank)
LATE = 1.0

# Bad setting: a clear error naming the variable, and nothing installed.
os.environ[WAIT_ENV] = "busy"
try:
    install_polite_wait()
    check(False, f"{WAIT_ENV}=busy was accepted")
except ValueError as e:
    check(WAIT_ENV in str(e) and "'sleep'" in str(e) and "'spin'" in str(e), f"unclear error: {e}")
check(installed_wait() is None, "installed despite a bad setting")
os.environ[WAIT_ENV] = "spin"
check(install_polite_wait() is False, "spin mode installed the polite wait")
del os.environ[WAIT_ENV]
check(install_polite_wait() and install_polite_wait(), "install_polite_wait is not idempotent")
check(installed_wait() == "sleep", "DistributedOptimizer does not use the polite wait")

# The compressor's visible option: installed when Horovod first calls the compressor.
try:
    acc.AccordionCompressor(wait="busy")
    check(False, "wait='busy' was accepted")
except ValueError as e:
    check("wait must be 'sleep' or 'spin'" in str(e), f"unclear error: {e}")
small = torch.nn.Linear(64, 64)
hvd.broadcast_parameters(small.state_dict(), root_rank=0)  # the same start on every rank (checked at the first step)
spinning = hvd.DistributedOptimizer(torch.optim.SGD(small.parameters(), lr=0.1), named_parameters=small.named_parameters(),
                                    compression=acc.AccordionCompressor(acc.PowerSGD(1), wait="spin"))
small(torch.randn(4, 64)).sum().backward()
spinning.step()
check(installed_wait() == "spin", "wait='spin' left the polite wait installed")
check(install_polite_wait("sleep"), "the polite wait did not come back")

# 1. A lone collective: same result as Horovod's, little CPU while waiting.
if rank == 1:
    time.sleep(LATE)
handle = hvd.allreduce_async(torch.full((1000,), float(rank + 1)), op=hvd.Sum, name="polite.one")
cpu, wall = time.thread_time(), time.perf_counter()
total = polite_synchronize(handle)
cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
check(torch.equal(total, torch.full((1000,), float(size * (size + 1) / 2))), f"allreduce result wrong: {total[:3]}")
if rank == 0:
    check(wall > 0.5 * LATE, f"rank 0 did not wait for the late rank ({wall:.3f} s)")
    check(cpu < 0.25 * wall, f"waiting {wall:.3f} s cost {cpu:.3f} s of CPU: a busy wait")
    say(f"rank 0: lone collective waited {wall:.3f} s for {cpu:.3f} s of CPU")
check(polite_synchronize(handle) is None, "a finished handle: Horovod's synchronize returns None")

# 2. The optimizer: rank 1's gradients come late; rank 0's step() waits politely, and every
#    rank ends with the same parameters.
torch.manual_seed(7 + rank)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
for step in range(2):
    opt.zero_grad()
    if rank == 1:
        time.sleep(LATE)
    torch.nn.functional.cross_entropy(model(torch.randn(16, 32)), torch.randint(0, 4, (16,))).backward()
    cpu, wall = time.thread_time(), time.perf_counter()
    opt.step()
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    if rank == 0:
        check(wall > 0.5 * LATE, f"step {step}: rank 0 did not wait for the late rank ({wall:.3f} s)")
        check(cpu < 0.25 * wall, f"step {step}: opt.step() waited {wall:.3f} s for {cpu:.3f} s of CPU")
        say(f"rank 0: step {step} waited {wall:.3f} s for {cpu:.3f} s of CPU")
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
everyone = hvd.allgather(flat.unsqueeze(0), name="polite.params")
check(all(torch.equal(everyone[0], everyone[r]) for r in range(size)), "parameters differ across ranks")
say(f"rank {rank}: OK")
