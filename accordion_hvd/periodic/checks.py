"""What ``acc.DiLoCo`` (diloco.py) checks before it trusts its arguments: their values, the
model's sharding against ``mesh``, and that every rank starts from the same parameters. Each
refusal names the argument, the same on every rank."""

from __future__ import annotations

import hashlib
import numbers

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from ..comm.mesh import check_mesh
from .interval import SyncInterval


def check_arguments(sync_every, outer_lr, outer_momentum, overlap, reset_momentum=None, plain_below=None,
                    nesterov=True, outer_optimizer=None) -> None:
    if not (sync_every == "auto" or isinstance(sync_every, SyncInterval)) and (
            isinstance(sync_every, bool) or not isinstance(sync_every, numbers.Integral) or sync_every < 1):
        raise ValueError(f"sync_every must be a positive integer (inner steps per round), \"auto\" or an "
                         f"acc.SyncInterval, got {sync_every!r}")
    if isinstance(outer_lr, bool) or not isinstance(outer_lr, numbers.Real) or not outer_lr > 0:
        raise ValueError(f"outer_lr must be a positive number, got {outer_lr!r}")
    if isinstance(outer_momentum, bool) or not isinstance(outer_momentum, numbers.Real) \
            or not 0 <= outer_momentum < 1:
        raise ValueError(f"outer_momentum must be a number in [0, 1), got {outer_momentum!r}")
    if not isinstance(nesterov, bool):
        raise TypeError(f"nesterov must be True or False, got {nesterov!r}")
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be True or False, got {overlap!r}")
    if reset_momentum is not None and not isinstance(reset_momentum, bool):
        raise TypeError(f"reset_momentum must be True, False or None (the default), got {reset_momentum!r}")
    if plain_below is not None and (isinstance(plain_below, bool) or not isinstance(plain_below, numbers.Integral)
                                    or plain_below < 1):
        raise ValueError(f"plain_below must be a positive integer (inner steps), got {plain_below!r}")
    if outer_optimizer is not None and not callable(outer_optimizer):
        raise TypeError(f"outer_optimizer must be a function of the parameters that returns an optimizer (e.g. "
                        f"lambda params: torch.optim.SGD(params, lr=0.5)), got {type(outer_optimizer).__name__}")
    if outer_optimizer is not None and (outer_lr, outer_momentum, nesterov) != (0.7, 0.9, True):
        raise ValueError("outer_optimizer is given: leave outer_lr, outer_momentum and nesterov at their defaults "
                         "(they describe the default outer optimizer); set them in the optimizer you build")
    if isinstance(sync_every, SyncInterval) and sync_every.statistic is not None:  # (before any collective)
        raise ValueError("sync_every: this acc.SyncInterval already chooses another DiLoCo's interval (it holds "
                         "that job's window statistics); create one per DiLoCo")
    if reset_momentum and not (sync_every == "auto" or isinstance(sync_every, SyncInterval)):
        raise ValueError(f"reset_momentum needs an interval policy (sync_every=\"auto\" or an acc.SyncInterval): "
                         f"at a fixed sync_every={sync_every!r} the interval never falls")


def check_sharding(params: list[tuple], mesh):
    """``mesh`` checked against the model: a plain model takes none; a model FSDP2 sharded
    takes the ("replicate", "shard") mesh it was sharded over the ``shard`` dimension of.
    Returns the mesh."""
    meshes = {id(p.device_mesh): p.device_mesh for _, p in params if isinstance(p, DTensor)}
    if mesh is None:
        if meshes:
            raise ValueError("mesh: the model's parameters are sharded (FSDP2): pass mesh=, the (\"replicate\", "
                             "\"shard\") DeviceMesh whose shard dimension the model was sharded over")
        return None
    check_mesh(mesh)
    plain = [name for name, p in params if not isinstance(p, DTensor)]
    if plain:  # FSDP would not keep them alike inside a node, and a round averages a column only
        raise ValueError(f"mesh: every trainable parameter must be sharded over mesh[\"shard\"] (fully_shard the "
                         f"root module too); not sharded: {', '.join(plain[:3])}{' ...' if len(plain) > 3 else ''}")
    shard = mesh["shard"]
    if any(m.ndim != 1 or m.mesh.tolist() != shard.mesh.tolist() for m in meshes.values()):
        raise ValueError("mesh: the model must be sharded over mesh[\"shard\"] alone (fully_shard(module, "
                         "mesh=mesh[\"shard\"])): sharded over the whole mesh, FSDP would average across the nodes "
                         "every step, where DiLoCo synchronises them every sync_every steps")
    return mesh


def agree_start(params: list[tuple], shards: list[torch.Tensor], mesh, control, who: str = "DiLoCo") -> None:
    """Every rank starts from the same parameters (under HSDP: every rank of a column from
    the same shard), or every rank refuses: a digest of them in this column's row of a
    table, reduced by max and by min on the control plane (a row's two equal only if every
    rank of the column has the same digest). ``who`` names the refusing object."""
    digest = hashlib.sha256()
    for (name, _), local in zip(params, shards):
        digest.update(name.encode())
        digest.update(local.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    columns, column = (1, 0) if mesh is None else (mesh.size(1), mesh.get_local_rank("shard"))
    high, low = np.full((columns, 32), -1.0), np.full((columns, 32), 256.0)  # bytes are 0-255: neutral
    high[column] = low[column] = np.frombuffer(digest.digest(), dtype=np.uint8)
    high = control.allreduce(high.reshape(-1), "acc.diloco.start.max", op="max")
    low = control.allreduce(low.reshape(-1), "acc.diloco.start.min", op="min")
    if not np.array_equal(high, low):
        raise ValueError(f"{who}: the model's parameters differ across ranks at the start; start every rank from "
                         f"the same model (seed it alike, or broadcast rank 0's parameters first)")


class InnerSteps:
    """Counts the inner optimizer's steps (a post-step hook, holding nothing of DiLoCo), so
    that ``DiLoCo.step()`` called with no inner step since its last call is refused:
    called before ``opt.step()``, every round would start one inner step late and the ranks'
    models drift apart with no word."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.steps, self.seen = 0, 0
        self.handle = optimizer.register_step_post_hook(self._count)

    def _count(self, *_args) -> None:
        self.steps += 1

    def check(self, gradients: list[torch.Tensor]) -> None:
        """At ``DiLoCo.step()``: an inner step since the last call, or gradients that are not
        all finite (an AMP GradScaler skipped the step), or a ValueError (every rank running
        the same loop raises it, before any collective)."""
        stepped, self.seen = self.steps > self.seen, self.steps
        if not stepped and all(bool(torch.isfinite(g).all()) for g in gradients):
            raise ValueError("DiLoCo.step(): the inner optimizer has not stepped since the last call; call "
                             "diloco.step() right after each inner_optimizer.step(), on every rank")
