"""Worker run by tests/test_hsdp.py under torchrun (Gloo), on every rank: the FSDP2 (HSDP)
front end (accordion_hvd/hsdp.py) against a NumPy reference of the whole data path.

The world is NODES "nodes" of the rest: a 2-D mesh ("replicate", "shard"), rank r at node
r // per_node, shard r % per_node. The model's parameters W and loss = sum(W * G[r, t]) (as
tests/workers/numpy_reference_check.py), so the gradient on rank r at step t is G[r, t],
seeded, and SGD with lr=1.0 makes W_t - W_{t+1} the applied update. The reference, for every
rank:

  FSDP within a node: shard j of node i gets S[i, j] = mean over the node's ranks of their
      G's rows of shard j (torch.chunk's rows; padded with zero rows to the even size);
  ours across nodes, per shard j, on the padded shard exactly as on a layer of that shape:
      PowerSGD  M_i = S_i + e_i; P = orth(mean_i(M_i Q)); Q = mean_i(M_i^T P); update P Q^T;
      TopK      g_i = S_i + e_i; the k = ceil(ratio * numel) largest, ties to the lower index;
      Quantize  per chunk s = max|g| / 127, q = round(g / s); the mean of q s; e = g - q s;
      1-D       the mean over nodes.

Modules ``a`` and ``b`` are each ``fully_shard``ed (two hook calls per backward), ``b.odd``
has 13 rows (shards of 7 and 6 rows: a padding row), ``b.frozen`` does not train,
``b.sometimes`` is unused on rank 1 in even steps (FSDP then reduces zeros for it). Parameters must
match within rtol=atol=1e-4 (PowerSGD) or 1e-5, TopK's and Quantize's updates bit for bit,
the parameters be identical on the ranks of every node pair, the frozen one unchanged.
Mode ``settled``: the quantization codec under the link gate, set in its dense trial (the
second window, where the link did not price the dense step), which sends every layer whole in
float16 (a layer too small to compress in float32), until before step 2 the gate
is set as it decides when compression does not pay: from then on each module's buffer goes
whole in float16 with its own error feedback (accordion_hvd/engine/whole.py), seeded from its
layers'; bit for bit. In step 5 rank 1's gradient has a NaN, as in mode accordion: the step is
skipped, and a rank's finite buffer keeps its g = s + e in error feedback.
Modes ``quantize-bf16`` and ``settled-bf16``: the same with float32 parameters and FSDP's
reduce-scatter in bfloat16 (``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``), which FSDP
casts into new float32 gradients after the hook: each rank's gradient rounded to bfloat16,
summed in bfloat16 and halved in it; ours on that; the results written into the gradients (a
codec's result rounded to the buffer's bfloat16 first); a buffer sent whole goes in bfloat16,
its rounding kept in error feedback; bit for bit.
Mode ``accordion``: PowerSGD(1, 4) under Accordion, windows of 2 steps, with gradient scales
that change by rank and step: no reference, but every rank must hold the same levels after
every step and every replica the same parameters. In step 5 rank 1's gradient has a NaN in a
row of shard 0: only shard group 0 sees it in its data, and every rank must skip the step
(parameters unchanged, ``step_skipped``), the run going on finite after it.

Usage: hsdp_reference_check.py MODE STEPS
"""

import math
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import accordion_hvd as acc
from worker_util import checker, leave_torch_distributed, orthogonalize, quantize32, say

mode, steps = sys.argv[1], int(sys.argv[2])
BF16 = mode.endswith("-bf16")  # FSDP reduces in bfloat16 (float32 parameters)
mode = mode.removesuffix("-bf16")
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
NODES = 2
PER_NODE = size // NODES
node, shard = divmod(rank, PER_NODE)
check = checker(rank)
mesh = init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=("replicate", "shard"))

SHAPES = {"a.w2d": (24, 40), "a.bias": (24,), "b.conv": (16, 3, 5, 5), "b.odd": (13, 40), "b.sometimes": (10, 40)}
FROZEN = {"b.frozen": (6, 10)}
COMPRESSED = ("a.w2d", "b.conv", "b.odd", "b.sometimes")


def unused(r: int, t: int) -> bool:
    """b.sometimes is not used by rank 1 in even steps (FSDP reduces a zero gradient for it)."""
    return r == 1 and t % 2 == 0
CHUNK, RATIO = 64, 0.1
NAN_STEP = 5  # mode accordion: rank 1's gradient is not finite in this step
SETTLE_AT = 2  # mode settled: the link gate decides, between steps 1 and 2, that compression does not pay
POWERSGD, TOPK, QUANT, SETTLED = mode in ("powersgd", "accordion"), mode == "topk", mode == "quantize", mode == "settled"
codec = {"powersgd": acc.PowerSGD(rank=2), "topk": acc.TopK(ratio=RATIO),
         "quantize": acc.Quantize(bits=8, chunk=CHUNK, min_numel=64),
         "accordion": acc.PowerSGD(rank=1, critical_rank=4),
         "settled": acc.Quantize(bits=8, chunk=CHUNK, min_numel=64)}[mode]


