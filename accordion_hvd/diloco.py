"""``acc.DiLoCo``: local training with periodic, compressed synchronisation.

    dist.init_process_group("gloo")          # torchrun; every rank starts from the same model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    diloco = acc.DiLoCo(model, opt, sync_every=16)
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()                           # an inner step: local, no communication
        diloco.step()                        # every sync_every-th call: one round (below)

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

Communication: process groups of the job's ranks made at construction (every rank constructs
it, in the same order): one for the data with the default group's backend and lanes for
PowerSGD's Q rounds and the uncompressed layers, and a Gloo one for control, as the DDP front
end's (accordion_hvd/ddp.py). The inner optimizer's state (AdamW's moments) stays each rank's
own, as in the paper.
"""

from __future__ import annotations

import hashlib
import logging
import numbers

import numpy as np
import torch

from .comm.channel import collective_timeout
from .comm.control import ProcessGroupControlPlane
from .comm.process_group import ProcessGroupChannel, timeout_delta
from .compressor import Compressor
from .engine import DENSE

log = logging.getLogger("accordion_hvd.diloco")


class DiLoCo:
    """Args:
        model: a plain ``torch.nn.Module`` (not wrapped in DDP, which would average every
            step), the same parameters on every rank at construction.
        inner_optimizer: the optimizer the user steps every inner step, over exactly the
            model's trainable parameters.
        compressor: an ``acc.AccordionCompressor`` (or ``Compressor``) not bound to another
            model; default: ``acc.AccordionCompressor()``'s configuration.
        sync_every: inner steps per round, a positive integer.
        outer_lr: the outer optimizer's learning rate (positive).
        outer_momentum: its momentum, in [0, 1).
        nesterov: Nesterov momentum (with ``outer_momentum > 0``).
        timeout: seconds a collective may take; default $ACCORDION_COLLECTIVE_TIMEOUT, else 300.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 compressor: Compressor | None = None, *, sync_every: int = 16, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True, timeout: float | None = None) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        _check_arguments(sync_every, outer_lr, outer_momentum)
        if isinstance(model, DistributedDataParallel):
            raise TypeError("model must not be wrapped in DistributedDataParallel: DDP averages the gradients every "
                            "step, DiLoCo synchronises every sync_every steps; pass the plain module")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("DiLoCo needs torch.distributed initialized (dist.init_process_group, under torchrun)")
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        optimized = {id(p) for group in inner_optimizer.param_groups for p in group["params"]}
        if optimized != {id(p) for _, p in self.params}:
            raise ValueError("inner_optimizer must optimize exactly the model's trainable parameters "
                             f"({len(self.params)}); it has {len(optimized)}, not all of the model's")
        self.compressor = Compressor() if compressor is None else compressor
        if not isinstance(self.compressor, Compressor):
            raise TypeError(f"compressor must be an acc.AccordionCompressor, got {type(self.compressor).__name__}")
        self.sync_every, self.outer_lr, self.outer_momentum = int(sync_every), float(outer_lr), float(outer_momentum)
        self.nesterov = bool(nesterov) and self.outer_momentum > 0
        timeout = collective_timeout(timeout)
        delta = timeout_delta(timeout)
        ranks = list(range(dist.get_world_size()))
        backend = dist.get_backend()
        # New groups are collective calls: every rank makes them here, in the same order.
        data, q_lane, dense_lane = (dist.new_group(ranks, timeout=delta, backend=backend) for _ in range(3))
        control = dist.new_group(ranks, timeout=delta, backend="gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        self.channel = ProcessGroupChannel(data, rank, size, timeout, lanes={"q": q_lane, "dense": dense_lane})
        self.control = ProcessGroupControlPlane(control, rank, size, timeout)
        self.compressor.bind(model, channel=self.channel, control=self.control, optimizer=inner_optimizer)
        self._agree_start()
        # The start-of-round parameters, in float32: what the outer optimizer updates.
        self.start = [p.detach().clone().float() for _, p in self.params]
        self.outer = torch.optim.SGD(self.start, lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.nesterov)
        self.inner_steps = 0
        self.syncs = 0
        self.skipped = 0

    def step(self) -> bool:
        """Count one inner step; at every ``sync_every``-th, a round. Returns whether one ran.
        Call it on every rank after each step of the inner optimizer."""
        self.inner_steps += 1
        if self.inner_steps % self.sync_every:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """One round, on every rank: average the pseudo-gradients through the compressor,
        take the outer step, and set every rank's model to its result (module doc)."""
        engine = self.compressor.engine
        entries, dense = [], {}
        for (name, param), start in zip(self.params, self.start):
            out, route = engine.add(name, start - param.detach().float(), uncompressed_here=True)
            where = None
            if route == DENSE:  # sent whole this round (16-bit dense): averaged here, one collective per dtype
                group = dense.setdefault(out.dtype, [])
                group.append(out)
                where = (out.dtype, len(group) - 1)
            entries.append((name, route, where))
        handles = {dtype: self.channel.allreduce_mean_async(
            tensors, name=f"acc.diloco.dense.{str(dtype).removeprefix('torch.')}.{len(tensors)}")
            for dtype, tensors in sorted(dense.items(), key=lambda item: str(item[0]))}
        averages = {dtype: self.channel.wait(handle) for dtype, handle in handles.items()}
        results = [engine.finish(route, name, None if where is None else averages[where[0]][where[1]])
                   for name, route, where in entries]
        engine.end_step()
        self.syncs += 1
        if self.compressor.step_skipped:  # some rank's pseudo-gradient was not finite: the same on every rank
            self.skipped += 1
            log.warning("DiLoCo: round %d skipped on every rank (a pseudo-gradient was not finite); every rank "
                        "returns to the round's start", self.syncs)
        else:
            for start, average in zip(self.start, results):
                start.grad = average.view_as(start)
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
        return {"world": self.channel.size, "inner_steps": self.inner_steps, "syncs": self.syncs,
                "skipped": self.skipped, "start": [t.clone() for t in self.start],
                "outer": self.outer.state_dict(), "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict()``. From a job with another number of ranks the outer state
        restarts (momentum zero, the round starts from the model as loaded) with a warning."""
        self.compressor.load_state_dict(state["compressor"])
        self.inner_steps, self.syncs, self.skipped = state["inner_steps"], state["syncs"], state["skipped"]
        if state["world"] != self.channel.size:
            log.warning("DiLoCo: the state was saved by %d ranks, this job has %d: the outer optimizer restarts "
                        "(momentum zero) from the model's parameters", state["world"], self.channel.size)
            for start, (_, param) in zip(self.start, self.params):
                start.copy_(param.detach().float())
            return
        with torch.no_grad():
            for start, saved in zip(self.start, state["start"]):
                start.copy_(saved)
        self.outer.load_state_dict(state["outer"])


def _check_arguments(sync_every, outer_lr, outer_momentum) -> None:
    if isinstance(sync_every, bool) or not isinstance(sync_every, numbers.Integral) or sync_every < 1:
        raise ValueError(f"sync_every must be a positive integer (inner steps per round), got {sync_every!r}")
    if isinstance(outer_lr, bool) or not isinstance(outer_lr, numbers.Real) or not outer_lr > 0:
        raise ValueError(f"outer_lr must be a positive number, got {outer_lr!r}")
    if isinstance(outer_momentum, bool) or not isinstance(outer_momentum, numbers.Real) \
            or not 0 <= outer_momentum < 1:
        raise ValueError(f"outer_momentum must be a number in [0, 1), got {outer_momentum!r}")


__all__ = ["DiLoCo"]
