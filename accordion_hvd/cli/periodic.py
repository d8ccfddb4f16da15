"""The CLI's periodic synchronisation (``--sync``), under torchrun: every rank trains its own
copy of the model and the copies meet every so many steps, not every step.

- ``--sync diloco`` with our compression (``--codec default`` or one of ours):
  ``acc.DiLoCo(model, opt, compressor, **options)``, the options from the flags
  (options.py ``diloco_options``: ``sync_every=--sync-every``, ``outer_lr=--outer-lr``, ...;
  accordion_hvd/periodic/diloco.py), ``--sync-every auto`` its interval policy.
- ``--launcher fsdp --sync diloco`` (ours): each node's ranks shard the model with FSDP2 over
  the mesh's ``shard`` dimension (in step every inner step, inside the node) and the rounds
  cross the nodes (``acc.DiLoCo(..., mesh=mesh)``); its state goes into the
  ``torch.distributed.checkpoint`` directory, each rank's own (``DiLoCoCheckpoint``).
- ``--sync diloco --codec none``: DiLoCo as published (Douillard et al., 2023), the peer it is
  measured against: every ``--sync-every`` steps the pseudo-gradients averaged in float32 in
  one ``all_reduce`` of the flattened model, an outer SGD step with Nesterov momentum. Written
  here in plain torch, without our engine, so that the peer pays none of our costs.
- ``--sync torch-localsgd``: PyTorch's own local SGD at its documented settings: DDP with
  ``post_localSGD_hook`` (every step averaged until ``--localsgd-warmup`` steps, then local) and
  ``PostLocalSGDOptimizer`` with ``PeriodicModelAverager(period=--sync-every)``.

Evaluation sees one model, the same on every rank: DiLoCo's of the last round (``synced()``:
what DiLoCo's outer loop holds; with --overlap the round in flight lands first); local SGD's
average of the ranks' models, made for the evaluation and undone after it (PyTorch's averager
keeps no such copy). Records: the current interval and the rounds so far in steps.csv
(``sync_interval``, ``syncs``).
"""

from __future__ import annotations

import io
import logging
import os

import torch

from ..compressor import Compressor
from ..periodic.diloco import DiLoCo
from ..periodic.tensors import local_tensor, swapped_in
from .frontends import DDPFrontEnd, FSDPFrontEnd

log = logging.getLogger("accordion_hvd.train")

SYNCS = ("every-step", "diloco", "torch-localsgd", "sparseloco", "signloco", "onebit-adam", "ours-onebit-adam")


class DiLoCoFrontEnd(DDPFrontEnd):
    """``--sync diloco``: a plain model, the inner optimizer stepped locally, a round when due."""

    name = sync = "diloco"
    label = "torchrun, DiLoCo"

    def __init__(self, device_type: str, options: dict) -> None:
        super().__init__(device_type)
        self.options = options  # acc.DiLoCo's keyword arguments (options.py diloco_options)
        self.periodic = None  # acc.DiLoCo or PlainDiLoCo, once wrapped

    def wrap(self, model: torch.nn.Module, opt: torch.optim.Optimizer, compression, device: torch.device):
        broadcast_model(model, self.dist)  # every rank starts from rank 0's model, as DDP would
        every = self.options["sync_every"]
        if isinstance(compression, Compressor):
            self.periodic = DiLoCo(model, opt, compression, **self.options)
            self.label = (f"torchrun, DiLoCo (sync_every={every}, our compression"
                          f"{', overlapped' if self.options.get('overlap') else ''})")
        else:
            self.periodic = PlainDiLoCo(model, self.dist, compression, every, self.options["outer_lr"],
                                        self.options["outer_momentum"])
            self.label = f"torchrun, DiLoCo as published (sync_every={every}, float32 average)"
        return model, opt

    def step(self, opt, compression) -> None:
        opt.step()  # local: a non-finite gradient makes this rank's round non-finite, and DiLoCo skips it
        self.periodic.step()

    def evaluating(self):
        self.settle()
        return self.periodic.synced()

    def settle(self) -> None:
        self.periodic.flush()  # --overlap: the round in flight lands (every rank calls this)

    def record(self) -> dict:
        return {"sync_interval": self.periodic.interval, "syncs": self.periodic.syncs}

    def sync_state(self):
        return self.periodic.state_dict()

    def load_sync_state(self, state) -> None:
        self.periodic.load_state_dict(state)