def grads(r: int, t: int) -> dict[str, np.ndarray]:
    rs = np.random.RandomState(1000 * t + r)
    if TOPK:  # multiples of 1/4: exact sums and means of two, many ties
        out = {n: (rs.randint(-8, 9, size=s) / 4).astype(np.float32) for n, s in SHAPES.items()}
    else:
        scale = (1.0 if t < 4 else 0.1) * (3.0 if r % 2 and t % 3 == 0 else 1.0) if mode == "accordion" else 1.0
        out = {n: (rs.standard_normal(s) * scale).astype(np.float32) for n, s in SHAPES.items()}
    if unused(r, t):
        out["b.sometimes"] = np.zeros(SHAPES["b.sometimes"], np.float32)
    if mode in ("accordion", "settled") and (r, t) == (1, NAN_STEP):
        out["a.w2d"][0, 0] = np.nan  # row 0: shard 0's
    return out


class Part(torch.nn.Module):
    def __init__(self, shapes, seed, frozen=None):
        super().__init__()
        rs = np.random.RandomState(seed)
        for n, s in shapes.items():
            setattr(self, n, torch.nn.Parameter(torch.from_numpy(rs.standard_normal(s).astype(np.float32))))
        for n, s in (frozen or {}).items():
            setattr(self, n, torch.nn.Parameter(torch.ones(s), requires_grad=False))
        self.trained = list(shapes)

    def forward(self, g):  # FSDP gathers a module's parameters for its own forward
        return sum((getattr(self, n) * g[n]).sum() for n in self.trained if n in g) + \
            sum(p.sum() for p in self.parameters() if not p.requires_grad)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Part({n[2:]: s for n, s in SHAPES.items() if n.startswith("a.")}, 7)
        self.b = Part({n[2:]: s for n, s in SHAPES.items() if n.startswith("b.")}, 8,
                      {n[2:]: s for n, s in FROZEN.items()})

    def forward(self, g):
        return sum(part({n[2:]: v for n, v in g.items() if n.startswith(f"{name}.")})
                   for name, part in (("a", self.a), ("b", self.b)))


model = Model()
initial = {n: p.detach().double().numpy().copy() for n, p in model.named_parameters()}
sharding = dict(mesh=mesh["shard"], mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if BF16 else
                MixedPrecisionPolicy())
fully_shard(model.a, **sharding)
fully_shard(model.b, **sharding)
fully_shard(model, **sharding)
opt = torch.optim.SGD(model.parameters(), lr=1.0)
policy = dict(interval=2, eta=0.5) if mode == "accordion" else dict(policy="link-gate") if SETTLED else {}
compression = acc.AccordionCompressor(codec, **policy)
hook = acc.compress_hsdp(model, compression, mesh, optimizer=opt)
if SETTLED:  # the dense trial, as the gate runs it after a compressed window on a fast link
    compression.engine.policy.load_state_dict({**compression.engine.policy.state_dict(), "phase": "dense-trial",
                                               "compressed_s": 1.0})
params = dict(model.named_parameters())


