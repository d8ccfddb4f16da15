"""Issue 80's pilot variant of 1-bit Adam (``--sync onebit-adam --variance-every N``): no
synchronous warm-up at all. 1-bit Adam (published.py) spends its first ``freeze_step`` steps
uncompressed so that Adam's second moment can settle before it freezes; at 10 Mbit/s those
steps alone cost more than the rest of the run. Here:

- the second moment the update divides by is the ranks' *own* second moments (each from its
  own gradients, which need no exchange), averaged over the ranks at steps 1, 2, 4, 8, ... and
  then every ``variance_every`` steps: the same on every rank between refreshes, so the
  replicas stay identical. An average of the ranks' own second moments counts the gradient
  noise the average gradient would have halved (2 ranks), so steps are a little shorter where
  noise dominates;
- every step, the momentum *divided by that shared denominator* (the update's own units) is
  exchanged in 1 bit with error feedback, and the ranks' average is compressed again with
  error feedback of its own, as DeepSpeed's server side does (here every rank computes it
  alike). That second compression mattered in the pilots (an exact average of the ranks'
  messages stalled; why is not established: one guess is that the momentum is *replaced*
  by what the exchange returns, and an exact average of signs is small wherever the ranks
  disagree). In gradient units, as published, a 1-bit message gives every entry its
  tensor's RMS, and an entry with a small second moment then moves by RMS over its small
  denominator: without a warm-up that diverged at once. The figures are in
  benchmarks/results/explore-v5/README.md;
- entries whose averaged second moment is exactly zero (a unit that never had a gradient)
  are not moved.

Wire: 1 bit per entry and a 32-bit scale per 2-D tensor (others in 16 bits) every step, and
each refresh of the second moment in 16 bits per entry."""

from __future__ import annotations

import torch

from .published import OneBitAdamFrontEnd, _compressible


class SharedVarianceOneBitAdamFrontEnd(OneBitAdamFrontEnd):
    """1-bit momentum from the first step; the second moment averaged over the ranks on a
    doubling schedule that stops doubling at ``variance_every``."""

    def __init__(self, device_type: str, variance_every: int) -> None:
        super().__init__(device_type, freeze_step=0)
        self.variance_every = variance_every
        self.label = (f"torchrun, 1-bit Adam without warm-up, second moment averaged at steps 1, 2, 4, ... then every "
                      f"{variance_every} (issue 80 pilot, plain torch)")
        self.next_refresh, self.gap, self.refreshes = 1, 1, 0
        self.own_sq, self.momentum = [], []

    def step(self, opt, compression) -> None:
        self.steps += 1
        t = self.steps
        compression.count(0, dense=self.numel)
        group = opt.param_groups[0]
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        with torch.no_grad():
            if not self.own_sq:
                for p in self.params:
                    self.own_sq.append(torch.zeros_like(p))
                    self.momentum.append(torch.zeros_like(p))
                    self.worker_error.append(torch.zeros_like(p))
                    self.server_error.append(torch.zeros_like(p))
                    self.denom.append(torch.ones_like(p))
            for p, sq in zip(self.params, self.own_sq):
                sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            if t == self.next_refresh:
                self._refresh_variance(1 - beta2 ** t, eps)
            for p, m in zip(self.params, self.momentum):
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
            whitened = [m / denom for m, denom in zip(self.momentum, self.denom)]  # the update's own units
            for p, m, avg, denom in zip(self.params, self.momentum, self.compressed_average(whitened), self.denom):
                m.copy_(torch.nan_to_num(avg * denom, posinf=0.0))  # the shared momentum, back in gradient units
                p.mul_(1 - lr * wd).add_(avg, alpha=-lr / (1 - beta1 ** t))

    def _refresh_variance(self, bias_correction: float, eps: float) -> None:
        flat = torch.cat([sq.reshape(-1) for sq in self.own_sq])
        self.dist.all_reduce(flat)
        flat /= self.size
        offset = 0
        for sq, denom, we, se in zip(self.own_sq, self.denom, self.worker_error, self.server_error):
            v = flat[offset:offset + sq.numel()].view_as(sq)
            offset += sq.numel()
            fresh = (v / bias_correction).sqrt_().add_(eps).masked_fill_(v == 0, float("inf"))  # no gradient: no move
            for error in (we, se):  # the errors carried into the new units
                error.mul_(denom / fresh).nan_to_num_(nan=0.0, posinf=0.0)
            denom.copy_(fresh)
        self.wire_bits += 16 * self.numel
        self.refreshes += 1
        self.gap = min(2 * self.gap, self.variance_every) if self.refreshes > 1 else 1
        self.next_refresh = self.steps + self.gap

    def record(self) -> dict:
        return {**super().record(), "variance_refreshes": self.refreshes}


