"""Worker run by tests/test_horovod_contracts.py under horovodrun, on every rank: Horovod's
``op=`` (and ``process_set=``) honoured by the compressor, or refused by name.

Usage: horovod_op_check.py CODEC MODE   (CODEC: powersgd | topk)

MODE "sum": three copies of one model see the same data on each rank: A with our compressor
and op=hvd.Average, B with our compressor and op=hvd.Sum, C with Horovod's own uncompressed
allreduce and op=hvd.Sum. Over three steps (lr 0, so the copies stay equal and each
compressor's error feedback evolves alike) every layer's reduced gradient of B must be
``size`` times A's (compressed layers included), and B's uncompressed layers must equal
Horovod's own sum (C).
MODE "predivide": B uses op=hvd.Average with gradient_predivide_factor=4: still the average.
MODE "refuse-adasum", "refuse-min": the first step raises a ValueError naming the op, on
every rank, before any collective (then the worker prints OK and exits).
MODE "process-set": (3 ranks) every rank builds an optimizer reducing over the process set
{0, 1}: every rank, rank 2 outside it too, gets a ValueError naming process_set as Horovod
builds it (Horovod would call the compressor on ranks 0 and 1 only).
MODE "broadcast-state": with this package imported (its construction check in place), Horovod's
own ``broadcast_optimizer_state`` still tells Horovod's optimizer from a plain one: rank 0's
optimizer has state, rank 1's is fresh, and the broadcast must not step Horovod's optimizer on
rank 1 alone (a collective rank 0 never joins: a hang).
MODE "two-optimizers": one compressor given to two optimizers: the second is refused as it
is built, on every rank, with a ValueError naming the first.
MODE "passes": B uses backward_passes_per_step=2, each pass on half the batch with half the
loss: its reduced gradients equal A's, whose one pass takes the whole batch.
MODE "sparse": a model with a sparse embedding (sparse_as_dense=False: Horovod reduces that
gradient itself, the compressor never sees it) trains alike on every rank.
"""

import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import accordion_hvd as acc
from worker_util import checker, say

codec_name, mode = sys.argv[1], sys.argv[2]
pair = hvd.ProcessSet([0, 1]) if mode == "process-set" else None
hvd.init(process_sets=[pair] if pair is not None else None)
rank, size = hvd.rank(), hvd.size()
check = checker(rank)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 4))


def make_codec():
    return acc.PowerSGD(rank=2) if codec_name == "powersgd" else acc.TopK(ratio=0.25)


def make_optimizer(model, compressed: bool, **horovod_args):
    compression = (acc.AccordionCompressor(make_codec(), named_parameters=model.named_parameters())
                   if compressed else hvd.Compression.none)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), compression=compression, **horovod_args)
    return opt, compression


gen = torch.Generator().manual_seed(rank)
x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen)