# --- the reference ---------------------------------------------------------------------------
def rows_of(n: str, j: int) -> slice:
    rows = SHAPES[n][0]
    per = -(-rows // PER_NODE)
    return slice(min(j * per, rows), min((j + 1) * per, rows))


def padded_shard(x: np.ndarray, n: str, j: int) -> np.ndarray:
    per = -(-SHAPES[n][0] // PER_NODE)
    out = np.zeros((per, *SHAPES[n][1:]), dtype=x.dtype)
    part = x[rows_of(n, j)]
    out[:part.shape[0]] = part
    return out


ref_w = {n: v.copy() for n, v in initial.items()}
ref_e, ref_q = {}, {}


def mean_in(dtype: torch.dtype, sent: list[np.ndarray]) -> np.ndarray:
    """Gloo's mean of ``sent`` in a 16-bit dtype: each sum rounded to it, then the division
    (torch's CPU arithmetic: in float32, rounded back)."""
    total = None
    for x in sent:
        x = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(dtype)
        total = x if total is None else total + x
    return (total / len(sent)).float().numpy()


def dense16(n: str, j: int, s_nodes: list[np.ndarray]) -> np.ndarray:
    """Sent whole in float16, the rounding kept in error feedback: Gloo sums float16 in float32
    and rounds back (as NumPy does), the mean divides in float16. A bfloat16 buffer: the same
    in bfloat16."""
    if BF16:
        sent = []
        for i, s in enumerate(s_nodes):
            g = (s + ref_e.get((i, j, n), np.float32(0))).astype(np.float32)
            sent.append(torch.from_numpy(g).bfloat16().float().numpy())
            ref_e[i, j, n] = (g - sent[-1]).astype(np.float32)
        return mean_in(torch.bfloat16, sent)
    total = None
    for i, s in enumerate(s_nodes):
        g = (s + ref_e.get((i, j, n), np.float32(0))).astype(np.float32)
        sent = g.astype(np.float16)
        ref_e[i, j, n] = (g - sent.astype(np.float32)).astype(np.float32)
        total = sent if total is None else (total + sent).astype(np.float16)
    return (total / np.float16(NODES)).astype(np.float16).astype(np.float32)


def node_shards(g_all: list, n: str, j: int) -> list[np.ndarray]:
    """FSDP's reduce-scatter (AVG) within each node, in float32: shard j of ``n`` per node
    (in bfloat16: each rank's gradient rounded to it, the sum and the mean in it)."""
    if BF16:
        return [mean_in(torch.bfloat16, [padded_shard(g_all[i * PER_NODE + jj][n], n, j) for jj in range(PER_NODE)])
                for i in range(NODES)]
    s_nodes = []
    for i in range(NODES):
        total = np.zeros_like(padded_shard(g_all[0][n], n, j))
        for jj in range(PER_NODE):
            total = (total + padded_shard(g_all[i * PER_NODE + jj][n], n, j)).astype(np.float32)
        s_nodes.append((total / np.float32(PER_NODE)).astype(np.float32))
    return s_nodes


def skipped_whole_step(g_all: list) -> dict[str, np.ndarray]:
    """Mode settled, a skipped step: no update; a rank whose module buffer (every shard of the
    module's parameters on it) is finite keeps its g = s + e in error feedback, the others
    keep e as it was."""
    shards = {(n, j): node_shards(g_all, n, j) for n in SHAPES for j in range(PER_NODE)}
    for i in range(NODES):
        for j in range(PER_NODE):
            for module in ("a", "b"):
                names = [n for n in SHAPES if n.startswith(module + ".")]
                if all(np.isfinite(shards[n, j][i]).all() for n in names):
                    for n in names:
                        ref_e[i, j, n] = (shards[n, j][i] + ref_e.get((i, j, n), np.float32(0))).astype(np.float32)
    return {n: np.zeros(SHAPES[n]) for n in SHAPES}


def reference_step(t: int) -> dict[str, np.ndarray]:
    g_all = [grads(r, t) for r in range(size)]
    if SETTLED and t == NAN_STEP:
        return skipped_whole_step(g_all)
    update = {}
    for n in SHAPES:
        full = np.zeros(SHAPES[n], np.float64)
        for j in range(PER_NODE):
            s_nodes = node_shards(g_all, n, j)
            if SETTLED and (n in COMPRESSED or t >= SETTLE_AT):  # the gate's dense trial, then whole buffers
                result = dense16(n, j, s_nodes)
            elif n not in COMPRESSED:
                result = mean_in(torch.bfloat16, s_nodes) if BF16 else sum(s.astype(np.float64) for s in s_nodes) / NODES
            elif POWERSGD:
                shape = (s_nodes[0].shape[0], math.prod(s_nodes[0].shape[1:]))
                if (n, j) not in ref_q:
                    ref_q[n, j] = codec.init_state(n, torch.zeros(s_nodes[0].shape)).q.double().numpy()
                ms = [s.reshape(shape).astype(np.float64) + ref_e.get((i, j, n), 0.0) for i, s in enumerate(s_nodes)]
                p = orthogonalize(sum(m @ ref_q[n, j] for m in ms) / NODES, codec.eps)
                q = sum(m.T @ p for m in ms) / NODES
                m_hat = p @ q.T
                for i in range(NODES):
                    ref_e[i, j, n] = ms[i] - m_hat
                ref_q[n, j] = q
                result = m_hat.reshape(s_nodes[0].shape)
            elif QUANT:
                total = np.zeros(s_nodes[0].size, np.float32)
                for i, s in enumerate(s_nodes):
                    g = s.reshape(-1) + ref_e.get((i, j, n), np.float32(0))
                    q, scales = quantize32(g, 8, CHUNK)
                    sent = (q * np.repeat(scales, CHUNK)[:g.size]).astype(np.float32)
                    total = (total + sent).astype(np.float32)
                    ref_e[i, j, n] = (g - sent).astype(np.float32)
                result = (total / np.float32(NODES)).reshape(s_nodes[0].shape)
                if BF16:  # the codec's result in the buffer's dtype
                    result = torch.from_numpy(result).bfloat16().float().numpy()
            else:  # TopK
                numel = s_nodes[0].size
                k = math.ceil(RATIO * numel)
                total = np.zeros(numel)
                for i, s in enumerate(s_nodes):
                    g = s.reshape(-1).astype(np.float64) + ref_e.get((i, j, n), 0.0)
                    keep = np.sort(np.argsort(-np.abs(g), kind="stable")[:k])
                    total[keep] += g[keep]
                    ref_e[i, j, n] = g.copy()
                    ref_e[i, j, n][keep] = 0.0
                result = (total / NODES).reshape(s_nodes[0].shape)
            rows = rows_of(n, j)
            full[rows] = result[:rows.stop - rows.start]
        update[n] = full
    return update


# --- train and compare -----------------------------------------------------------------------
TOL = 1e-4 if POWERSGD else 1e-5
worst = 0.0
full_w = None
seen = set()  # every level a layer held after some step
for t in range(steps):
    if SETTLED and t == SETTLE_AT:  # what the gate's second trial would decide on a fast link
        gate = compression.engine.policy
        gate.load_state_dict({**gate.state_dict(), "phase": "dense", "dense_s": 1.0, "compressed_s": 1.0})
        check(compression.engine.settled_dense, "the link gate did not settle")
    mine = grads(rank, t)
    opt.zero_grad()
    model({n: torch.from_numpy(v) for n, v in mine.items() if not (n == "b.sometimes" and unused(rank, t))}).backward()
    applied = {n: params[n].grad.full_tensor().double().numpy() for n in SHAPES}
    opt.step()
    before, full_w = full_w if t else initial, {n: p.full_tensor().detach().double().numpy() for n, p in params.items()}
    if mode == "accordion":
        skipped = t == NAN_STEP
        check(compression.step_skipped == skipped, f"step {t}: step_skipped is {compression.step_skipped}")
        check(all(np.array_equal(before[n], full_w[n]) == skipped for n in SHAPES) and
              all(np.isfinite(w).all() for w in full_w.values()),
              f"step {t}: parameters {'changed in a skipped step' if skipped else 'not updated, or not finite'}")
    else:
        expected = reference_step(t)
        if SETTLED:
            check(compression.step_skipped == (t == NAN_STEP), f"step {t}: step_skipped is {compression.step_skipped}")
        for n in SHAPES:
            ref_w[n] = ref_w[n] - expected[n]
            err = max(np.abs(full_w[n] - ref_w[n]).max(), np.abs(applied[n] - expected[n]).max())
            worst = max(worst, err)
            check(np.allclose(full_w[n], ref_w[n], rtol=TOL, atol=TOL) and
                  np.allclose(applied[n], expected[n], rtol=TOL, atol=TOL),
                  f"step {t} {n}: differs from the NumPy reference by {err:.3g} (tol {TOL})")
            if (TOPK or QUANT) and n in COMPRESSED or SETTLED and (n in COMPRESSED or t >= SETTLE_AT):
                check(np.array_equal(applied[n].astype(np.float32), expected[n].astype(np.float32)),
                      f"step {t} {n}: update not bit-identical to the exact reference")
    for n in FROZEN:
        check(np.array_equal(full_w[n], initial[n]), f"step {t} {n}: the frozen parameter changed")
    flat = torch.cat([torch.from_numpy(full_w[n]).float().reshape(-1) for n in sorted(full_w)])
    everyone = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(everyone, flat)
    check(all(torch.equal(everyone[0], e) for e in everyone), f"step {t}: parameters differ across ranks")
    levels = [layer["level"] for _, layer in sorted(compression.stats()["layers"].items())]
    gathered = [None] * size
    dist.all_gather_object(gathered, levels)
    check(all(g == levels for g in gathered), f"step {t}: ranks hold different levels: {gathered}")
    seen.update(levels)

stats = compression.stats()
check(stats["steps"] == steps, f"stats() counted {stats['steps']} steps, not {steps}")
if SETTLED:  # every trained layer went in its module's buffer, in 16 bits
    levels = {n: layer["level"] for n, layer in stats["layers"].items()}
    check(levels == {n: "dense16" for n in SHAPES}, f"levels once settled: {levels}")
else:
    compressed = sorted(n for n, layer in stats["layers"].items() if layer["level"] != "dense")
    check(compressed == sorted(COMPRESSED), f"compressed layers {compressed}, expected {sorted(COMPRESSED)}")
seen = sorted(seen)
say(f"rank {rank}: OK {mode}{'-bf16' * BF16} {codec!r} through hsdp, mesh {NODES}x{PER_NODE}, {steps} steps, "
    f"max |error| {worst:.2e}, levels {seen}")
leave_torch_distributed(dist)
