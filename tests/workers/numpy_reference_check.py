"""Worker run by tests/test_numpy_reference.py under horovodrun, on every rank.

Proves that what the stock ``hvd.DistributedOptimizer`` applies with ``AccordionCompressor``
is, step after step, exactly the algorithm on paper, by recomputing it independently in
pure NumPy (float64) for ALL ranks on every rank.

The model is built so that the applied update is observable exactly: parameters W and
    loss = sum over params of sum(W * G[r, t])
so the gradient on rank r at step t is G[r, t] (a seeded matrix every rank can regenerate:
``numpy.random.RandomState(1000 * t + r)``), and plain SGD with lr=1.0 and no momentum makes
W_t - W_{t+1} the decompressed gradient. The reference:

  PowerSGD (per compressed layer, matrices (shape[0], prod(rest))):
      M_r = G_r + e_r;  P = mean_r(M_r Q);  P = orthogonalize(P)  (Gram-Schmidt, eps added
      to each column norm);  Q = mean_r(M_r^T P);  update = P Q^T;  e_r = M_r - P Q^T;
      Q is kept as the next step's warm start (the initial Q is taken from the codec: it is
      an input, not the algorithm).
  TopK (per compressed layer, flattened):
      g_r = G_r + e_r;  keep the k = ceil(ratio * numel) largest |g_r|, ties to the LOWER
      index;  update = sum_r(sparse_r) / world size;  e_r = g_r with the kept entries zeroed.
  Dense layers (1-D, or too small): update = mean_r(G_r).

Modes (argv[1]):
  powersgd   PowerSGD(rank=2) on a 24x40 weight, an 8x3x5x5 conv-like weight and a dense
             bias; standard normal gradients. Parameters must match the float64 reference
             within rtol=atol=1e-4 (float32 arithmetic; measured: up to 6.5e-6 after 6 steps).
  topk       TopK(ratio=0.1) on the same layers, with gradients quantized to multiples of
             1/4 in [-2, 2], so |g| has many exact ties, and ties that straddle the k-th
             place (the worker asserts they occur, so tie-breaking is really exercised).
             All sums are exact in float32, so the applied update of the compressed layers
             must equal the reference BIT FOR BIT; parameters within 1e-5.
  powersgd-switch, topk-switch
             the same, with levels switched by the policy every 2 steps: PowerSGD(rank=1,
             critical_rank=4) goes rank 1, 4, 1, 4 (Q keeps its columns and gets fresh seeded
             ones, or drops the last ones; error feedback is kept), TopK(ratio=0.1,
             critical_ratio=0.2) goes 10%, 20%, 10%, 20%. The reference follows the same
             schedule. Same tolerances (TopK still bit for bit).
  quantize, quantize-switch
             Quantize(bits=8, chunk=64) on the same layers (min_numel lowered so both are
             compressed), and Quantize(bits=8, critical_bits=16) switched 8, 16, 8, 16 bits
             by the same schedule. The reference quantizes in float32 exactly as specified
             (per chunk s = max|g| / 127 or 32767, q = round(g / s) half to even, the mean of
             the dequantized payloads, e = g - q s): the applied update must equal it BIT FOR
             BIT.
  quantize-sparse
             Quantize(bits=8, chunk=64, skip_energy=0.2): each rank sends only the chunks of
             g = grad + e that hold 80% of its energy, largest first; the count is the largest
             any rank needed in the last step (every chunk in the first). The reference orders
             chunks by float64 energy (ties to the lower index), scatters every rank's
             dequantized chunks in rank order, and must equal the update BIT FOR BIT; it also
             checks that the count went below every chunk (the sparse path really ran).
  settled    (DDP only) Quantize under the link gate, set before step 0 as it decides where
             compression does not pay: every DDP bucket goes whole in float16, with the
             bucket's own error feedback (accordion_hvd/engine/whole.py), the bias too:
             g_r = G_r + e_r, e_r = g_r - float16(g_r), update = mean_r float16(g_r). On 2
             ranks bit for bit (Gloo sums two float16 in float32 and rounds, as NumPy does);
             on 3 the order of Gloo's float16 sums is its own: within an ulp of the sum.
  topk-full  TopK(ratio=1.0, min_compression_rate=0.5): the layers count as compressed
             (asserted through stats()), but at a level keeping every entry they go
             through Horovod's dense allreduce with the error feedback folded in, so the
             result must equal hvd.allreduce(G, op=hvd.Average) bit for bit. (The bias is
             not compressed: the compressor averages it on its own data plane, whose sums
             may round differently from Horovod's on 3 ranks; it is held to the reference.)

After every step: parameters (and applied updates) against the reference, and parameters
bit-identical on all ranks. Catches wrong averaging (sum vs mean), missing or wrong error
feedback, no warm start of Q, wrong orthogonalization, wrong tie-breaking, wrong k.
With $ACCORDION_TEST_DEVICE=cuda the parameters and gradients live on the GPU, so the
compressor runs the CUDA kernels inside the real Horovod data path; the reference and every
comparison stay on the host. Nothing else changes: the same tolerances, TopK still bit for bit.

The same worker proves the DDP front end (accordion_hvd/ddp.py): with FRONT "ddp", run under
``torchrun`` (Gloo), the model is wrapped in DistributedDataParallel with our comm hook
instead of Horovod's optimizer; everything else, the reference and tolerances included, is
the same (modes powersgd and topk).

Usage: numpy_reference_check.py MODE STEPS [FRONT]    (FRONT: horovod, the default, or ddp)
"""

