"""Worker run by tests/test_diloco.py under torchrun, 4 ranks: ``acc.DiLoCo`` across the nodes
of HSDP (a 2 x 2 ("replicate", "shard") mesh, the model ``fully_shard``-ed over
``mesh["shard"]``) against a plain-torch DiLoCo of the whole model written out here.

The reference: every rank holds the whole model; an inner step averages the gradients of the
two ranks of a node (what FSDP's reduce-scatter inside the node gives) and takes the inner SGD
step; every H steps the pseudo-gradients are averaged over the nodes and the outer SGD with
Nesterov momentum updates the start-of-round parameters.

Usage: diloco_hsdp_check.py MODE
MODE "lossless": TopK keeping every entry (every weight through the codec, the biases through
the uncompressed round): after every round each parameter, gathered whole, equals the
reference's (to float32 rounding: FSDP and the reference sum in different orders), on every
rank; nodes differ between rounds (nothing crosses them) and agree at each round.
MODE "overlap": the same with ``overlap=True`` (each round lands at the next, each rank's model
its result plus the progress since the launch; the reference likewise); after ``flush()`` the
nodes agree.
MODE "nonfinite": a NaN in one rank's shard of one parameter inside round 2, so that one column
alone finds it in its data: the ranks of each node agree, round 2 is skipped on every rank
(the whole model back at the round's start), and round 3 goes on.
MODE "bad-input": a model sharded over the whole mesh, a sharded model without mesh=, a mesh
of the wrong shape and a model with parameters left unsharded are each refused with a
ValueError naming ``mesh``, on every rank.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import accordion_hvd as acc
from worker_util import checker, leave_torch_distributed, say

mode = sys.argv[1]
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
check = checker(rank)
NODES, PER_NODE = 2, 2
mesh = init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=("replicate", "shard"))
node = mesh.get_local_rank("replicate")
# the reference's own groups (made by every rank, in the same order): each node, and every rank
NODE_GROUPS = [dist.new_group(row, backend="gloo") for row in mesh.mesh.tolist()]
EVERY = dist.new_group(list(range(size)), backend="gloo")
H, ROUNDS, LR = 3, 3, 0.05
gen = torch.Generator().manual_seed(100 + rank)
DATA = [(torch.randn(8, 24, generator=gen), torch.randint(0, 4, (8,), generator=gen)) for _ in range(H * ROUNDS)]


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def sharded(model, over):
    for module in (model[0], model[2], model):
        fully_shard(module, mesh=over)
    return model


def reference_rounds(overlap=False):
    """The whole model's parameters after each round, by the plain-torch DiLoCo (module doc);
    ``overlap``: each round's average applied at the next round's start."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    start = [p.detach().clone() for p in model.parameters()]
    outer = torch.optim.SGD(start, lr=0.7, momentum=0.9, nesterov=True)
    params, after, pending = list(model.parameters()), [], None

    def land(average, launched):
        for s, a in zip(start, average):
            s.grad = a
        outer.step()
        for s, p, then in zip(start, params, launched or start):
            p.copy_(s if launched is None else s + (p - then))

    for i in range(H * ROUNDS):
        x, y = DATA[i]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=NODE_GROUPS[node])
            p.grad /= PER_NODE
        opt.step()
        if (i + 1) % H == 0:
            with torch.no_grad():
                if pending is not None:
                    land(*pending)
                average = [s - p for s, p in zip(start, params)]
                for a in average:
                    dist.all_reduce(a, group=EVERY)  # a node's two ranks hold the same: the mean over nodes
                    a /= size
                pending = (average, [p.detach().clone() for p in params]) if overlap else land(average, None)
            after.append([p.detach().clone() for p in model.parameters()])
    return after


