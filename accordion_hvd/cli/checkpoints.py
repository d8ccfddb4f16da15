"""``--checkpoint`` and ``--resume``: one file per rank (error feedback is per rank), written
atomically, read back on any device; every problem ends the run with one line naming the
file and what is wrong with it.

Resuming with another number of ranks works: every rank reads rank 0's file (parameters,
optimizer state, levels, warm-start Q, the controller's and policy's state and the counters
are the same on every rank), and the error feedback, which is each old rank's own unsent
gradient and has no owner in the new world, starts from zero, with a warning saying so.

Under ``--launcher fsdp`` the parameters and optimizer state are sharded: PATH is then a
``torch.distributed.checkpoint`` directory (the model's and optimizer's sharded state, the
compressed all-reduce's per-rank state through its ``Stateful`` hook, the counters), written
into PATH.tmp and moved into place once every rank has written; another mesh reshards the
model and optimizer on load, and the compressor starts again with a warning (accordion_hvd/hsdp.py)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

log = logging.getLogger("accordion_hvd.train")


def checkpoint_path(base: Path, rank: int) -> Path:
    return base.with_name(f"{base.name}.rank{rank}")


def save_checkpoint(path: Path, front, epoch: int, step: int, model, opt, compression, batch) -> None:
    if front.name == "fsdp":
        return _save_sharded(path, front, epoch, step, model, opt, compression)
    state = {"epoch": epoch, "step": step, "world_size": front.size, "model": model.state_dict(),
             "optimizer": opt.state_dict(), "compression": compression.state_dict(),
             "batch": batch.state_dict() if batch is not None else None, "rng": _rng_state(),
             "sync": front.sync_state()}
    target = checkpoint_path(path, front.rank)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(target)  # never a half-written checkpoint


def read_checkpoint(path: Path, source: Path, device: torch.device | None = None) -> dict:
    """One rank's checkpoint file, its tensors on ``device`` (a run saved on a GPU resumes
    on the CPU and back), or SystemExit naming the file and what is wrong with it."""
    try:
        state = torch.load(source, map_location=device, weights_only=False)
        if not isinstance(state, dict) or not {"epoch", "step", "world_size", "model", "optimizer"} <= set(state):
            raise ValueError("not a checkpoint written by --checkpoint")
    except Exception as exc:  # truncated, corrupted, or another program's file
        raise SystemExit(f"--resume {path}: cannot read {source}: {type(exc).__name__}: {exc}") from None
    return state


def load_checkpoint(path: Path, front, model, opt, compression, batch, device: torch.device) -> tuple[int, int]:
    """Restore everything ``save_checkpoint`` wrote; returns (epoch, step) to continue from."""
    if front.name == "fsdp":
        return _load_sharded(path, front, model, opt, compression)
    source = checkpoint_path(path, front.rank)
    first = checkpoint_path(path, 0)
    if not first.is_file():
        raise SystemExit(f"--resume {path}: {first} not found (--checkpoint writes PATH.rank<r>, one file per rank)")
    saved_by = read_checkpoint(path, first, device)["world_size"]
    same_world = saved_by == front.size
    if not same_world:  # rank 0's file for every rank: all it holds but the error feedback is everyone's
        source = first
        log.warning("--resume %s: saved by %d ranks, this run has %d: parameters, optimizer state, levels, "
                    "warm-start Q, the policy's state and the counters come from %s; the error feedback (each old "
                    "rank's gradient not sent yet) cannot be split among the new ranks and starts from zero, so that "
                    "much of the last steps' gradients is lost", path, saved_by, front.size, first.name)
    elif not source.is_file():
        raise SystemExit(f"--resume {path}: {source} not found (one file per rank)")
    state = read_checkpoint(path, source, device)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    try:
        compression.load_state_dict(state.get("compression"), error_feedback=same_world)
    except ValueError as exc:
        raise SystemExit(f"--resume {path}: {exc}") from None
    if (state.get("sync") is None) != (front.sync_state() is None):
        raise SystemExit(f"--resume {path}: saved {'with' if state.get('sync') is not None else 'without'} "
                         f"periodic synchronisation (--sync), this run is {front.name}'s: resume with the same --sync")
    if state.get("sync") is not None:  # DiLoCo's outer loop: start-of-round parameters, outer momentum, interval
        try:
            front.load_sync_state(state["sync"])
        except ValueError as exc:
            raise SystemExit(f"--resume {path}: {exc}") from None
    if batch is not None:
        if state.get("batch") is None:
            raise SystemExit(f"--resume {path}: that run had no --batch-mode")
        batch.load_state_dict(state["batch"])
    if state.get("rng") is not None:  # (checkpoints from before it have none: dropout then differs)
        _set_rng_state(state["rng"])
    front.resumed()
    return state["epoch"], state["step"]


def _rng_state() -> dict:
    """The random streams training draws from (dropout): every rank seeds them alike and draws
    alike, so any rank's state is every rank's."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


# --- --launcher fsdp: torch.distributed.checkpoint ----------------------------------------------

def _sharded_state(front, model, opt, compression, meta: dict) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, opt_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optimizer": opt_sd, "meta": meta, "rng": _rng_state()}
    if front.hook is not None:  # ours: each rank's state under its own key (hsdp.py, cli/periodic.py DiLoCoCheckpoint)
        state["accordion"] = front.hook
    else:  # FSDP's own all-reduce: the floats counted, the same on every rank
        state["meta"]["compression"] = compression.state_dict()
    return state


def _save_sharded(path: Path, front, epoch: int, step: int, model, opt, compression) -> None:
    import torch.distributed.checkpoint as dcp

    tmp = path.with_name(path.name + ".tmp")
    if front.rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    front.dist.barrier()
    meta = {"epoch": epoch, "step": step, "world_size": front.size, "mesh": f"{front.nodes}x{front.size // front.nodes}",
            "sync": front.sync}
    dcp.save(_sharded_state(front, model, opt, compression, meta), checkpoint_id=str(tmp))
    front.dist.barrier()  # every rank has written its shards and DCP its metadata
    if front.rank == 0:  # never a half-written checkpoint at PATH (the old one goes first)
        if path.exists():
            shutil.rmtree(path)
        tmp.replace(path)
    front.dist.barrier()


def _load_sharded(path: Path, front, model, opt, compression) -> tuple[int, int]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if not (path / ".metadata").is_file():
        raise SystemExit(f"--resume {path}: not a checkpoint written by --checkpoint under --launcher fsdp "
                         f"(a torch.distributed.checkpoint directory with its .metadata)")
    meta = {"epoch": 0, "step": 0, "world_size": 0, "mesh": "", "sync": ""}
    state = _sharded_state(front, model, opt, compression, meta)
    try:  # another mesh: the model and optimizer reshard; our hook warns and starts again
        dcp.load(state, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True))
    except Exception as exc:
        raise SystemExit(f"--resume {path}: cannot load it: {type(exc).__name__}: {exc}") from None
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    _set_rng_state(state["rng"])
    meta = state["meta"]
    if (meta["sync"] or "every-step") != front.sync:  # (checkpoints from before it hold no "sync")
        raise SystemExit(f"--resume {path}: saved with --sync {meta['sync'] or 'every-step'}, this run has --sync "
                         f"{front.sync}: resume with the same --sync")
    front.resumed()
    if front.hook is None:
        try:
            compression.load_state_dict(meta.get("compression"))
        except ValueError as exc:
            raise SystemExit(f"--resume {path}: {exc}") from None
    return int(meta["epoch"]), int(meta["step"])
