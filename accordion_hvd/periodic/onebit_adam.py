"""``acc.OneBitAdam``: Adam and AdamW over a slow link, about 1 bit per parameter per step.

    dist.init_process_group("gloo")          # torchrun (or hvd.init() under horovodrun)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    opt = acc.OneBitAdam(model, opt, freeze_step=1000)   # the one line; the model not wrapped in DDP
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()                           # exchanges what it must and updates the model

1-bit Adam (Tang et al., ICML 2021; DeepSpeed's ``OnebitAdam``) in two stages, numbered by
``step()``:

1. **Warm-up** (steps 1 to ``freeze_step``): the gradients averaged over the ranks through
   ``warmup`` (by default the per-step default's codec, 8-bit sparse chunks with error
   feedback: ``Compressor(Quantize(8, skip_energy=0.05), policy="static")``), then the
   user's optimizer steps as it would under DDP. Published 1-bit Adam sends these steps
   uncompressed; on a slow link they would cost more than the rest of training.
2. **Frozen variance** (every step after): Adam's second moment is frozen as the optimizer
   had it (bias-corrected once), and each step every rank's momentum ``m = beta1 m + (1 -
   beta1) g`` (its own gradient) goes through ``compressor`` (by default ``acc.codecs.Sign()``:
   1 bit per entry and a scale, error feedback on the worker and the server side,
   codecs/sign.py); what comes back is the momentum, the same on every rank, and the update
   is AdamW's with the frozen denominator: ``p -= lr * (m / (sqrt(v) + eps) + wd * p)``.
   Entries whose frozen second moment is exactly zero (never a gradient, or never sent by
   the warm-up's sparse chunks) are not moved: 1-bit Adam would move them by the layer's
   RMS over ``eps``.

**The update clipped** (``max_update``, 3 by default: our change to 1-bit Adam). Adam's own
step of an entry, ``m / sqrt(v)``, rarely exceeds 1 (in units of the learning rate), because
``v`` grows with the gradients that make ``m``. Frozen, ``v`` cannot grow, and a 1-bit message
gives every entry of a layer the layer's RMS: an entry whose frozen ``v`` is small (a unit
that was quiet during the warm-up, a row the sparse chunks rarely sent) then steps by that
RMS over its small ``sqrt(v)``, and a short warm-up diverged within a few steps. Clipping each
entry's update to ``max_update`` restores Adam's trust region; at 3 it barely binds where
the freeze was safe, while a clip at 1 cost quality (docs/api.md gives the runs).

The learning rate, betas, eps and weight decay are read from the optimizer's param groups
at every step (a learning-rate scheduler on it works as usual). ``torch.optim.Adam`` with
weight decay adds it to the gradient (L2), as Adam does; AdamW decouples it.

What the stages cost and what they reached on issue 80's pilot (a 1.4M-parameter
transformer, 2 ranks) is in docs/api.md, with the commands; how long the warm-up must be is
the caller's ``freeze_step`` (published: 15-25% of training; the pilot froze at 10%).

Communication: ``bind_to_job`` (job.py): under torchrun new process groups of every rank
(made at construction, on every rank in the same order); under horovodrun Horovod's world.
Every rank must start from the same parameters (checked at construction).
"""

from __future__ import annotations

import io
import logging
import math
import numbers

import torch

from ..buffered_step import BufferedStep
from ..codecs import Quantize, Sign
from ..comm.channel import collective_timeout
from ..compressor import Compressor
from .checks import agree_start
from .job import bind_to_job

log = logging.getLogger("accordion_hvd.onebit_adam")

FORMAT = "accordion-onebit-adam/1"