import math
import os
import sys

import numpy as np
import torch

import accordion_hvd as acc
from worker_util import checker, leave_torch_distributed, orthogonalize, quantize32, say

mode, steps = sys.argv[1], int(sys.argv[2])
front = sys.argv[3] if len(sys.argv) > 3 else "horovod"
device = torch.device(os.environ.get("ACCORDION_TEST_DEVICE", "cpu"))
if front == "horovod":
    import horovod.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
else:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
check = checker(rank)

SHAPES = {"w2d": (24, 40), "conv": (8, 3, 5, 5), "bias": (24,)}
COMPRESSED = ("w2d", "conv")  # stated here, not asked from the codec: bias is 1-D, so dense
SWITCH = mode.endswith("-switch")
POWERSGD, TOPK = mode.startswith("powersgd"), mode in ("topk", "topk-switch")
QUANT = mode.startswith("quantize")
SKIP = 0.2  # quantize-sparse's skip_energy
CHUNK = 64  # Quantize's chunk here: several per layer, the last one short (960 = 15 x 64, 600 = 9 x 64 + 24)
RATIO = {"topk": 0.1, "topk-switch": 0.1, "topk-full": 1.0}.get(mode)
CRITICAL_RATIO, CRITICAL_RANK = 0.2, 4


def critical_at(t: int) -> bool:
    """The switch modes' schedule: the critical level in steps 2-3, 6-7, ... (windows of 2)."""
    return SWITCH and (t // 2) % 2 == 1


class Schedule(acc.policies.Policy):
    """The level of every layer by ``critical_at``: decided at the end of each 2-step window."""
    name, uses_norms, reacts_to_lr = "schedule", False, False

    def __init__(self):
        self.windows = 0

    def initial_level(self, layer):
        return acc.levels.NORMAL

    def end_window(self, report):
        self.windows += 1
        level = acc.levels.CRITICAL if critical_at(2 * self.windows) else acc.levels.NORMAL
        return {layer: level for layer in report.norms}


if mode == "powersgd":
    codec = acc.PowerSGD(rank=2)
elif mode == "powersgd-switch":
    codec = acc.PowerSGD(rank=1, critical_rank=CRITICAL_RANK)
elif mode == "topk":
    codec = acc.TopK(ratio=RATIO)
elif mode == "topk-switch":
    codec = acc.TopK(ratio=RATIO, critical_ratio=CRITICAL_RATIO)
elif mode == "quantize":
    codec = acc.Quantize(bits=8, chunk=CHUNK, min_numel=256)
elif mode == "quantize-switch":
    codec = acc.Quantize(bits=8, critical_bits=16, chunk=CHUNK, min_numel=256)
elif mode == "quantize-sparse":
    codec = acc.Quantize(bits=8, chunk=CHUNK, min_numel=256, skip_energy=SKIP)
elif mode == "topk-full":
    codec = acc.TopK(ratio=RATIO, min_compression_rate=0.5)  # so that ratio 1.0 is still "compressed"
elif mode == "settled" and front == "ddp":
    codec = acc.Quantize(bits=8, chunk=CHUNK, min_numel=256)
else:
    raise SystemExit(f"unknown mode {mode!r}")


def grads(r: int, t: int) -> dict[str, np.ndarray]:
    """G[r, t]: float32 values (what torch sees), same on every rank that asks."""
    rs = np.random.RandomState(1000 * t + r)
    if TOPK:  # quantized: many exact ties in magnitude, exact sums
        return {n: (rs.randint(-8, 9, size=s) / 4).astype(np.float32) for n, s in SHAPES.items()}
    return {n: rs.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


# --- the model: W, and loss = sum(W * G) ---------------------------------------------------
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        rs = np.random.RandomState(7)
        for n, s in SHAPES.items():
            setattr(self, n, torch.nn.Parameter(torch.from_numpy(rs.standard_normal(s).astype(np.float32))))

    def forward(self, g):
        return sum((getattr(self, n) * g[n]).sum() for n in SHAPES)


model = Model().to(device)
params = dict(model.named_parameters())
SETTLED = mode == "settled"
compression = (acc.AccordionCompressor(codec, policy=Schedule(), interval=2) if SWITCH else
               acc.AccordionCompressor(codec, policy="link-gate") if SETTLED else acc.AccordionCompressor(codec))
if SETTLED:
    gate = compression.engine.policy
    gate.load_state_dict({**gate.state_dict(), "phase": "dense", "dense_s": 1.0, "compressed_s": 1.0})
if front == "horovod":
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.0),
                                   named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    forward = model

    def gather_params(flat, t):
        return hvd.allgather(flat.unsqueeze(0), name=f"check.params.{t}")
else:
    forward = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's parameters
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.0)
    acc.register_ddp_hook(forward, compression, optimizer=opt)

    def gather_params(flat, t):
        out = [torch.empty_like(flat) for _ in range(size)]
        dist.all_gather(out, flat)
        return torch.stack(out)