def sparse_chunks_8bit(g: torch.Tensor, chunk: int = 512, skip_energy: float = 0.05) -> tuple[torch.Tensor, int]:
    """The per-step default's message (Quantize(8, skip_energy=0.05), codecs/quantize_chunks.py),
    decoded, and its size in bits: of ``g``'s chunks of ``chunk`` entries, the fewest of largest
    energy holding ``1 - skip_energy`` of it, each quantized to 8 bits with its max-abs scale
    (nearest); 8 bits per entry, a 32-bit scale and a 32-bit index per chunk sent. Unlike the
    codec, the number of chunks is this step's own (the codec's is the last step's)."""
    flat = g.reshape(-1)
    n = flat.numel()
    rows = torch.cat([flat, flat.new_zeros((-n) % chunk)]).view(-1, chunk)
    energy = rows.double().square().sum(1)
    order = energy.argsort(descending=True)
    held = energy[order].cumsum(0)
    k = min(rows.shape[0], 1 + int((held < (1 - skip_energy) * held[-1]).sum()))
    kept = order[:k]
    scale = rows[kept].abs().amax(1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(rows[kept] / scale.clamp_min(1e-38)), torch.zeros_like(rows[kept]))
    out = torch.zeros_like(rows)
    out[kept] = q * scale
    return out.view(-1)[:n].view_as(g), k * (8 * chunk + 64)


class Quantized8WarmupOneBitAdamFrontEnd(OneBitAdamFrontEnd):
    """1-bit Adam whose synchronous warm-up sends the per-step default's 8-bit sparse chunks
    (with error feedback) instead of 16-bit gradients: ``--sync onebit-adam --freeze-step N
    --warmup-bits 8`` (issue 80 pilot)."""

    def __init__(self, device_type: str, freeze_step: int) -> None:
        super().__init__(device_type, freeze_step)
        self.label = (f"torchrun, 1-bit Adam (freeze_step={freeze_step}), its warm-up in 8-bit sparse chunks "
                      f"(issue 80 pilot, plain torch)")
        self.residual = None

    def frozen_denominator(self, v: torch.Tensor, eps: float) -> torch.Tensor:
        # Entries the sparse chunks never sent have v = 0, and 1-bit Adam would move them by
        # the tensor's RMS over eps (an early freeze diverged: benchmarks/results/explore-v5/README.md).
        return v.sqrt().add_(eps).masked_fill_(v == 0, float("inf"))

    def average_gradients(self) -> None:
        if self.residual is None:
            self.residual = [torch.zeros_like(p) for p in self.params]
        sent = []
        for p, e in zip(self.params, self.residual):
            if _compressible(p) and p.numel() >= 1024:  # Quantize's min_numel
                e.add_(p.grad)
                msg, bits = sparse_chunks_8bit(e)
                e.sub_(msg)
            else:
                msg, bits = p.grad.clone(), 16 * p.numel()
            sent.append(msg.reshape(-1))
            self.wire_bits += bits
        self.average_into_gradients(sent)
