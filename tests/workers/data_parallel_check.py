"""Worker run by tests/test_horovod.py under horovodrun (Gloo or MPI), on every rank.

Proves the stack this project stands on, in real processes:
  * Horovod collectives pair the right tensors across ranks (named, rank-dependent data);
  * accordion_hvd's compiled op loads and runs inside a Horovod worker;
  * the stock DistributedOptimizer keeps every rank's parameters identical;
  * mpi4py's world matches Horovod's under --mpi, and is a lone process under --gloo
    (which is why the regime controller must not trust MPI blindly under Gloo).
Exits non-zero, with a message, on the first violated expectation.
"""

import sys

import horovod.torch as hvd
import torch
from mpi4py import MPI

import accordion_hvd as acc
from worker_util import checker
from accordion_hvd import reference

backend, expected_size = sys.argv[1], int(sys.argv[2])
hvd.init()
rank, size = hvd.rank(), hvd.size()

check = checker(rank)

check(size == expected_size, f"hvd.size() == {size}, expected {expected_size}")
check(hvd.mpi_enabled() == (backend == "mpi"), f"hvd.mpi_enabled() is {hvd.mpi_enabled()} under --{backend}")
check(hvd.gloo_enabled() == (backend == "gloo"), f"hvd.gloo_enabled() is {hvd.gloo_enabled()} under --{backend}")

# 1. Collectives: every rank contributes rank-dependent data; two named collectives in
#    flight at once must not be confused with each other.
a = hvd.allreduce_async(torch.full((1000,), float(rank + 1)), op=hvd.Sum, name="check.a")
b = hvd.allgather_async(torch.tensor([rank * 10, rank * 10 + 1], dtype=torch.int32), name="check.b")
total = hvd.synchronize(a)
gathered = hvd.synchronize(b)
check(torch.equal(total, torch.full((1000,), float(size * (size + 1) / 2))), f"allreduce sum wrong: {total[:3]}")
check(gathered.tolist() == [v for r in range(size) for v in (r * 10, r * 10 + 1)], f"allgather wrong: {gathered}")

# 2. The compiled op inside a worker process.
g, e = torch.randn(4097), torch.randn(4097)
expected = reference.ef_add(g, e)
check(torch.equal(acc.ops.ef_add_(g, e), expected), "accordion::ef_add_ differs from its reference")

# 3. Training with the stock DistributedOptimizer: each rank sees different data, and all
#    ranks must still hold identical parameters after every step.
torch.manual_seed(1234 + rank)  # deliberately different initial weights...
model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # ...made equal here
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
for step in range(5):
    x, y = torch.randn(8, 20), torch.randint(0, 3, (8,))
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
everyone = hvd.allgather(flat.unsqueeze(0), name="check.params")
check(all(torch.equal(everyone[0], everyone[r]) for r in range(size)), "parameters differ across ranks")

# 4. What mpi4py sees.
world = MPI.COMM_WORLD
if backend == "mpi":
    check(world.Get_size() == size and world.Get_rank() == rank,
          f"MPI world (rank {world.Get_rank()} of {world.Get_size()}) differs from Horovod's")
    check(world.allreduce(rank, op=MPI.SUM) == size * (size - 1) // 2, "mpi4py allreduce wrong")
else:
    check(world.Get_size() == 1, f"under --gloo each process should be its own MPI world, got {world.Get_size()}")

print(f"rank {rank}: OK ({backend}, size {size})", flush=True)