# --- the NumPy reference, for all ranks ----------------------------------------------------
def topk_keep(g: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest |g|, ties towards the lower index (stable sort)."""
    return np.sort(np.argsort(-np.abs(g), kind="stable")[:k])


ref_w = {n: p.detach().cpu().double().numpy().copy() for n, p in params.items()}
# Error feedback e[r, name] of every rank: a matrix for PowerSGD, a flat vector for TopK.
ref_e = {(r, n): np.zeros((SHAPES[n][0], math.prod(SHAPES[n][1:])) if POWERSGD else math.prod(SHAPES[n]),
                         dtype=np.float32 if QUANT else np.float64)
         for r in range(size) for n in COMPRESSED}
if POWERSGD:
    # The initial Q: an input of the algorithm, taken from the codec (seeded per layer name),
    # and the seeded columns a switch to a higher rank adds (column j depends only on j).
    ref_q = {n: codec.init_state(n, torch.zeros(SHAPES[n])).q.double().numpy() for n in COMPRESSED}
    fresh_q = {n: codec.init_state(n, torch.zeros(SHAPES[n]), acc.levels.CRITICAL).q.double().numpy()
               for n in COMPRESSED}
straddling_ties = {n: 0 for n in COMPRESSED}
ref_k = {n: -(-math.prod(SHAPES[n]) // CHUNK) for n in COMPRESSED}  # quantize-sparse: chunks sent, every one first
fewest_k = dict(ref_k)


def sparse_chunks(g: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, int]:
    """quantize-sparse, one rank: (what it sends, dequantized in place; e after; its k_next)."""
    chunks = -(-g.size // CHUNK)
    padded = np.zeros(chunks * CHUNK, np.float32)
    padded[:g.size] = g
    energy = (padded.reshape(chunks, CHUNK).astype(np.float64) ** 2).sum(axis=1)
    order = np.argsort(-energy, kind="stable")
    cum = np.cumsum(energy[order])
    k_next = int((cum < (1.0 - SKIP) * cum[-1]).sum()) + 1
    keep = np.sort(order[:k])
    q, scales = quantize32(padded.reshape(chunks, CHUNK)[keep].reshape(-1), 8, CHUNK)
    sent = np.zeros((chunks, CHUNK), np.float32)
    sent[keep] = (q.reshape(k, CHUNK).astype(np.float32) * scales[:, None]).astype(np.float32)
    sent = sent.reshape(-1)[:g.size]
    return sent, (g - sent).astype(np.float32), min(k_next, chunks)


whole_e = {(r, n): np.zeros(SHAPES[n], np.float32) for r in range(size) for n in SHAPES}  # mode settled


def settled_step(t: int) -> dict[str, np.ndarray]:
    update = {}
    for n in SHAPES:
        sent = []
        for r in range(size):
            g = (grads(r, t)[n] + whole_e[r, n]).astype(np.float32)
            sent.append(g.astype(np.float16))
            whole_e[r, n] = (g - sent[-1].astype(np.float32)).astype(np.float32)
        if size == 2:  # Gloo's float16 sum of two, then the mean in float16
            update[n] = ((sent[0] + sent[1]) / np.float16(2)).astype(np.float16).astype(np.float64)
        else:
            update[n] = sum(x.astype(np.float64) for x in sent) / size
    return update


def reference_step(t: int) -> dict[str, np.ndarray]:
    """The update every rank must apply at step t (float64), advancing the reference state."""
    if SETTLED:
        return settled_step(t)
    g_all = [{n: v.astype(np.float64) for n, v in grads(r, t).items()} for r in range(size)]
    update = {n: sum(g[n] for g in g_all) / size for n in SHAPES}  # dense layers: the mean
    for n in COMPRESSED:
        if POWERSGD:
            rank = min(CRITICAL_RANK if critical_at(t) else codec.rank, *ref_e[0, n].shape)
            if rank > ref_q[n].shape[1]:  # a switch up: the columns Q has, then fresh seeded ones
                ref_q[n] = np.hstack([ref_q[n], fresh_q[n][:, ref_q[n].shape[1]:rank]])
            ref_q[n] = ref_q[n][:, :rank]  # a switch down drops the last columns
            ms = [g_all[r][n].reshape(ref_e[r, n].shape) + ref_e[r, n] for r in range(size)]
            p = orthogonalize(sum(m @ ref_q[n] for m in ms) / size, codec.eps)
            q = sum(m.T @ p for m in ms) / size
            m_hat = p @ q.T
            for r in range(size):
                ref_e[r, n] = ms[r] - m_hat
            ref_q[n] = q  # warm start
            update[n] = m_hat.reshape(SHAPES[n])
        elif mode == "quantize-sparse":  # float32, in the codec's order: exact
            total, needs = np.zeros(math.prod(SHAPES[n]), np.float32), []
            for r in range(size):
                sent, ref_e[r, n], k_next = sparse_chunks(grads(r, t)[n].reshape(-1) + ref_e[r, n], ref_k[n])
                total = (total + sent).astype(np.float32)
                needs.append(k_next)
            ref_k[n] = max(1, max(needs))
            fewest_k[n] = min(fewest_k[n], ref_k[n])
            update[n] = (total / np.float32(size)).reshape(SHAPES[n])
        elif QUANT:  # float32 throughout, in the codec's order: exact
            bits = 16 if critical_at(t) else 8
            total = np.zeros(math.prod(SHAPES[n]), np.float32)
            for r in range(size):
                g = grads(r, t)[n].reshape(-1) + ref_e[r, n]
                q, scales = quantize32(g, bits, CHUNK)
                sent = (q.astype(np.float32) * np.repeat(scales, CHUNK)[:g.size]).astype(np.float32)
                total = (total + sent).astype(np.float32)
                ref_e[r, n] = (g - sent).astype(np.float32)
            update[n] = (total / np.float32(size)).reshape(SHAPES[n])
        else:
            k = math.ceil((CRITICAL_RATIO if critical_at(t) else RATIO) * math.prod(SHAPES[n]))
            total = np.zeros(math.prod(SHAPES[n]))
            for r in range(size):
                g = g_all[r][n].reshape(-1) + ref_e[r, n]
                keep = topk_keep(g, k)
                if k < g.size:
                    mags = np.sort(np.abs(g))[::-1]
                    straddling_ties[n] += int(mags[k - 1] == mags[k])
                total[keep] += g[keep]
                ref_e[r, n] = g.copy()
                ref_e[r, n][keep] = 0.0
            update[n] = (total / size).reshape(SHAPES[n])
    return update


# --- train and compare, step by step -------------------------------------------------------
PARAM_TOL = 1e-4 if POWERSGD else 1e-5
if SETTLED and size > 2:  # within an ulp of float16 sums of |x| < 16 per step, over the steps (measured: 2.1e-3)
    PARAM_TOL = 1e-2
worst = 0.0
for t in range(steps):
    mine = grads(rank, t)
    opt.zero_grad()
    loss = forward({n: torch.from_numpy(mine[n]).to(device) for n in SHAPES})
    loss.backward()
    opt.step()
    applied = {n: p.grad.detach().to("cpu", copy=True) for n, p in params.items()}  # Horovod set_()s the decompressed grad
    expected = reference_step(t)
    for n, p in params.items():
        ref_w[n] = ref_w[n] - expected[n]
        got_w, got_u = p.detach().cpu().double().numpy(), applied[n].double().numpy()
        err_w = np.abs(got_w - ref_w[n]).max()
        err_u = np.abs(got_u - expected[n]).max()
        worst = max(worst, err_w, err_u)
        check(np.allclose(got_w, ref_w[n], rtol=PARAM_TOL, atol=PARAM_TOL),
              f"step {t} {n}: parameters differ from the NumPy reference by {err_w:.3g} (tol {PARAM_TOL})")
        check(np.allclose(got_u, expected[n], rtol=PARAM_TOL, atol=PARAM_TOL),
              f"step {t} {n}: applied update differs from the NumPy reference by {err_u:.3g}")
        if (TOPK or QUANT) and n in COMPRESSED and not SETTLED or SETTLED and size == 2:
            check(np.array_equal(applied[n].numpy(), expected[n].astype(np.float32)),
                  f"step {t} {n}: {type(codec).__name__} update not bit-identical to the exact reference "
                  f"({int((applied[n].numpy() != expected[n].astype(np.float32)).sum())} entries differ)")
    if mode == "topk-full":
        for n in COMPRESSED:
            dense = hvd.allreduce(torch.from_numpy(mine[n]).to(device), op=hvd.Average,
                                  name=f"check.dense.{n}.{t}").cpu()
            check(torch.equal(applied[n], dense),
                  f"step {t} {n}: TopK(ratio=1.0) differs from hvd.allreduce(op=Average) in "
                  f"{int((applied[n] != dense).sum())} entries, by up to {(applied[n] - dense).abs().max().item():.3g}")
    flat = torch.cat([p.detach().cpu().reshape(-1) for p in params.values()])
    everyone = gather_params(flat, t)
    check(all(torch.equal(everyone[0], everyone[r]) for r in range(size)), f"step {t}: parameters differ across ranks")

layers = compression.stats()["layers"]
for n in SHAPES:
    want = ("critical" if critical_at(steps) else "normal") if n in COMPRESSED else "dense"
    want = "dense16" if SETTLED else want
    check(layers[n]["level"] == want, f"{n} went {layers[n]['level']!r}, expected {want!r}")
if SWITCH:
    check(steps >= 6, "the switch modes need 6 steps or more (levels 1, 4, 1)")
if mode == "quantize-sparse":
    full = {n: -(-math.prod(SHAPES[n]) // CHUNK) for n in COMPRESSED}
    check(all(fewest_k[n] < full[n] for n in COMPRESSED), f"the chunks sent never went below all: {fewest_k} of {full}")
if TOPK:
    check(all(straddling_ties.values()), f"no tie straddled the k-th place in some layer: {straddling_ties}")
ties = f", ties straddling the k-th place {straddling_ties}" if TOPK else ""
say(f"rank {rank}: OK {mode} {codec!r} through {front} on {device.type}, size {size}, {steps} steps, "
    f"max |error| {worst:.2e}{ties}")
if front == "ddp":
    leave_torch_distributed(dist)  # every group, ours included, destroyed; no interpreter teardown
