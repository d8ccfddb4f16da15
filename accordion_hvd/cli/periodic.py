"""The CLI's periodic synchronisation (``--sync``), under torchrun: every rank trains its own
copy of the model and the copies meet every so many steps, not every step.

- ``--sync diloco`` with our compression (``--codec default`` or one of ours):
  ``acc.DiLoCo(model, opt, compressor, sync_every=--sync-every, outer_lr=--outer-lr,
  outer_momentum=--outer-momentum)`` (accordion_hvd/diloco.py), ``--sync-every auto`` its
  interval policy.
- ``--sync diloco --codec none``: DiLoCo as published (Douillard et al., 2023), the peer it is
  measured against: every ``--sync-every`` steps the pseudo-gradients averaged in float32 in
  one ``all_reduce`` of the flattened model, an outer SGD step with Nesterov momentum. Written
  here in plain torch, without our engine, so that the peer pays none of our costs.
- ``--sync torch-localsgd``: PyTorch's own local SGD at its documented settings: DDP with
  ``post_localSGD_hook`` (every step averaged until ``--localsgd-warmup`` steps, then local) and
  ``PostLocalSGDOptimizer`` with ``PeriodicModelAverager(period=--sync-every)``.

Evaluation sees one model, the same on every rank: DiLoCo's of the last round (``synced()``:
what DiLoCo's outer loop holds); local SGD's average of the ranks' models, made for the
evaluation and undone after it (PyTorch's averager keeps no such copy). Records: the current
interval and the rounds so far in steps.csv (``sync_interval``, ``syncs``).
"""

from __future__ import annotations

import os

import torch

from ..compressor import Compressor
from ..diloco import DiLoCo, swapped_in
from .frontends import DDPFrontEnd

SYNCS = ("every-step", "diloco", "torch-localsgd")


class DiLoCoFrontEnd(DDPFrontEnd):
    """``--sync diloco``: a plain model, the inner optimizer stepped locally, a round when due."""

    name = "diloco"
    label = "torchrun, DiLoCo"

    def __init__(self, device_type: str, sync_every, outer_lr: float, outer_momentum: float) -> None:
        super().__init__(device_type)
        self.sync_every, self.outer_lr, self.outer_momentum = sync_every, outer_lr, outer_momentum
        self.periodic = None  # acc.DiLoCo or PlainDiLoCo, once wrapped

    def wrap(self, model: torch.nn.Module, opt: torch.optim.Optimizer, compression, device: torch.device):
        broadcast_model(model, self.dist)  # every rank starts from rank 0's model, as DDP would
        if isinstance(compression, Compressor):
            self.periodic = DiLoCo(model, opt, compression, sync_every=self.sync_every, outer_lr=self.outer_lr,
                                   outer_momentum=self.outer_momentum)
            self.label = f"torchrun, DiLoCo (sync_every={self.sync_every}, our compression)"
        else:
            self.periodic = PlainDiLoCo(model, self.dist, compression, self.sync_every, self.outer_lr,
                                        self.outer_momentum)
            self.label = f"torchrun, DiLoCo as published (sync_every={self.sync_every}, float32 average)"
        return model, opt

    def step(self, opt, compression) -> None:
        opt.step()  # local: a non-finite gradient makes this rank's round non-finite, and DiLoCo skips it
        self.periodic.step()

    def evaluating(self):
        return self.periodic.synced()

    def record(self) -> dict:
        return {"sync_interval": self.periodic.interval, "syncs": self.periodic.syncs}

    def sync_state(self):
        return self.periodic.state_dict()

    def load_sync_state(self, state) -> None:
        self.periodic.load_state_dict(state)


