"""Published methods for slow links with Adam-family optimizers, written in plain torch as
the CLI's peers and as issue 80's pilot subjects (``--sync sparseloco``, ``--sync signloco``,
``--sync onebit-adam``). None of them uses our engine: what they send is simulated exactly
(each rank's message decoded to floats and averaged with one float32 ``all_reduce``, the
same numbers an all-gather of the encoded messages would give every rank) and its size on
the wire is counted from the encoding the method specifies (``wire_bits`` in steps.csv), so
a run's trajectory is the method's own and its cost is arithmetic on that count.

- ``sparseloco`` (Sarfi et al., 2025, arXiv 2508.15706): local steps of the user's optimizer;
  every ``--sync-every`` steps (published: 15) the pseudo-gradient (round start minus the local
  model) is added to an error-feedback buffer that decays (``e = 0.95 e + delta``), TopK of
  ``--topk-density`` (128 of 4096) of each chunk of ``--topk-chunk`` entries kept, the kept
  values quantized to 2 bits (4 bins over 6 standard deviations, each sent as its bin's mean),
  subtracted from the buffer, and each entry averaged over the ranks that sent it; the model
  restarts from ``start - outer_lr * average`` (outer lr 1). As the authors' code
  (tplr-ai/SparseLoCo, ``sparseloco.yaml``) except: chunks are runs of 4096 entries of the
  flattened tensor, not 64 x 64 blocks, and tensors of fewer than 2 dimensions go whole.
- ``signloco``: the same round with a 1-bit message (each tensor's sign times its mean
  absolute value; error feedback without decay): the 1-bit exchange of 1-bit Adam applied
  to local AdamW's pseudo-gradients.
- ``onebit-adam`` (Tang et al., 2021, arXiv 2102.02888): ``--freeze-step`` steps of plain
  synchronous AdamW (gradients averaged), then Adam's second moment frozen and the momentum
  exchanged as signs with a scale (||x|| / sqrt(n)), error feedback on the worker and on the
  server side (DeepSpeed's ``compressed_allreduce``; its server halves are the whole tensor
  here, computed alike on every rank). Unlike DeepSpeed, which drops Adam's bias correction,
  the frozen moments are AdamW's bias-corrected ones at the freeze, as the user's AdamW had them.

Wire size: a sign is 1 bit, a quantized value ``--value-bits``, an index within its chunk
``ceil(log2(chunk))`` bits, a scale 32; tensors of fewer than 2 dimensions go in 16 bits.
"""

from __future__ import annotations

import math

import torch

from ..periodic.tensors import swapped_in
from .frontends import DDPFrontEnd
from .periodic import broadcast_model


# The published methods' own defaults, where they differ from the CLI flags' (options.py PERIODIC_FLAGS).
PUBLISHED_DEFAULTS = {"sparseloco": {"outer_lr": 1.0, "ef_decay": 0.95, "sync_every": 15},
                      "signloco": {"outer_lr": 1.0, "ef_decay": 1.0, "sync_every": 2}}


def check_published(p, args, flags: dict) -> None:
    """--sync sparseloco / signloco / onebit-adam (published.py): plain torch, no codec of ours;
    --sync ours-onebit-adam (onebit.py): acc.OneBitAdam, with codecs of its own."""
    if args.codec != "none":
        what = "acc.OneBitAdam, with codecs of its own" if args.sync == "ours-onebit-adam" else \
            "the published method in plain torch"
        p.error(f"--sync {args.sync} is {what}: --codec none, got --codec {args.codec}")
    if args.sync == "ours-onebit-adam":
        if args.max_update is not None and not args.max_update > 0:
            p.error(f"--max-update must be a positive number or none, got {args.max_update}")
        if args.optimizer != "adamw" or args.freeze_step is None or args.freeze_step < 1:
            p.error(f"--sync ours-onebit-adam is acc.OneBitAdam: --optimizer adamw and --freeze-step N (N >= 1), got "
                    f"--optimizer {args.optimizer} --freeze-step {args.freeze_step}")
        return
    if args.sync == "onebit-adam":
        if args.optimizer != "adamw":
            p.error(f"--sync onebit-adam is 1-bit Adam: --optimizer adamw, got --optimizer {args.optimizer}")
        if args.variance_every is not None:
            if args.variance_every < 1 or args.freeze_step not in (None, 0):
                p.error(f"--variance-every N (N >= 1) runs 1-bit Adam without a synchronous warm-up: it takes no "
                        f"--freeze-step, got --variance-every {args.variance_every} --freeze-step {args.freeze_step}")
            return
        if args.freeze_step is None or args.freeze_step < 0:
            p.error(f"--sync onebit-adam needs --freeze-step N (synchronous steps before the second moment freezes), "
                    f"got {args.freeze_step}")
        return
    if args.sync_every == "auto":
        p.error(f"--sync {args.sync} takes --sync-every N (a number of inner steps), not auto")
    for name, value in PUBLISHED_DEFAULTS[args.sync].items():
        if getattr(args, name) in (None, flags[name][0]):
            setattr(args, name, value)
    if not args.outer_lr > 0 or not 0 < args.ef_decay <= 1:
        p.error(f"--outer-lr must be positive and --ef-decay in (0, 1], got {args.outer_lr} and {args.ef_decay}")
    if not 0 < args.topk_density <= 1 or args.topk_chunk < 1:
        p.error(f"--topk-density in (0, 1] and --topk-chunk positive; got {args.topk_density}, {args.topk_chunk}")