class OneBitAdam:
    """Args:
        model: a plain ``torch.nn.Module`` (not wrapped in DDP), the same parameters on every
            rank at construction.
        optimizer: a ``torch.optim.AdamW`` or ``torch.optim.Adam`` over exactly the model's
            trainable parameters (not amsgrad, not maximize).
        freeze_step: warm-up steps before the second moment freezes (a positive integer).
        warmup: the compressor of the warm-up's gradients (module doc); not bound elsewhere.
        compressor: the compressor of the frozen stage's momentum (module doc).
        max_update: the frozen stage's update of an entry, ``m / (sqrt(v) + eps)``, clipped to
            this (in units of the learning rate; None: not clipped) (module doc).
        timeout: seconds a collective may take; default $ACCORDION_COLLECTIVE_TIMEOUT, else 300.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, freeze_step: int,
                 warmup: Compressor | None = None, compressor: Compressor | None = None,
                 max_update: float | None = 3.0, timeout: float | None = None) -> None:
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel):
            raise TypeError("model must not be wrapped in DistributedDataParallel: OneBitAdam exchanges the "
                            "gradients itself; pass the plain module")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
            raise TypeError(f"optimizer must be a torch.optim.AdamW or torch.optim.Adam (OneBitAdam freezes its "
                            f"second moment), got {type(optimizer).__name__}")
        for group in optimizer.param_groups:
            for flag in ("amsgrad", "maximize"):
                if group.get(flag):
                    raise ValueError(f"optimizer: OneBitAdam does not support {flag}=True")
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, numbers.Integral) or freeze_step < 1:
            raise ValueError(f"freeze_step must be a positive integer (warm-up steps before the second moment "
                             f"freezes), got {freeze_step!r}")
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if optimized != {id(p) for _, p in self.params}:
            raise ValueError("optimizer must optimize exactly the model's trainable parameters "
                             f"({len(self.params)}); it has {len(optimized)}, not all of the model's")
        self.warmup = Compressor(Quantize(8, skip_energy=0.05), policy="static") if warmup is None else warmup
        self.compressor = Compressor(Sign(), policy="static") if compressor is None else compressor
        for name, value in (("warmup", self.warmup), ("compressor", self.compressor)):
            if not isinstance(value, Compressor):
                raise TypeError(f"{name} must be an acc.Compressor (or acc.AccordionCompressor), got {type(value).__name__}")
        if self.warmup is self.compressor:
            raise ValueError("warmup and compressor must be two compressors: each keeps its own error feedback")
        self.optimizer, self.freeze_step = optimizer, int(freeze_step)
        if max_update is not None and (isinstance(max_update, bool) or not isinstance(max_update, numbers.Real)
                                       or not max_update > 0):
            raise ValueError(f"max_update must be a positive number or None, got {max_update!r}")
        self.max_update = None if max_update is None else float(max_update)
        self.group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        # compared across ranks with the compressor's settings, at the first step
        settings = {
            "onebit_adam_freeze_step": self.freeze_step, "onebit_adam_max_update": self.max_update,
            "onebit_adam_optimizer": type(optimizer).__name__,
            "onebit_adam_groups": [[list(group["betas"]), group["eps"], group["weight_decay"], group["lr"]]
                                   for group in optimizer.param_groups]}
        timeout = collective_timeout(timeout)
        device_type = self.params[0][1].device.type
        self.size = bind_to_job(self.warmup, model, optimizer, device_type, timeout, "OneBitAdam", settings=settings)
        bind_to_job(self.compressor, model, optimizer, device_type, timeout, "OneBitAdam")
        agree_start(self.params, [p for _, p in self.params], None, self.warmup.control, who="OneBitAdam")
        self.warm_round = BufferedStep(self.warmup.engine, "acc.onebit.warmup")
        self.round = BufferedStep(self.compressor.engine, "acc.onebit")
        self.steps = 0
        self.skipped = 0
        self.momentum: list[torch.Tensor] | None = None  # from the freeze on: the shared momentum
        self.denom: list[torch.Tensor] | None = None     # and the frozen sqrt(v) + eps

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict]:
        """The optimizer's (their learning rates are read at every step)."""
        return self.optimizer.param_groups

    @property
    def frozen(self) -> bool:
        """Whether the second moment has frozen (the next steps exchange the momentum)."""
        return self.momentum is not None

    @torch.no_grad()
    def step(self) -> bool:
        """One step, on every rank after ``backward()``: the warm-up's or the frozen stage's
        (module doc). Returns False when it was skipped on every rank (some rank's gradient
        was not finite: nothing changes but the error feedback, which keeps it)."""
        self.steps += 1
        if self.steps <= self.freeze_step:
            return self._warmup_step()
        if self.momentum is None:
            self._freeze()
        return self._frozen_step()

    def _gradient(self, p: torch.Tensor) -> torch.Tensor:
        return p.grad if p.grad is not None else torch.zeros_like(p)  # (a parameter unused this step, alike)

    def _warmup_step(self) -> bool:
        for name, p in self.params:
            self.warm_round.add(name, self._gradient(p).clone(), p, uncompressed_here=True)
        self.warm_round.send("grad")
        results, _ = self.warm_round.finish()
        if self.warmup.step_skipped:
            return self._skipped()
        for p, average in results:
            p.grad = average.view_as(p).to(p.dtype)
        self.optimizer.step()
        return True

    def _freeze(self) -> None:
        """The optimizer's moments, bias-corrected, become the frozen stage's (ours from now on)."""
        self.momentum, self.denom = [], []
        for _, p in self.params:
            group, state = self.group_of[id(p)], self.optimizer.state.get(p, {})
            beta1, beta2 = group["betas"]
            t = float(state["step"]) if "step" in state else 0.0
            if t == 0:  # (every warm-up step skipped): nothing known; the entries will not move
                m, v = torch.zeros_like(p, dtype=torch.float32), torch.zeros_like(p, dtype=torch.float32)
            else:
                m = state["exp_avg"].float() / (1 - beta1 ** t)
                v = state["exp_avg_sq"].float() / (1 - beta2 ** t)
            self.momentum.append(m)
            self.denom.append(v.sqrt().add_(group["eps"]).masked_fill_(v == 0, math.inf))
        log.info("OneBitAdam: the second moment froze after step %d; the momentum goes in 1 bit from now on",
                 self.steps - 1)

    def _frozen_step(self) -> bool:
        for (name, p), m in zip(self.params, self.momentum):
            group = self.group_of[id(p)]
            beta1 = group["betas"][0]
            g = self._gradient(p).float()
            if group["weight_decay"] and not self._decoupled(group):
                g = g.add(p.float(), alpha=group["weight_decay"])  # Adam's L2
            self.round.add(name, m * beta1 + g * (1 - beta1), m, uncompressed_here=True)
        self.round.send("momentum")
        results, _ = self.round.finish()
        if self.compressor.step_skipped:
            return self._skipped()
        for (_, p), (m, average), denom in zip(self.params, results, self.denom):
            group = self.group_of[id(p)]
            m.copy_(average.view_as(m))
            update = m / denom
            if self.max_update is not None:  # Adam's own bound (module doc)
                update.clamp_(-self.max_update, self.max_update)
            if group["weight_decay"] and self._decoupled(group):
                p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(update.to(p.dtype), alpha=-group["lr"])
        return True

    def _decoupled(self, group: dict) -> bool:
        return isinstance(self.optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))

    def _skipped(self) -> bool:
        self.skipped += 1
        log.warning("OneBitAdam: step %d skipped on every rank (a gradient was not finite)", self.steps)
        return False

    def stats(self) -> dict:
        """What crossed the wire from this rank so far: bytes of both stages' compressors and
        what 32-bit dense steps would have sent, and bits per parameter per step."""
        warm, frozen = self.warmup.stats(), self.compressor.stats()
        sent = warm["bytes_sent"] + frozen["bytes_sent"]
        numel = sum(p.numel() for _, p in self.params)
        return {"steps": self.steps, "freeze_step": self.freeze_step, "frozen": self.frozen,
                "skipped_steps": self.skipped, "bytes_sent": sent,
                "bytes_dense": warm["bytes_dense"] + frozen["bytes_dense"],
                "bits_per_parameter_per_step": 8 * sent / (numel * self.steps) if self.steps else 0.0}

    # --- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What resumes training bit for bit on the same world: the optimizer's state, the
        frozen stage's momentum and denominator, the step count, both compressors' state
        (their error feedback: this rank's). Call it between steps, on every rank. Its form
        suits ``torch.save`` (one file per rank) and ``torch.distributed.checkpoint`` alike
        (``dcp.save({"model": ..., "optim": opt})``): this rank's state serialized under a key
        of its rank, as ``compress_hsdp``'s hook keeps its own, since DCP would keep one copy
        of a tensor every rank names alike, and the error feedback differs."""
        plain = {"steps": self.steps, "freeze_step": self.freeze_step, "skipped": self.skipped,
                 "optimizer": self.optimizer.state_dict(), "momentum": self.momentum, "denom": self.denom,
                 "warmup": self.warmup.state_dict(), "compressor": self.compressor.state_dict()}
        buffer = io.BytesIO()
        torch.save(plain, buffer)
        return {"accordion.onebit_adam": FORMAT, "accordion.onebit_adam.world": self.size,
                self._rank_key: buffer.getvalue()}

    @property
    def _rank_key(self) -> str:
        return f"accordion.onebit_adam.rank{self.warmup.control.rank}"

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict()`` (on every rank, each its own) of a job with as many ranks."""
        if not isinstance(state, dict) or state.get("accordion.onebit_adam") != FORMAT:
            raise ValueError(f"state is not a OneBitAdam state_dict (format {FORMAT!r})")
        if state.get("accordion.onebit_adam.world") != self.size or not isinstance(state.get(self._rank_key), bytes):
            raise ValueError(f"state was saved by a job of {state.get('accordion.onebit_adam.world')} ranks, without "
                             f"this rank's part ({self._rank_key}); this job has {self.size}")
        plain = torch.load(io.BytesIO(state[self._rank_key]), map_location=self.params[0][1].device,
                           weights_only=True)
        if plain["freeze_step"] != self.freeze_step:
            raise ValueError(f"state was saved with freeze_step={plain['freeze_step']}, this OneBitAdam has "
                             f"freeze_step={self.freeze_step}")
        frozen = plain["momentum"]
        if frozen is not None and (len(frozen) != len(self.params) or any(
                m.shape != p.shape for m, (_, p) in zip(frozen, self.params))):
            raise ValueError("state's momentum does not fit this model's trainable parameters")
        self.warmup.load_state_dict(plain["warmup"])
        self.compressor.load_state_dict(plain["compressor"])
        self.optimizer.load_state_dict(plain["optimizer"])
        self.steps, self.skipped = int(plain["steps"]), int(plain["skipped"])
        self.momentum, self.denom = frozen, plain["denom"]


__all__ = ["OneBitAdam"]