def reduced_gradients(model, opt, passes: int = 1) -> dict:
    opt.zero_grad()
    for part in range(passes):  # gradient accumulation: each pass on its share of the batch
        rows = slice(part * len(x) // passes, (part + 1) * len(x) // passes)
        (F.cross_entropy(model(x[rows]), y[rows]) / passes).backward()
    opt.synchronize()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with opt.skip_synchronize():
        opt.step()
    return grads


if mode.startswith("refuse-") or mode == "process-set":
    op = {"refuse-adasum": hvd.Adasum, "refuse-min": hvd.Min}.get(mode, hvd.Average)
    expected = {"refuse-adasum": "op=hvd.Adasum", "refuse-min": "op=hvd.Min"}.get(mode, "process_set=")
    # Every rank builds the optimizer, those outside the process set too (as Horovod's own tests
    # do): each must be refused, as Horovod builds it, not only the ranks that would compress.
    model = make_model()
    try:
        opt, _ = make_optimizer(model, True, op=op, **({"process_set": pair} if pair is not None else {}))
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    except Exception as exc:  # noqa: BLE001 - what a user would see, whatever wraps it
        text = f"{type(exc).__name__}: {exc}"
        check(expected in text and "ValueError" in text, f"expected a ValueError naming {expected}, got {text}")
        say(f"rank {rank}: OK refused: {text[:160]}")
        sys.exit(0)
    check(False, f"{mode}: the step ran; expected a ValueError naming {expected}")

if mode == "broadcast-state":
    check(hvd.DistributedOptimizer.__module__ == "horovod.torch.optimizer",
          f"the wrapped DistributedOptimizer's __module__ is {hvd.DistributedOptimizer.__module__}")
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    if rank == 0:  # momentum buffers on rank 0 only
        with opt.skip_synchronize():
            F.cross_entropy(model(x), y).backward()
            torch.optim.SGD.step(opt)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    state = opt.state_dict()["state"]
    check(len(state) == len(list(model.parameters())), f"rank {rank} has state for {len(state)} parameters")
    say(f"rank {rank}: OK broadcast-state")
    sys.exit(0)

if mode == "two-optimizers":
    first_model, second_model = make_model(), make_model()
    compression = acc.AccordionCompressor(make_codec())
    first = hvd.DistributedOptimizer(torch.optim.SGD(first_model.parameters(), lr=0.1),
                                     named_parameters=first_model.named_parameters(), compression=compression)
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(second_model.parameters(), lr=0.1),
                                 named_parameters=second_model.named_parameters(), compression=compression)
    except ValueError as exc:
        check("already bound to another hvd.DistributedOptimizer" in str(exc), f"unclear: {exc}")
        say(f"rank {rank}: OK refused: ValueError: {str(exc)[:120]}")
        sys.exit(0)
    check(False, "one compressor was accepted by two optimizers")

if mode == "sparse":
    torch.manual_seed(0)
    embed, head = torch.nn.Embedding(100, 32, sparse=True), torch.nn.Linear(32, 64)
    out = torch.nn.Linear(64, 4)
    model = torch.nn.ModuleDict({"embed": embed, "head": head, "out": out})
    compression = acc.AccordionCompressor(make_codec(), named_parameters=model.named_parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                   compression=compression)
    tokens = torch.randint(0, 100, (16,), generator=gen)
    for step in range(3):
        opt.zero_grad()
        F.cross_entropy(out(torch.relu(head(embed(tokens)))), y).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    check(torch.equal(hvd.broadcast(flat, root_rank=0, name="sparse.final"), flat), "parameters differ between ranks")
    layers = compression.stats()["layers"]
    check("embed.weight" not in layers and layers["head.weight"]["floats_sent"] < layers["head.weight"]["floats_dense"],
          f"expected the embedding left to Horovod and head.weight compressed: {layers}")
    say(f"rank {rank}: OK sparse {codec_name}")
    sys.exit(0)

a, b, c = make_model(), make_model(), make_model()
opt_a, comp_a = make_optimizer(a, True)
b_args = {"sum": {"op": hvd.Sum}, "predivide": {"gradient_predivide_factor": 4.0},
          "passes": {"backward_passes_per_step": 2}}[mode]
opt_b, comp_b = make_optimizer(b, True, **b_args)
opt_c, _ = make_optimizer(c, False, **b_args)
factor = size if mode == "sum" else 1
passes = b_args.get("backward_passes_per_step", 1)
for step in range(3):
    ga = reduced_gradients(a, opt_a)
    gb, gc = reduced_gradients(b, opt_b, passes), reduced_gradients(c, opt_c, passes)
    for name in ga:
        check(torch.allclose(gb[name], factor * ga[name], rtol=1e-5, atol=1e-6),
              f"step {step}: {name}: {mode} gave {gb[name].norm():.6g}, expected {factor} x average "
              f"{ga[name].norm():.6g} (ratio {gb[name].norm() / ga[name].norm():.4f})")
        if gb[name].dim() < 2:  # not compressed: Horovod's own reduction is the reference
            check(torch.allclose(gb[name], gc[name], rtol=1e-5, atol=1e-6),
                  f"step {step}: {name}: {gb[name].norm():.6g}, Horovod's own {gc[name].norm():.6g}")
layers = comp_b.stats()["layers"]
compressed = [n for n, s in layers.items() if s["floats_sent"] < s["floats_dense"]]
check(len(compressed) >= 2, f"expected the weights to be compressed, stats: {layers}")
say(f"rank {rank}: OK {mode} {codec_name}: {len(ga)} layers ({len(compressed)} compressed) x{factor}")