def add_published_flags(p) -> None:
    """The published methods' flags (their defaults in options.py PERIODIC_FLAGS)."""
    p.add_argument("--topk-density", type=float, default=0.03125,
                   help="--sync sparseloco: the fraction of each chunk's entries a message keeps (published: 128 of 4096)")
    p.add_argument("--topk-chunk", type=int, default=4096, help="--sync sparseloco: entries per TopK chunk")
    p.add_argument("--value-bits", type=int, choices=(2, 32), default=2, help="--sync sparseloco: bits per kept value")
    p.add_argument("--ef-decay", type=float, default=None,
                   help="--sync sparseloco / signloco: the error-feedback buffer's decay per round (default: 0.95 for "
                        "sparseloco, 1 for signloco)")
    p.add_argument("--freeze-step", type=int, default=None,
                   help="--sync onebit-adam / ours-onebit-adam: warm-up steps before the second moment freezes")
    p.add_argument("--max-update", type=lambda v: None if v == "none" else float(v), default=3.0,
                   help="--sync ours-onebit-adam: the frozen stage's update of an entry clipped to this many learning "
                        "rates (acc.OneBitAdam max_update), or none")
    p.add_argument("--warmup-bits", type=int, choices=(8, 16), default=16,
                   help="--sync onebit-adam --freeze-step N, issue 80's pilot variant (onebit_shared.py): 8 sends the "
                        "warm-up's gradients as the per-step default's 8-bit sparse chunks, with error feedback")
    p.add_argument("--variance-every", type=int, default=None,
                   help="--sync onebit-adam, issue 80's pilot variant (onebit_shared.py): no synchronous warm-up; the "
                        "second moment from each rank's own gradients, averaged over the ranks at steps 1, 2, 4, ... "
                        "and then every N steps")


def _compressible(p: torch.Tensor) -> bool:
    return p.dim() >= 2


def scaled_sign(x: torch.Tensor) -> torch.Tensor:
    """1-bit message, decoded: sign(x) times mean |x| (the scale that minimises the L2 error)."""
    return torch.where(x >= 0, 1.0, -1.0).to(x.dtype) * x.abs().mean()


def rms_sign(x: torch.Tensor) -> torch.Tensor:
    """1-bit Adam's message, decoded (DeepSpeed ``compressed_allreduce``): sign(x), zero as +1,
    times ||x|| / sqrt(numel)."""
    return torch.where(x >= 0, 1.0, -1.0).to(x.dtype) * (x.norm() / math.sqrt(x.numel()))


def quantize_4bins(v: torch.Tensor) -> torch.Tensor:
    """SparseLoCo's 2-bit values, decoded (its ``quantization_bins=4, quantization_range=6``): about
    the values' mean, 4 bins of a quarter of 6 standard deviations each, every value replaced by
    its bin's mean."""
    if v.numel() < 2:
        return v.clone()
    mu = v.mean()
    c = v - mu
    step = 6 * c.std() / 4
    if not step > 0:
        return v.clone()
    q = torch.clamp(torch.round(c / step + 2), 0, 3).long()
    sums = torch.zeros(4, dtype=v.dtype).index_add_(0, q.view(-1), c.view(-1))
    counts = torch.zeros(4, dtype=v.dtype).index_add_(0, q.view(-1), torch.ones_like(c.view(-1)))
    return (sums / counts.clamp_min(1))[q] + mu


