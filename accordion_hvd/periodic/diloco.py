"""``acc.DiLoCo``: local training with periodic, compressed synchronisation.

    dist.init_process_group("gloo")          # torchrun; every rank starts from the same model
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # AdamW: docs/api.md, when DiLoCo
    diloco = acc.DiLoCo(model, opt)          # sync_every="auto"; or a fixed number of inner steps
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()                           # an inner step: local, no communication
        diloco.step()                        # when a round is due: one round (below)
    diloco.flush()                           # (with overlap=True: the round in flight lands; every rank)
    with diloco.synced():                    # evaluate the model of the last round, alike on every rank
        evaluate(model)

DiLoCo (Douillard et al., 2023): every rank trains its own copy for ``sync_every`` inner
steps; then, in one **round**, the ranks average their *pseudo-gradients* (the parameters at
the start of the round minus their own now) and an outer optimizer (SGD with Nesterov
momentum, lr 0.7, momentum 0.9: the paper's) updates the start-of-round parameters with that
average, identically on every rank; every rank's model continues from them. With
``outer_lr=1, outer_momentum=0`` it is plain local SGD (model averaging).

What crosses the network is the per-step path's: each parameter's pseudo-gradient is a layer
of the compressor (``acc.Compressor``, by default ``acc.Compressor(interval=16)``), with its
codec, error feedback, kernels and statistics; one round is one step of its engine. A round
whose pseudo-gradient is not finite on some rank is skipped on every rank (no outer step).

``sync_every="auto"`` chooses the interval per window of inner steps (interval.py,
``acc.SyncInterval``): the first rung (1, a round every step) in critical regimes (the start,
a learning-rate decay, a window whose gradient norm moved by eta), one rung up (4, 16, 64)
while training stays calm. The window's statistics (window.py) are reduced once per window on
the control plane, so every rank chooses the same interval.

``plain_below=64`` (the default, at a fixed interval too): a round of fewer inner steps is a
plain average of the ranks' models (an outer step of lr 1, no momentum, the outer momentum
left as it is). In a short round the pseudo-gradient is close to the last round's, so
Nesterov's momentum of 0.9 at lr 0.7 would move the model about 7 times as far as the inner
steps did (0.7 / (1 - 0.9)), a step the paper's rounds of 500 inner steps never see.
``reset_momentum=True`` drops the outer momentum whenever a critical window lowers the
interval: after a learning-rate decay it holds pseudo-gradients taken at the old rate. An
outer step that grows the model's norm 1.5-fold is named in a warning. The measurements behind
these defaults and the compressor's window of 16 rounds: docs/api.md ("acc.DiLoCo").

**Overlap** (``overlap=True``, Streaming DiLoCo's, here one whole round late): a round of more
than one inner step is launched and not waited for; it lands at the next round's start (the
outer step on the start-of-round parameters, each rank's model set to that result plus the
progress it made meanwhile, which the next round sends). Rounds at interval 1 stay
synchronous. ``flush()`` lands the round in flight; ``state_dict()`` flushes first.

Communication: a data and a control process group of the job's ranks, made at construction
(job.py), as the DDP front end's. The inner optimizer's state (AdamW's moments) stays each
rank's own, as in the paper. **Across the nodes of HSDP** (``mesh=``, the model
``fully_shard``-ed over ``mesh["shard"]`` alone): FSDP2 keeps a node's shards in step every
inner step, nothing crosses the nodes between rounds, and a round averages each rank's shard
of the pseudo-gradient with its *column* (the ranks holding the same shard on the other nodes,
comm/mesh.py); the control plane spans every rank, so every node synchronises at the same step.
"""

from __future__ import annotations

import logging
import time

import torch

from ..comm.channel import collective_timeout
from ..buffered_step import BufferedStep
from ..binding import bind_planes
from ..comm.mesh import node_channel
from ..compressor import Compressor
from .checks import InnerSteps, agree_start, check_arguments, check_sharding
from .tensors import local_tensor, norm_of, swapped_in
from .job import bind_to_job
from .interval import SyncInterval

log = logging.getLogger("accordion_hvd.diloco")

PLAIN_BELOW = 64   # shorter rounds are plain averages (module doc)
GROWTH = 1.5       # an outer step that grows the model's norm more than this is named (_warn_if_grown)
ROUND_WINDOW = 16  # the default compressor's windows, in rounds (module doc)