class HSDPDiLoCoFrontEnd(FSDPFrontEnd):
    """``--launcher fsdp --sync diloco``: FSDP2 inside each node every inner step, DiLoCo's
    rounds across the nodes (module doc). Checkpoints are the FSDP front end's (DCP)."""

    sync = "diloco"
    label = "fsdp, DiLoCo"

    def __init__(self, device_type: str, nodes: int | None, reduce_dtype: str | None, options: dict) -> None:
        super().__init__(device_type, nodes, reduce_dtype)
        self.options = options  # acc.DiLoCo's keyword arguments (options.py diloco_options)
        self.periodic = None  # acc.DiLoCo, once wrapped

    def wrap(self, model: torch.nn.Module, opt: torch.optim.Optimizer, compression, device: torch.device):
        broadcast_model(model, self.dist)  # every rank starts from rank 0's model, as FSDP would
        self.label = (f"fsdp over {self.nodes} nodes, DiLoCo across them (sync_every={self.options['sync_every']}, "
                      f"our compression{', overlapped' if self.options.get('overlap') else ''})")
        model, opt, mesh = self.shard(model, opt, compression, within_nodes=True)  # (may add ", reduce in bfloat16")
        self.periodic = DiLoCo(model, opt, compression, mesh=mesh, **self.options)
        self.hook = DiLoCoCheckpoint(self.periodic, opt, f"{self.nodes}x{self.size // self.nodes}", self.rank)
        return model, opt

    def step(self, opt, compression) -> None:
        opt.step()  # FSDP has reduce-scattered the gradients inside the node; nothing crossed the nodes
        self.periodic.step()

    def evaluating(self):
        self.settle()
        return self.periodic.synced()

    def settle(self) -> None:
        self.periodic.flush()  # --overlap: the round in flight lands (every rank calls this)

    def record(self) -> dict:
        return {"sync_interval": self.periodic.interval, "syncs": self.periodic.syncs}

    def resumed(self) -> None:
        self.hook.apply()  # this rank's own copy over the one DCP loaded (DiLoCoCheckpoint)


class DiLoCoCheckpoint:
    """DiLoCo's part of a ``torch.distributed.checkpoint`` (a ``Stateful``), each rank's own,
    serialized under a key of its rank beside the mesh it was saved on (as ``compress_hsdp``'s
    hook does): the outer state (start-of-round parameters, outer momentum, error feedback) and
    the rank's own shards of the parameters and of the inner optimizer's state. Why the last
    two: DCP saves a shard once for all the nodes holding it (replicas, to FSDP), and between
    rounds each node's copy is its own (its parameters after the last round, its AdamW
    moments always). They are put back in ``apply``, after DCP has loaded the model (``resumed``).
    Another mesh's state does not fit: the outer loop restarts from the loaded model (node 0's
    copy), with a warning."""

    def __init__(self, diloco: DiLoCo, optimizer: torch.optim.Optimizer, mesh: str, rank: int) -> None:
        self.diloco, self.optimizer, self.mesh, self.key = diloco, optimizer, mesh, f"accordion.diloco.rank{rank}"
        self.saved = None  # what load_state_dict read, until apply

    def _inner_state(self) -> list[dict]:
        """The inner optimizer's state, this rank's shards, in the order of its parameters."""
        return [dict(self.optimizer.state.get(p, {})) for group in self.optimizer.param_groups for p in group["params"]]

    def state_dict(self) -> dict:
        buffer = io.BytesIO()
        torch.save({"outer": self.diloco.state_dict(), "params": [t.detach().clone() for t in self.diloco.local],
                    "inner": [{k: local_tensor(v).clone() if torch.is_tensor(v) else v for k, v in state.items()}
                              for state in self._inner_state()]}, buffer)
        return {"accordion.diloco.mesh": self.mesh, self.key: buffer.getvalue()}

    def load_state_dict(self, state: dict) -> None:
        mine = state.get(self.key)
        if state.get("accordion.diloco.mesh") == self.mesh and isinstance(mine, bytes):
            self.saved = torch.load(io.BytesIO(mine), weights_only=True)
            return
        log.warning("DiLoCo: the checkpoint's outer state is of mesh %s, this job's %s: the outer loop restarts "
                    "from the loaded model (node 0's copy; momentum zero, error feedback from zero)",
                    state.get("accordion.diloco.mesh"), self.mesh)
        self.saved = "restart"

    @torch.no_grad()
    def apply(self) -> None:
        if self.saved == "restart":
            self.diloco.restart()
        elif self.saved is not None:
            for local, saved in zip(self.diloco.local, self.saved["params"]):
                local.copy_(saved)
            for state, saved in zip(self._inner_state(), self.saved["inner"]):
                for k, value in saved.items():
                    if torch.is_tensor(value):
                        local_tensor(state[k]).copy_(value)
            self.diloco.load_state_dict(self.saved["outer"])
        self.saved = None


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

    def flush(self) -> None:
        """Nothing is ever in flight here: every round is waited for."""

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

    name = sync = "torch-localsgd"

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