def chunked_topk(x: torch.Tensor, density: float, chunk: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseLoCo's message, decoded, and where it is nonzero: per chunk of ``chunk`` entries of
    the flattened tensor, the ``max(1, round(density * chunk))`` of largest magnitude; their
    values quantized together (``bits`` 2: ``quantize_4bins``; otherwise sent as they are)."""
    flat = x.reshape(-1)
    n = flat.numel()
    pad = (-n) % chunk
    rows = torch.cat([flat, flat.new_zeros(pad)]).view(-1, chunk)
    k = min(chunk, max(1, round(density * chunk)))
    _, idx = rows.abs().topk(k, dim=1)
    kept = rows.gather(1, idx)
    values = quantize_4bins(kept) if bits == 2 else kept
    out = torch.zeros_like(rows)
    out.scatter_(1, idx, values)
    mask = torch.zeros_like(rows)
    mask.scatter_(1, idx, 1.0)
    return out.view(-1)[:n].view_as(x), mask.view(-1)[:n].view_as(x)


def chunked_topk_bits(numel: int, density: float, chunk: int, bits: int) -> int:
    """Indices in ``ceil(log2(chunk))`` bits, values in ``bits``, and per tensor the 4 bin means
    and the mean in 32 bits each (bits 2) or nothing more."""
    chunks = math.ceil(numel / chunk)
    k = min(chunk, max(1, round(density * chunk)))
    return chunks * k * (math.ceil(math.log2(chunk)) + bits) + (5 * 32 if bits == 2 else 0)


class PseudoGradientRounds:
    """One round every ``every`` inner steps: the pseudo-gradient into a (decaying) error
    feedback buffer, a compressed message of the buffer out, the ranks' messages averaged (each
    entry over the ranks whose message holds it) and applied to the round's start with
    ``outer_lr``; the model restarts there. ``message(e)``: (decoded, nonzero mask, wire bits)."""

    def __init__(self, model, dist, message, every: int, ef_decay: float, outer_lr: float) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.dist, self.message, self.every = dist, message, every
        self.ef_decay, self.outer_lr = ef_decay, outer_lr
        self.start = [p.detach().clone().float() for p in self.params]
        self.error = [torch.zeros_like(s) for s in self.start]
        self.inner_steps = self.syncs = self.wire_bits = 0
        self.numel = sum(p.numel() for p in self.params)

    def step(self) -> None:
        self.inner_steps += 1
        if self.inner_steps % self.every:
            return
        with torch.no_grad():
            sent, chosen = [], []
            for s, p, e in zip(self.start, self.params, self.error):
                e.mul_(self.ef_decay).add_(s - p.float())
                if _compressible(p):
                    msg, mask, bits = self.message(e)
                else:
                    msg, mask, bits = e.clone(), torch.ones_like(e), 16 * e.numel()
                e.sub_(msg)
                sent.append(msg.reshape(-1))
                chosen.append(mask.reshape(-1))
                self.wire_bits += bits
            flat, count = torch.cat(sent), torch.cat(chosen)
            self.dist.all_reduce(flat)
            self.dist.all_reduce(count)  # (the indices every rank receives; not counted again)
            flat /= count.clamp_min(1)  # the mean over the ranks whose message holds the entry (SparseLoCo's)
            offset = 0
            for s, p in zip(self.start, self.params):
                s.sub_(flat[offset:offset + s.numel()].view_as(s), alpha=self.outer_lr)
                p.copy_(s)
                offset += s.numel()
        self.syncs += 1

    def record(self) -> dict:
        return {"sync_interval": self.every, "syncs": self.syncs, "wire_bits": self.wire_bits}


class PseudoGradientFrontEnd(DDPFrontEnd):
    """``--sync sparseloco`` / ``--sync signloco``: the inner optimizer stepped locally, a
    round (``PseudoGradientRounds``) when due; evaluation sees the model of the last round."""

    def __init__(self, device_type: str, sync: str, every: int, ef_decay: float, outer_lr: float,
                 density: float, chunk: int, bits: int) -> None:
        super().__init__(device_type)
        self.name = self.sync = sync
        self.every, self.ef_decay, self.outer_lr = every, ef_decay, outer_lr
        if sync == "sparseloco":
            self.message = lambda e: (*chunked_topk(e, density, chunk, bits),
                                      chunked_topk_bits(e.numel(), density, chunk, bits))
            self.label = (f"torchrun, SparseLoCo (sync_every={every}, TopK {density:g} of chunks of {chunk}, "
                          f"{bits}-bit values, error feedback decay {ef_decay:g}, outer lr {outer_lr:g})")
        else:
            self.message = lambda e: (scaled_sign(e), torch.ones_like(e), e.numel() + 32)
            self.label = f"torchrun, sign pseudo-gradients (sync_every={every}, error feedback, outer lr {outer_lr:g})"
        self.rounds = None

    def wrap(self, model, opt, compression, device):
        broadcast_model(model, self.dist)
        self.rounds = PseudoGradientRounds(model, self.dist, self.message, self.every, self.ef_decay, self.outer_lr)
        return model, opt

    def step(self, opt, compression) -> None:
        opt.step()
        self.rounds.step()
        compression.count(0, dense=self.rounds.numel)

    def evaluating(self):
        return swapped_in(self.rounds.params, self.rounds.start)  # the last round's model, the same on every rank

    def settle(self) -> None:
        pass

    def record(self) -> dict:
        return self.rounds.record()


class OneBitAdamFrontEnd(DDPFrontEnd):
    """``--sync onebit-adam``: 1-bit Adam over the user's AdamW (its betas, eps, weight decay
    and learning rate schedule): ``freeze_step`` synchronous steps, then the frozen second
    moment and the momentum exchanged in 1 bit with error feedback on both sides."""

    name = sync = "onebit-adam"

    def __init__(self, device_type: str, freeze_step: int) -> None:
        super().__init__(device_type)
        self.freeze_step = freeze_step
        self.label = f"torchrun, 1-bit Adam (freeze_step={freeze_step}, plain torch)"
        self.steps = self.wire_bits = 0
        self.params, self.worker_error, self.server_error, self.denom = [], [], [], []

    def wrap(self, model, opt, compression, device):
        if not isinstance(opt, torch.optim.AdamW):
            raise SystemExit("--sync onebit-adam is 1-bit Adam: it needs --optimizer adamw")
        broadcast_model(model, self.dist)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        return model, opt

    def step(self, opt, compression) -> None:
        self.steps += 1
        compression.count(0, dense=self.numel)
        with torch.no_grad():
            if self.steps <= self.freeze_step:
                self.average_gradients()
                opt.step()
                return
            group = opt.param_groups[0]
            beta1, _ = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            if not self.denom:  # the freeze: AdamW's second moment, bias-corrected once, from now on fixed
                for p in self.params:
                    state = opt.state[p]
                    t = float(state["step"])
                    self.denom.append(self.frozen_denominator(state["exp_avg_sq"] / (1 - group["betas"][1] ** t), eps))
                    state["exp_avg"].div_(1 - beta1 ** t)  # bias-corrected, the momentum the exchange carries
                    self.worker_error.append(torch.zeros_like(p))
                    self.server_error.append(torch.zeros_like(p))
            momenta = [opt.state[p]["exp_avg"] for p in self.params]
            for p, m in zip(self.params, momenta):
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
            for p, m, avg, denom in zip(self.params, momenta, self.compressed_average(momenta), self.denom):
                m.copy_(avg)
                p.mul_(1 - lr * wd).addcdiv_(m, denom, value=-lr)

    def compressed_average(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """DeepSpeed's ``compressed_allreduce``, decoded: each rank's ``x`` plus its worker error
        sent as ``rms_sign`` (tensors of fewer than 2 dimensions as they are), the messages
        averaged, the average plus the server error compressed again; the same on every rank."""
        sent = []
        for p, x, we in zip(self.params, xs, self.worker_error):
            x = x + we
            msg = rms_sign(x) if _compressible(p) else x.clone()
            we.copy_(x - msg)
            sent.append(msg.reshape(-1))
            self.wire_bits += (p.numel() + 32) if _compressible(p) else 16 * p.numel()
        flat = torch.cat(sent)
        self.dist.all_reduce(flat)
        flat /= self.size
        out, offset = [], 0
        for p, se in zip(self.params, self.server_error):
            y = flat[offset:offset + p.numel()].view_as(p) + se
            offset += p.numel()
            msg = rms_sign(y) if _compressible(p) else y.clone()
            se.copy_(y - msg)
            out.append(msg)
        return out

    def frozen_denominator(self, v: torch.Tensor, eps: float) -> torch.Tensor:
        """What the momentum is divided by from the freeze on: AdamW's, sqrt(v) + eps."""
        return v.sqrt().add_(eps)

    def average_gradients(self) -> None:
        """A synchronous step's exchange: the gradients averaged (counted in 16 bits)."""
        self.average_into_gradients([p.grad.reshape(-1) for p in self.params])
        self.wire_bits += 16 * self.numel

    def average_into_gradients(self, sent: list[torch.Tensor]) -> None:
        """Every parameter's gradient set to the ranks' mean of its flat message in ``sent``."""
        flat = torch.cat(sent)
        self.dist.all_reduce(flat)
        flat /= self.size
        offset = 0
        for p in self.params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def record(self) -> dict:
        return {"sync_interval": 1, "syncs": self.steps, "wire_bits": self.wire_bits}