class PlainDiLoCo:
    """DiLoCo as published, in plain torch (module doc). ``compression`` (the CLI's
    ``Uncompressed("none")``) counts the floats each round sends."""

    def __init__(self, model, dist, compression, sync_every, outer_lr: float, outer_momentum: float) -> None:
        if not isinstance(sync_every, int):
            raise SystemExit("--sync diloco --codec none is DiLoCo as published, at a fixed interval: give "
                             f"--sync-every N (got {sync_every!r}; auto is our interval policy, with our compression)")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.dist, self.compression, self.interval = dist, compression, sync_every
        self.floats = sum(p.numel() for p in self.params)
        self.start = [p.detach().clone().float() for p in self.params]
        self.outer = torch.optim.SGD(self.start, lr=outer_lr, momentum=outer_momentum,
                                     nesterov=outer_momentum > 0)
        self.inner_steps = self.syncs = 0

    def step(self) -> None:
        self.inner_steps += 1
        if self.inner_steps % self.interval:
            self.compression.count(0, dense=self.floats)
            return
        with torch.no_grad():
            flat = torch.cat([(s - p.float()).reshape(-1) for s, p in zip(self.start, self.params)])
            self.dist.all_reduce(flat)
            flat /= self.dist.get_world_size()
            self.compression.count(flat.numel(), dense=self.floats)
            offset = 0
            for s in self.start:
                s.grad = flat[offset:offset + s.numel()].view_as(s)
                offset += s.numel()
            self.outer.step()
            for s, p in zip(self.start, self.params):
                p.copy_(s)
        self.syncs += 1

    def synced(self):
        return swapped_in(self.params, self.start)

    def state_dict(self) -> dict:
        return {"start": [s.clone() for s in self.start], "outer": self.outer.state_dict(),
                "inner_steps": self.inner_steps, "syncs": self.syncs}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for s, saved in zip(self.start, state["start"]):
                s.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        self.inner_steps, self.syncs = state["inner_steps"], state["syncs"]


class TorchLocalSGDFrontEnd(DDPFrontEnd):
    """``--sync torch-localsgd``: PyTorch's post-local SGD (module doc)."""

    name = "torch-localsgd"

    def __init__(self, device_type: str, period: int, warmup: int) -> None:
        super().__init__(device_type)
        self.period, self.warmup = period, warmup
        self.label = f"torchrun, PyTorch's local SGD (period {period}, warmup {warmup} steps)"
        self.interval, self.syncs, self.steps, self.params, self.floats = 1, 0, 0, [], 0

    def wrap(self, model: torch.nn.Module, opt: torch.optim.Optimizer, compression, device: torch.device):
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (PostLocalSGDState,
                                                                                   post_localSGD_hook)
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        # After the warmup, PyTorch's hook still averages the gradients inside each machine
        # (subgroup=None: groups of the node's GPUs); CPU ranks name their node's group alike.
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.size))
        subgroup = None if device.type == "cuda" else self.dist.new_subgroups(group_size=per_node)[0]
        state = PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=self.warmup)
        ddp.register_comm_hook(state, post_localSGD_hook)
        opt = PostLocalSGDOptimizer(optim=opt, averager=PeriodicModelAverager(period=self.period,
                                                                              warmup_steps=self.warmup))
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.floats = sum(p.numel() for p in self.params)
        return ddp, opt

    def step(self, opt, compression) -> None:
        opt.step()  # the averager: the parameters averaged at step warmup, then every period-th after it
        index, self.steps = self.steps, self.steps + 1  # PeriodicModelAverager's own count, from 0
        sent = index < self.warmup or (index - self.warmup) % self.period == 0  # DDP's allreduce, or an average
        if index >= self.warmup:
            self.interval = self.period
        compression.count(self.floats if sent else 0, dense=self.floats)
        self.syncs += sent

    def evaluating(self):
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in self.params])
            self.dist.all_reduce(flat)
            flat /= self.size
        return swapped_in(self.params, list(flat.split([p.numel() for p in self.params])))

    def record(self) -> dict:
        return {"sync_interval": self.interval, "syncs": self.syncs}


def broadcast_model(model: torch.nn.Module, dist) -> None:
    """Rank 0's parameters and buffers on every rank."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)