def whole(model):
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def node_agrees(tensors) -> bool:
    """Whether every rank holds these (whole) tensors equal (a collective over every rank)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(gathered, flat, group=EVERY)
    return all(torch.equal(g, gathered[0]) for g in gathered)


if mode in ("lossless", "overlap"):
    overlap = mode == "overlap"
    expected = reference_rounds(overlap)
    model = sharded(make_model(), mesh["shard"])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    compressor = acc.AccordionCompressor(acc.TopK(1.0, min_compression_rate=0.5), policy="static")
    diloco = acc.DiLoCo(model, opt, compressor, sync_every=H, mesh=mesh, overlap=overlap, plain_below=1)
    rounds = 0
    for i in range(H * ROUNDS):
        x, y = DATA[i]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if (i + 1) % H == 1 and i > 0:  # inside a round's interval: the nodes went apart
            check(not node_agrees(whole(model)), f"step {i}: the nodes agree between rounds (something crossed them)")
        if diloco.step():
            got = whole(model)
            for name, a, b in zip(("0.weight", "0.bias", "2.weight", "2.bias"), got, expected[rounds]):
                check(torch.allclose(a, b, rtol=1e-5, atol=1e-6),
                      f"round {rounds}: {name} differs from the reference by {float((a - b).abs().max()):.3g}")
            check(overlap or node_agrees(got), f"round {rounds}: the ranks disagree after the round")
            rounds += 1
    check(rounds == ROUNDS, f"{rounds} rounds, expected {ROUNDS}")
    shard_floats = sum(p.to_local().numel() for p in model.parameters())
    dense = diloco.compressor.stats()["floats_dense"]  # this rank's shards, every inner step
    check(dense == H * ROUNDS * shard_floats, f"floats_dense {dense}, expected {H * ROUNDS} x {shard_floats}")
    layers = diloco.compressor.stats()["layers"]
    check(layers["0.weight"]["level"] != "dense", f"0.weight was not compressed: {layers['0.weight']}")
    with diloco.synced():  # the last round's model, on the shards
        check(node_agrees(whole(model)), "synced() differs across ranks")
    if overlap:
        diloco.flush()
        check(node_agrees(whole(model)), "the ranks disagree after flush()")
    say(f"rank {rank}: OK {mode}")

elif mode == "nonfinite":
    model = sharded(make_model(), mesh["shard"])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    compressor = acc.AccordionCompressor(acc.Quantize(8, min_numel=64), policy="static")
    diloco = acc.DiLoCo(model, opt, compressor, sync_every=H, mesh=mesh, plain_below=1)
    after = []
    for i in range(H * ROUNDS):
        x, y = DATA[i]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i + 1 == 2 * H and rank == 1:  # one shard of one node: column 1 alone sees it
            with torch.no_grad():
                model[0].weight.to_local()[0, 0] = float("nan")
        if diloco.step():
            after.append(whole(model))
    check(diloco.skipped == 1, f"rank {rank}: {diloco.skipped} rounds skipped, expected 1 (round 2, on every rank)")
    check(all(torch.equal(a, b) for a, b in zip(after[1], after[0])), "the skipped round moved the parameters")
    check(all(torch.isfinite(a).all() for a in after[2]) and not all(torch.equal(a, b) for a, b in zip(after[2], after[1])),
          "round 3 did not go on")
    for got in after:
        check(node_agrees(got), "the ranks disagree after a round")
    say(f"rank {rank}: OK {mode}")

elif mode == "bad-input":
    def refused(make, what):
        try:
            make()
        except ValueError as exc:
            check("mesh" in str(exc), f"{what}: the error does not name mesh: {exc}")
            return
        check(False, f"{what}: not refused")

    def diloco_of(model, **kwargs):
        return lambda: acc.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=LR), sync_every=H, **kwargs)

    refused(diloco_of(sharded(make_model(), mesh), mesh=mesh), "sharded over the whole mesh")
    refused(diloco_of(sharded(make_model(), mesh["shard"])), "sharded, without mesh=")
    refused(diloco_of(sharded(make_model(), mesh["shard"]), mesh=mesh["shard"]), "a 1-D mesh")
    partly = make_model()
    fully_shard(partly[0], mesh=mesh["shard"])  # the second layer left plain
    refused(diloco_of(partly, mesh=mesh), "a model partly sharded")
    say(f"rank {rank}: OK bad-input")

leave_torch_distributed(dist)
