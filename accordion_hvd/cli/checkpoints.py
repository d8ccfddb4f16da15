"""``--checkpoint`` and ``--resume``: one file per rank (error feedback is per rank), written
atomically, read back on any device; every problem ends the run with one line naming the
file and what is wrong with it.

Resuming with another number of ranks works: every rank reads rank 0's file (parameters,
optimizer state, levels, warm-start Q, the controller's and policy's state and the counters
are the same on every rank), and the error feedback, which is each old rank's own unsent
gradient and has no owner in the new world, starts from zero, with a warning saying so."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger("accordion_hvd.train")


def checkpoint_path(base: Path, rank: int) -> Path:
    return base.with_name(f"{base.name}.rank{rank}")


def save_checkpoint(path: Path, front, epoch: int, step: int, model, opt, compression, batch) -> None:
    state = {"epoch": epoch, "step": step, "world_size": front.size, "model": model.state_dict(),
             "optimizer": opt.state_dict(), "compression": compression.state_dict(),
             "batch": batch.state_dict() if batch is not None else None}
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
    if batch is not None:
        if state.get("batch") is None:
            raise SystemExit(f"--resume {path}: that run had no --batch-mode")
        batch.load_state_dict(state["batch"])
    return state["epoch"], state["step"]
