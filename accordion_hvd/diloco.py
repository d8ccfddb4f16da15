"""``acc.DiLoCo``: local training with periodic, compressed synchronisation.

    dist.init_process_group("gloo")          # torchrun; every rank starts from the same model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    diloco = acc.DiLoCo(model, opt)          # sync_every="auto"; or a fixed number of inner steps
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()                           # an inner step: local, no communication
        diloco.step()                        # when a round is due: one round (below)
    with diloco.synced():                    # evaluate the model of the last round, alike on every rank
        evaluate(model)

DiLoCo (Douillard et al., 2023): every rank trains its own copy for ``sync_every`` inner
steps; then, in one **round**, the ranks average their *pseudo-gradients* (the parameters at
the start of the round minus their own now) and an outer optimizer (SGD with Nesterov
momentum, lr 0.7, momentum 0.9: the paper's) updates the start-of-round parameters with that
average, identically on every rank; every rank's model continues from them. With
``outer_lr=1, outer_momentum=0`` it is plain local SGD (model averaging).

What crosses the network is the per-step path's: each parameter's pseudo-gradient is a layer
of the compressor (``acc.AccordionCompressor``, by default ``acc.AccordionCompressor()``),
with its codec, error feedback (what a round did not send goes into the next round's),
kernels, non-finite skip and statistics; one round is one step of the compressor's engine.
A round whose pseudo-gradient is not finite on some rank is skipped on every rank: no outer
step, and every rank returns to the start-of-round parameters.

``sync_every="auto"`` chooses the interval per window of inner steps (policies/interval.py,
``acc.SyncInterval``): the lowest rung the link affords (1, a round every step, on a fast
one) in critical regimes (the start, a learning-rate decay, a window whose gradient norm
moved by eta), one rung up (4, 16, 64) while training stays calm. The window's statistics
are each rank's squared gradient norm at every inner step, summed on the device (no host
sync), and the wall times of its inner steps and rounds, reduced once per window on the
control plane, so every rank chooses the same interval. A round at interval 1
is the per-step path: the plain average of the ranks' models (an outer step of lr 1, no
momentum: the outer momentum, a memory of long rounds' pseudo-gradients, is left as it is).

Communication: process groups of the job's ranks made at construction (every rank constructs
it, in the same order): one for the data with the default group's backend and lanes for
PowerSGD's Q rounds and the uncompressed layers, and a Gloo one for control, as the DDP front
end's (accordion_hvd/ddp.py). The inner optimizer's state (AdamW's moments) stays each rank's
own, as in the paper.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import numbers
import statistics
import time

import numpy as np
import torch

from .comm.channel import collective_timeout
from .buffered_step import BufferedStep
from .comm.control import new_control_plane
from .comm.process_group import new_channel
from .compressor import Compressor
from .policies import IntervalReport, SyncInterval

log = logging.getLogger("accordion_hvd.diloco")


class DiLoCo:
    """Args:
        model: a plain ``torch.nn.Module`` (not wrapped in DDP, which would average every
            step), the same parameters on every rank at construction.
        inner_optimizer: the optimizer the user steps every inner step, over exactly the
            model's trainable parameters.
        compressor: an ``acc.AccordionCompressor`` (or ``Compressor``) not bound to another
            model; default: ``acc.AccordionCompressor()``'s configuration.
        sync_every: inner steps per round: a positive integer, "auto" (``acc.SyncInterval()``,
            module doc) or an ``acc.SyncInterval`` with its own ladder.
        outer_lr: the outer optimizer's learning rate (positive).
        outer_momentum: its momentum, in [0, 1).
        nesterov: Nesterov momentum (with ``outer_momentum > 0``).
        timeout: seconds a collective may take; default $ACCORDION_COLLECTIVE_TIMEOUT, else 300.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 compressor: Compressor | None = None, *, sync_every: int | str | SyncInterval = "auto", outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True, timeout: float | None = None) -> None:
        from torch.nn.parallel import DistributedDataParallel

        _check_arguments(sync_every, outer_lr, outer_momentum)
        self.policy = (SyncInterval() if sync_every == "auto" else sync_every
                       if isinstance(sync_every, SyncInterval) else None)
        if isinstance(model, DistributedDataParallel):
            raise TypeError("model must not be wrapped in DistributedDataParallel: DDP averages the gradients every "
                            "step, DiLoCo synchronises every sync_every steps; pass the plain module")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        optimized = {id(p) for group in inner_optimizer.param_groups for p in group["params"]}
        if optimized != {id(p) for _, p in self.params}:
            raise ValueError("inner_optimizer must optimize exactly the model's trainable parameters "
                             f"({len(self.params)}); it has {len(optimized)}, not all of the model's")
        self.compressor = Compressor() if compressor is None else compressor
        if not isinstance(self.compressor, Compressor):
            raise TypeError(f"compressor must be an acc.AccordionCompressor, got {type(self.compressor).__name__}")
        self.outer_lr, self.outer_momentum = float(outer_lr), float(outer_momentum)
        self.nesterov = bool(nesterov) and self.outer_momentum > 0
        self.interval = self.policy.interval if self.policy is not None else int(sync_every)  # inner steps per round now
        self.inner = inner_optimizer
        # compared across ranks with the compressor's settings, at the first round
        self.compressor.engine.front_end = {
            "diloco_sync_every": repr(self.policy) if self.policy is not None else self.interval,
            "diloco_outer_lr": self.outer_lr, "diloco_outer_momentum": self.outer_momentum,
            "diloco_nesterov": self.nesterov}
        self.size = self._bind(model, inner_optimizer, collective_timeout(timeout))
        self.control = self.compressor.engine.control
        self.round = BufferedStep(self.compressor.engine, "acc.diloco")  # one round: one step of it
        self._agree_start()
        # The start-of-round parameters, in float32: what the outer optimizer updates.
        self.start = [p.detach().clone().float() for _, p in self.params]
        self.outer = torch.optim.SGD(self.start, lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.nesterov)
        self.inner_steps = 0
        self.since_sync = 0  # inner steps since the last round
        self.syncs = 0
        self.skipped = 0
        self.window = None if self.policy is None else WindowStatistic(self.params, inner_optimizer)

    def _bind(self, model, optimizer, timeout: float) -> int:
        """The compressor bound to the job's planes; returns the number of ranks. Under
        torchrun new process groups of every rank (made in the same order on every rank),
        as the DDP front end's; under horovodrun the compressor's default planes over
        Horovod's world (comm/planes.py), as under ``hvd.DistributedOptimizer``."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            ranks = list(range(dist.get_world_size()))
            channel = new_channel(ranks, timeout, dist.get_backend(), lanes=("q", "dense"))
            self.compressor.bind(model, channel=channel, control=new_control_plane(ranks, timeout),
                                 optimizer=optimizer)
            return len(ranks)
        size = _horovod_size()
        if size is None:
            raise RuntimeError("DiLoCo needs torch.distributed initialized (dist.init_process_group, under torchrun) "
                               "or Horovod (hvd.init(), under horovodrun)")
        self.compressor.engine.planes.device_type = self.params[0][1].device.type  # picks the default data plane
        self.compressor.bind(model, channel=None, control=None, optimizer=optimizer)
        return size

    def step(self) -> bool:
        """Count one inner step; when a round is due, run it. Returns whether one ran. Call it
        on every rank after each step of the inner optimizer (its gradients still there)."""
        started = time.perf_counter()
        self.inner_steps += 1
        self.since_sync += 1
        if self.window is not None:
            self.window.observe(started)
        due = self.since_sync >= self.interval
        if due:
            self.sync()
        else:  # stats(): floats_dense is what per-step dense training would have sent by now
            self.compressor.count_local_step(self.params)
            if self.window is not None:
                self.window.round_took(time.perf_counter() - started)
        if self.window is not None and self.inner_steps % self.policy.window == 0:  # always after a round
            before, self.interval = self.interval, self.policy.end_window(self.window.report(self.control, self.size))
            if self.interval != before:
                log.info("DiLoCo: from inner step %d, a round every %d inner step%s (was %d)", self.inner_steps,
                         self.interval, "" if self.interval == 1 else "s", before)
        if self.window is not None:
            self.window.step_ended()
        return due

    def synced(self):
        """The model of the last round (the same on every rank) in place of this rank's local
        one while the block runs (to evaluate it); the local parameters come back after."""
        return swapped_in([param for _, param in self.params], self.start)

    @torch.no_grad()
    def sync(self) -> None:
        """One round, on every rank: average the pseudo-gradients through the compressor,
        take the outer step, and set every rank's model to its result (module doc)."""
        for (name, param), start in zip(self.params, self.start):
            self.round.add(name, start - param.detach().float(), start, uncompressed_here=True)
        self.round.send("round")  # the layers sent whole this round (16-bit dense), one average per dtype
        results, _ = self.round.finish()
        self.syncs += 1
        self.since_sync = 0
        if self.compressor.step_skipped:  # some rank's pseudo-gradient was not finite: the same on every rank
            self.skipped += 1
            log.warning("DiLoCo: round %d skipped on every rank (a pseudo-gradient was not finite); every rank "
                        "returns to the round's start", self.syncs)
        else:
            for start, average in results:
                start.grad = average.view_as(start)
            if self.policy is not None and self.interval == 1:  # the per-step path: the plain average
                torch._foreach_sub_(self.start, [start.grad for start in self.start])
            else:
                self.outer.step()
        for (_, param), start in zip(self.params, self.start):
            param.copy_(start)

    def _agree_start(self) -> None:
        """Every rank starts from the same parameters, or every rank refuses: a digest of them,
        its bytes reduced by max and by min on the control plane (equal only if every rank's is)."""
        digest = hashlib.sha256()
        for name, param in self.params:
            digest.update(name.encode())
            digest.update(param.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        mine = np.frombuffer(digest.digest(), dtype=np.uint8).astype(np.float64)
        high = self.control.allreduce(mine, "acc.diloco.start.max", op="max")
        low = self.control.allreduce(mine, "acc.diloco.start.min", op="min")
        if not np.array_equal(high, low):
            raise ValueError("DiLoCo: the model's parameters differ across ranks at the start; start every rank from "
                             "the same model (seed it alike, or broadcast rank 0's parameters first)")

    # --- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What resumes the outer loop bit for bit on the same world: the start-of-round
        parameters, the outer optimizer's momentum, the counters and the compressor's state
        (its error feedback: this rank's). Between inner steps."""
        return {"world": self.size, "inner_steps": self.inner_steps, "syncs": self.syncs,
                "skipped": self.skipped, "start": [t.clone() for t in self.start], "interval": self.interval,
                "since_sync": self.since_sync, "outer": self.outer.state_dict(),
                "compressor": self.compressor.state_dict(),
                **({} if self.policy is None else {"policy": self.policy.state_dict(),
                                                   "window": self.window.state_dict()})}

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict()``. From a job with another number of ranks the outer state
        restarts (momentum zero, the round starts from the model as loaded) with a warning."""
        self.compressor.load_state_dict(state["compressor"])
        self.inner_steps, self.syncs, self.skipped = state["inner_steps"], state["syncs"], state["skipped"]
        if (self.policy is None) != ("policy" not in state):
            raise ValueError("DiLoCo.load_state_dict: the state was saved with sync_every "
                             f"{'auto' if 'policy' in state else state['interval']}, this DiLoCo has "
                             f"{'auto' if self.policy is not None else self.interval}; resume with the same")
        self.interval, self.since_sync = state["interval"], state["since_sync"]
        if self.policy is not None:
            self.policy.load_state_dict(state["policy"])
            self.window.load_state_dict(state["window"])
        if state["world"] != self.size:
            log.warning("DiLoCo: the state was saved by %d ranks, this job has %d: the outer optimizer restarts "
                        "(momentum zero) from the model's parameters", state["world"], self.size)
            for start, (_, param) in zip(self.start, self.params):
                start.copy_(param.detach().float())
            return
        with torch.no_grad():
            for start, saved in zip(self.start, state["start"]):
                start.copy_(saved)
        self.outer.load_state_dict(state["outer"])


class WindowStatistic:
    """The interval policy's statistics over one window (module doc): this rank's squared
    gradient norm summed over the window's inner steps on the device, whether the inner
    optimizer's learning rate went down, and the wall time of each inner step (from the end
    of one ``step()`` call to the start of the next: the user's forward, backward and
    optimizer step) and of each round; reduced across ranks once per window."""

    def __init__(self, params: list[tuple], optimizer: torch.optim.Optimizer) -> None:
        self.params, self.optimizer = [p for _, p in params], optimizer
        self.lr = self._lr()
        self.ended: float | None = None  # when the last step() returned
        self._reset()

    def _reset(self) -> None:
        self.sum_sq: torch.Tensor | float = 0.0
        self.steps = 0
        self.lr_decreased = False
        self.step_s: list[float] = []
        self.round_s: list[float] = []

    def _lr(self) -> float:
        return min(float(group["lr"]) for group in self.optimizer.param_groups)

    @torch.no_grad()
    def observe(self, now: float) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            self.sum_sq = self.sum_sq + torch.stack(torch._foreach_norm(grads)).float().square().sum()
        self.steps += 1
        lr = self._lr()
        self.lr_decreased |= lr < self.lr
        self.lr = lr
        if self.ended is not None:  # (an evaluation between two steps is an outlier the median ignores)
            self.step_s.append(now - self.ended)

    def round_took(self, seconds: float) -> None:
        self.round_s.append(seconds)

    def step_ended(self) -> None:
        self.ended = time.perf_counter()

    def report(self, control, size: int) -> IntervalReport:
        """The window's report, the same on every rank (one control collective); resets."""
        step_s = statistics.median(self.step_s) if self.step_s else 0.0
        round_s = statistics.fmean(self.round_s) if self.round_s else 0.0
        mine = np.array([float(self.sum_sq) / max(self.steps, 1), float(self.lr_decreased),
                         step_s, float(bool(self.step_s)), round_s, float(bool(self.round_s))])
        total = control.allreduce(mine, "acc.diloco.window", op="sum")
        norm = math.sqrt(total[0] / size) if math.isfinite(total[0]) else math.nan
        report = IntervalReport(norm=norm, steps=self.steps, lr_decreased=bool(total[1] > 0),
                                step_s=total[2] / size if total[3] == size else None,
                                round_s=total[4] / size if total[5] == size else None)
        self._reset()
        return report

    def state_dict(self) -> dict:
        return {"sum_sq": float(self.sum_sq), "steps": self.steps, "lr": self.lr, "lr_decreased": self.lr_decreased,
                "step_s": list(self.step_s), "round_s": list(self.round_s)}

    def load_state_dict(self, state: dict) -> None:
        self.sum_sq, self.steps = state["sum_sq"], state["steps"]
        self.lr, self.lr_decreased = state["lr"], state["lr_decreased"]
        self.step_s, self.round_s = list(state["step_s"]), list(state["round_s"])


@contextlib.contextmanager
def swapped_in(params: list[torch.Tensor], values: list[torch.Tensor]):
    """``values`` in the parameters while the block runs; the parameters' own after it."""
    own = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, value in zip(params, values):
            p.copy_(value.view_as(p))
    try:
        yield
    finally:
        with torch.no_grad():
            for p, mine in zip(params, own):
                p.copy_(mine)


def _horovod_size() -> int | None:
    """Horovod's world size, if Horovod is initialized in this process."""
    try:
        import horovod.torch as hvd
    except ImportError:
        return None
    return hvd.size() if hvd.is_initialized() else None


def _check_arguments(sync_every, outer_lr, outer_momentum) -> None:
    if not (sync_every == "auto" or isinstance(sync_every, SyncInterval)) and (
            isinstance(sync_every, bool) or not isinstance(sync_every, numbers.Integral) or sync_every < 1):
        raise ValueError(f"sync_every must be a positive integer (inner steps per round), \"auto\" or an "
                         f"acc.SyncInterval, got {sync_every!r}")
    if isinstance(outer_lr, bool) or not isinstance(outer_lr, numbers.Real) or not outer_lr > 0:
        raise ValueError(f"outer_lr must be a positive number, got {outer_lr!r}")
    if isinstance(outer_momentum, bool) or not isinstance(outer_momentum, numbers.Real) \
            or not 0 <= outer_momentum < 1:
        raise ValueError(f"outer_momentum must be a number in [0, 1), got {outer_momentum!r}")


__all__ = ["DiLoCo"]