class DiLoCo:
    """Args:
        model: a plain ``torch.nn.Module`` (not wrapped in DDP, which would average every
            step), the same parameters on every rank at construction.
        inner_optimizer: the optimizer the user steps every inner step, over exactly the
            model's trainable parameters.
        compressor: an ``acc.AccordionCompressor`` (or ``Compressor``) not bound to another
            model; default: ``acc.Compressor(interval=16)`` (module doc).
        sync_every: inner steps per round: a positive integer, "auto" (``acc.SyncInterval()``,
            module doc) or an ``acc.SyncInterval`` with its own ladder.
        outer_lr: the outer optimizer's learning rate (positive).
        outer_momentum: its momentum, in [0, 1).
        nesterov: Nesterov momentum (with ``outer_momentum > 0``).
        outer_optimizer: another outer optimizer: a function of the start-of-round
            parameters (a list of float32 tensors) that returns it, e.g. ``lambda params:
            torch.optim.SGD(params, lr=0.5)``; then ``outer_lr``, ``outer_momentum`` and
            ``nesterov`` stay at their defaults (they describe the default one).
        mesh: for HSDP, the ("replicate", "shard") DeviceMesh whose ``shard`` dimension the
            model was sharded over (module doc); None for a plain model.
        overlap: launch each round of more than one inner step without waiting for it; it
            lands at the next round's start (module doc).
        reset_momentum: with an interval policy, zero the outer momentum when a critical
            window lowers the interval (module doc); default: True with an interval policy,
            False at a fixed ``sync_every`` (where True is refused: the interval never falls).
        plain_below: rounds of fewer inner steps than this are plain averages, not outer
            steps (module doc); default 64, at a fixed ``sync_every`` too (1: every round the
            outer optimizer's step, as published, which diverged on digits at 4-32 inner steps:
            benchmarks/results/diloco-fixed-interval/).
        timeout: seconds a collective may take; default $ACCORDION_COLLECTIVE_TIMEOUT, else 300.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 compressor: Compressor | None = None, *, sync_every: int | str | SyncInterval = "auto", outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True, mesh=None, overlap: bool = False,
                 reset_momentum: bool | None = None, plain_below: int | None = None,
                 timeout: float | None = None, outer_optimizer=None) -> None:
        from torch.nn.parallel import DistributedDataParallel

        check_arguments(sync_every, outer_lr, outer_momentum, overlap, reset_momentum, plain_below, nesterov,
                        outer_optimizer)
        self.policy = (SyncInterval() if sync_every == "auto" else sync_every
                       if isinstance(sync_every, SyncInterval) else None)
        if isinstance(model, DistributedDataParallel):
            raise TypeError("model must not be wrapped in DistributedDataParallel: DDP averages the gradients every "
                            "step, DiLoCo synchronises every sync_every steps; pass the plain module")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.mesh = check_sharding(self.params, mesh)
        self.local = [local_tensor(p) for _, p in self.params]  # this rank's shard of each (FSDP2), or itself
        self.named_local = [(name, local) for (name, _), local in zip(self.params, self.local)]
        optimized = {id(p) for group in inner_optimizer.param_groups for p in group["params"]}
        if optimized != {id(p) for _, p in self.params}:
            raise ValueError("inner_optimizer must optimize exactly the model's trainable parameters "
                             f"({len(self.params)}); it has {len(optimized)}, not all of the model's")
        self.compressor = Compressor(interval=ROUND_WINDOW) if compressor is None else compressor
        if not isinstance(self.compressor, Compressor):
            raise TypeError(f"compressor must be an acc.Compressor (or acc.AccordionCompressor), got {type(self.compressor).__name__}")
        self.outer_lr, self.outer_momentum = float(outer_lr), float(outer_momentum)
        self.nesterov = nesterov and self.outer_momentum > 0
        self.custom_outer = outer_optimizer is not None
        self.make_outer = outer_optimizer or (lambda params: torch.optim.SGD(
            params, lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.nesterov))
        self.overlap = overlap
        self.reset_momentum = self.policy is not None if reset_momentum is None else reset_momentum
        self.interval = self.policy.interval if self.policy is not None else int(sync_every)  # inner steps per round now
        self.plain_below = int(plain_below) if plain_below is not None else PLAIN_BELOW
        self.inner = inner_optimizer
        self.inner_counted = InnerSteps(inner_optimizer)
        # The start-of-round parameters, in float32: what the outer optimizer updates.
        self.start = [p.detach().clone().float() for p in self.local]
        self.outer = self.make_outer(self.start)
        # compared across ranks with the compressor's settings, at the first round
        settings = {
            "diloco_sync_every": repr(self.policy) if self.policy is not None else self.interval,
            "diloco_outer_lr": self.outer_lr, "diloco_outer_momentum": self.outer_momentum,
            "diloco_nesterov": self.nesterov, "diloco_overlap": self.overlap,
            "diloco_reset_momentum": self.reset_momentum, "diloco_plain_below": self.plain_below,
            "diloco_outer": [type(self.outer).__name__, {k: v for k, v in self.outer.defaults.items()
                                                         if isinstance(v, (bool, int, float, str))}]}
        self.node_faults = None  # HSDP: this node's ranks, to agree on a skipped round (buffered_step.py)
        self.size = self._bind(model, inner_optimizer, collective_timeout(timeout), settings)  # ranks of the control plane
        self.control = self.compressor.engine.control
        self.round = BufferedStep(self.compressor.engine, "acc.diloco")  # one round: one step of it
        agree_start(self.params, self.local, self.mesh, self.control)
        self.inner_steps = 0
        self.since_sync = 0  # inner steps since the last round
        self.syncs = 0
        self.skipped = 0
        self.launched = None  # overlap: each local parameter when the round in flight was launched
        self.plain = False    # the round in flight is a plain average (launched at an interval below plain_below)
        if self.policy is not None:
            self.policy.watch(inner_optimizer)
        if self.policy is not None and self.interval == 1:  # said, or a short trial looks like no saving
            log.info("DiLoCo: a round every inner step for the first %d inner steps (the start of training is a "
                     "critical regime: two windows of %d), then one rung up %s per calm window", 2 * self.policy.window,
                     self.policy.window, self.policy.ladder)

    def _bind(self, model, optimizer, timeout: float, settings: dict) -> int:
        """The compressor bound to the job's planes, DiLoCo's ``settings`` declared to its
        engine; returns the number of ranks (job.py; under HSDP the data plane is this rank's
        column)."""
        import torch.distributed as dist

        if self.mesh is None:
            return bind_to_job(self.compressor, model, optimizer, self.params[0][1].device.type, timeout, "DiLoCo",
                               settings=settings)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DiLoCo with mesh= (HSDP) needs torch.distributed initialized (torchrun)")
        ranks = list(range(dist.get_world_size()))
        bind_planes(self.compressor, model, ranks, timeout, lanes=("q", "dense"), mesh=self.mesh, optimizer=optimizer,
                    speaks=dist.get_rank() == 0, front_end="acc.DiLoCo", settings=settings)
        self.node_faults = node_channel(self.mesh, timeout)
        return len(ranks)

    def step(self) -> bool:
        """Count one inner step; when a round is due, run it. Returns whether one ran. Call it
        on every rank after each step of the inner optimizer (its gradients still there)."""
        started = time.perf_counter()
        self.inner_counted.check(grads := [local_tensor(p.grad) for _, p in self.params if p.grad is not None])
        self.inner_steps += 1
        self.since_sync += 1
        if self.policy is not None:  # (HSDP: each rank's shard of the gradients)
            self.policy.observe(started, grads)
        due = self.since_sync >= self.interval
        if due:
            self.sync()
            if self.policy is not None:
                self.policy.round_took(time.perf_counter() - started)
        else:  # stats(): floats_dense is what per-step dense training would have sent by now
            self.compressor.count_local_step(self.named_local)  # (HSDP: this rank's shards, as a round counts)
        if self.policy is not None and self.inner_steps % self.policy.window == 0:  # always after a round
            before, self.interval = self.interval, self.policy.close_window(self.control, self.size)
            if self.interval != before:
                log.info("DiLoCo: from inner step %d, a round every %d inner step%s (was %d)", self.inner_steps,
                         self.interval, "" if self.interval == 1 else "s", before)
            if self.reset_momentum and self.interval < before:  # a critical window: the memory is stale
                self.flush()  # (overlap: the window's last round lands first, or it would refill the memory)
                self.outer.state.clear()
        if self.policy is not None:
            self.policy.step_ended()
        return due

    def synced(self):
        """The model of the last round that landed (the same on every rank) in place of this
        rank's local one while the block runs (to evaluate it); the local parameters come back
        after. With ``overlap``, call ``flush()`` on every rank first for the latest round's
        (this makes no collective, so one rank alone may evaluate). Parameters only: buffers
        (BatchNorm's running statistics) stay each rank's own, as with PyTorch's
        ``PeriodicModelAverager``."""
        return swapped_in(self.local, self.start)

    @torch.no_grad()
    def sync(self) -> None:
        """One round, on every rank: average the pseudo-gradients through the compressor,
        take the outer step, and set every rank's model to its result (module doc). With
        ``overlap`` a round in flight lands first, and a round of more than one inner step is
        only launched: it lands at the next one."""
        if self.launched is not None:
            self._land()
        self.plain = self.interval < self.plain_below  # (interval 1 under "auto": the per-step path)
        for (name, local), start in zip(self.named_local, self.start):
            self.round.add(name, start - local.float(), start, uncompressed_here=True)
        self.round.send("round")  # the layers sent whole this round (16-bit dense), one average per dtype
        self.syncs += 1
        self.since_sync = 0
        if self.overlap and self.interval > 1:
            self.launched = [local.detach().clone() for local in self.local]
        else:
            self._land()

    @torch.no_grad()
    def flush(self) -> None:
        """Land the round in flight, if any (``overlap``), on every rank at the same inner step:
        before evaluating ``synced()``'s model, and at the end of training."""
        if self.launched is not None:
            self._land()

    def drop_in_flight(self) -> None:
        """Wait for the round in flight, if any (``overlap``), and drop its result (its
        collectives done on every rank, the engine's step closed), on every rank at the same
        step: before replacing the model (``load_state_dict``, ``restart``)."""
        if self.launched is not None:
            self.round.finish(self.node_faults)
            self.launched = None

    def _land(self) -> None:
        """Wait for the round launched last; take its outer step (none if some rank's
        pseudo-gradient was not finite) and set the local parameters: to its result, plus
        (overlap) the progress each made since the launch."""
        results, _ = self.round.finish(self.node_faults)
        launched, self.launched = self.launched, None
        if self.compressor.step_skipped:  # some rank's pseudo-gradient was not finite: the same on every rank
            self.skipped += 1
            log.warning("DiLoCo: round %d skipped on every rank (a pseudo-gradient was not finite); every rank "
                        "returns to the round's start", self.syncs)
            launched = None  # (the progress since may be as non-finite)
            self._drop_nonfinite_inner_state()
        else:
            for start, average in results:
                start.grad = average.view_as(start)
            if self.plain:
                torch._foreach_sub_(self.start, [start.grad for start in self.start])
            else:
                before = norm_of(self.start)
                self.outer.step()
                self._warn_if_grown(before, norm_of(self.start))
        if launched is None:
            for local, start in zip(self.local, self.start):
                local.copy_(start)
        else:
            for local, start, then in zip(self.local, self.start, launched):
                local.copy_(start + (local.float() - then.float()))

    def _warn_if_grown(self, before: float, after: float) -> None:
        """A round whose outer step grew the model's norm more than ``GROWTH`` times is named,
        on every rank (each computes it from the same start-of-round model; under HSDP from
        its own shards): an outer step that overshoots diverges with no other word."""
        if after > GROWTH * before:
            log.warning("DiLoCo: round %d's outer step grew the parameters' norm %.1fx (%.4g to %.4g): the outer "
                        "optimizer overshoots (Nesterov's momentum at rounds of %d inner steps); use plain averages "
                        "for short rounds (plain_below=64) or outer_momentum=0", self.syncs, after / max(before, 1e-30),
                        before, after, self.interval)

    def _drop_nonfinite_inner_state(self) -> None:
        """After a skipped round: this rank's inner optimizer state of each parameter whose
        state is not finite starts again (SGD's momentum, AdamW's moments and step). Else the
        non-finite gradient that poisoned the round, kept in a momentum, would poison every
        round after it. This rank's own state, so its own decision (no collective)."""
        bad = [p for p, state in self.inner.state.items()
               if any(torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(local_tensor(v)).all())
                      for v in state.values())]
        for p in bad:
            del self.inner.state[p]
        if bad:
            log.warning("DiLoCo: the inner optimizer's state of %d parameter%s was not finite on this rank after the "
                        "skipped round; it starts again", len(bad), "" if len(bad) == 1 else "s")

    # --- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What resumes the outer loop bit for bit on the same world: the start-of-round
        parameters (float32), the outer optimizer's momentum, the counters, the interval policy
        and its window's statistics, and the compressor's state (its error feedback: this
        rank's). Between inner steps, on every rank: a round in flight (``overlap``) lands first."""
        self.flush()
        return {"world": self.size, "inner_steps": self.inner_steps, "syncs": self.syncs, "skipped": self.skipped,
                "start": [t.clone() for t in self.start], "interval": self.interval, "since_sync": self.since_sync,
                "outer": self.outer.state_dict(), "compressor": self.compressor.state_dict(),
                **({} if self.policy is None else {"policy": self.policy.state_dict()})}  # (its window's too)

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict()``. From a job with another number of ranks the outer state
        restarts (momentum zero, the round starts from the model as loaded) with a warning.
        A round in flight is waited for and dropped (every rank loads at the same step). The
        settings are this object's: a fixed ``sync_every``, ``outer_lr`` and
        ``outer_momentum`` other than the saved ones take over (with a warning). The one
        refusal (auto against a fixed interval) comes before anything changes."""
        if (self.policy is None) != ("policy" not in state):
            raise ValueError("DiLoCo.load_state_dict: the state was saved with sync_every "
                             f"{'auto' if 'policy' in state else state['interval']}, this DiLoCo has "
                             f"{'auto' if self.policy is not None else self.interval}; resume with the same")
        self.drop_in_flight()
        self.compressor.load_state_dict(state["compressor"])
        self.inner_steps, self.syncs, self.skipped = state["inner_steps"], state["syncs"], state["skipped"]
        self.since_sync = state["since_sync"]
        if self.policy is not None:
            self.interval = state["interval"]
            # (a state saved before the policy held its window's statistics has them beside it)
            self.policy.load_state_dict({**state["policy"], **({"window": state["window"]} if "window" in state else {})})
        elif state["interval"] != self.interval:
            log.warning("DiLoCo: the state was saved with sync_every=%d, this job has %d: rounds every %d inner "
                        "steps from now on", state["interval"], self.interval, self.interval)
        if state["world"] != self.size:
            log.warning("DiLoCo: the state was saved by %d ranks, this job has %d: the outer optimizer restarts "
                        "(momentum zero) from the model's parameters", state["world"], self.size)
            return self.restart()
        with torch.no_grad():
            for start, saved in zip(self.start, state["start"]):
                start.copy_(saved)
        self.outer.load_state_dict(state["outer"])  # its momentum; PyTorch restores the saved lr and momentum too:
        saved = self.outer.param_groups[0]
        if self.custom_outer:  # (another outer optimizer: its state as saved)
            return
        if (saved["lr"], saved["momentum"]) != (self.outer_lr, self.outer_momentum):
            log.warning("DiLoCo: the state was saved with outer_lr=%g, outer_momentum=%g; this job's %g, %g from now "
                        "on", saved["lr"], saved["momentum"], self.outer_lr, self.outer_momentum)
        for group in self.outer.param_groups:
            group.update(lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.nesterov)

    @torch.no_grad()
    def restart(self) -> None:
        """The outer loop starts again from the model as it is now (the start-of-round
        parameters the model's, the outer momentum zero): after loading a model whose DiLoCo
        state does not fit this job (another world or mesh). A round in flight is waited for
        and dropped: the model as it is now is the start."""
        self.drop_in_flight()
        for start, local in zip(self.start, self.local):
            start.copy_(local.detach().float())
        self.outer = self.make_outer(self.start)
        self.since_sync = self.inner_steps % self.interval  # rounds stay on multiples of the interval (windows end on one)


__all__ = ["DiLoCo"]
