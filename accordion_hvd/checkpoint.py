"""Whose a compressor checkpoint is, and the whole world's state in one file.

A compressor's ``state_dict()`` holds each layer's error feedback: the part of this rank's
own gradients not sent yet. It belongs to one rank of one world. The usual Horovod habit
(rank 0 saves, every rank loads that file) would hand rank 0's error feedback to every
rank, silently: every rank would then re-send rank 0's residual and lose its own. So a state
records its ``rank`` and ``world_size``, and loading decides here what to do with it:

* this rank's own state (same rank, same world size): loaded whole;
* another rank's, same world size: refused with a ValueError naming both ranks and saying
  what to do instead;
* another world size (resuming with more or fewer ranks): the error feedback, which has no
  owner in the new world, starts from zero, with a warning; everything else (levels,
  PowerSGD's warm-start Q, the controller's and policy's state, counters) is loaded;
* ``error_feedback=False``: the caller asked for zero error feedback; no question asked.

For one file per job, ``AccordionCompressor.gather_state_dict()`` (collective: every rank
calls it) brings every rank's state to rank 0 as one *world state*; every rank then loads
that file and takes its own part (``own_part``). Rank 0 saves it, as it saves the model.
"""

from __future__ import annotations

import io
import logging
import sys

import torch

WORLD_FORMAT = "accordion_hvd.WorldState/1"
log = logging.getLogger("accordion_hvd.checkpoint")


def current_world(channel) -> tuple[int, int] | None:
    """(rank, size) of this process: the compressor's data plane if it has one, else
    Horovod's world, else torch.distributed's; None before any of them is initialized."""
    if channel is not None:
        return channel.rank, channel.size
    hvd = sys.modules.get("horovod.torch")
    try:
        if hvd is not None and hvd.is_initialized():
            return hvd.rank(), hvd.size()
    except Exception:  # noqa: BLE001 - a half-imported Horovod: not initialized
        pass
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def is_world_state(state) -> bool:
    return isinstance(state, dict) and state.get("format") == WORLD_FORMAT


def own_part(state: dict, world: tuple[int, int] | None, error_feedback: bool) -> tuple[dict, bool]:
    """This rank's part of ``state`` (a rank's state or a world state) and whether its error
    feedback may be kept (see module doc). Raises ValueError for another rank's state."""
    if is_world_state(state):
        ranks = state.get("ranks")
        if not isinstance(ranks, list) or not ranks:
            raise ValueError("AccordionCompressor.load_state_dict: a world state without its ranks' states (corrupted?)")
        if world is None:
            raise ValueError("AccordionCompressor.load_state_dict: a world state (gather_state_dict()) is loaded by "
                             "every rank after hvd.init() (or init_process_group()), so that each takes its own part")
        rank, size = world
        if len(ranks) == size:
            return ranks[rank], error_feedback
        warn_other_world(len(ranks), size)
        return ranks[0], False
    if not isinstance(state, dict):  # load_state_dict says what is wrong with it
        return state, error_feedback
    owner, saved_size = state.get("rank"), state.get("world_size")
    if not error_feedback or world is None or owner is None or saved_size is None:
        return state, error_feedback
    rank, size = world
    if saved_size != size:
        warn_other_world(saved_size, size)
        return state, False
    if owner != rank:
        raise ValueError(mismatch_message(owner, rank))
    return state, True


def mismatch_message(owner: int, rank: int) -> str:
    return (f"AccordionCompressor.load_state_dict: this checkpoint is rank {owner}'s, loaded on rank {rank}: its error "
            f"feedback is rank {owner}'s own unsent gradient, and rank {rank} would send it again and lose its own. "
            f"Save one file per rank (each rank's compression.state_dict()), or one file for the job: "
            f"compression.gather_state_dict() on every rank, saved by rank 0, loaded by every rank with "
            f"load_state_dict(); or pass error_feedback=False to start this rank's error feedback from zero")


def warn_other_world(saved: int, size: int) -> None:
    log.warning("AccordionCompressor.load_state_dict: saved by %d ranks, this job has %d: levels, warm-start Q, the "
                "controller's and policy's state and the counters are loaded; the error feedback (each old rank's "
                "gradient not sent yet) cannot be split among the new ranks and starts from zero", saved, size)


def gather(channel, state: dict) -> dict | None:
    """Every rank's ``state`` at rank 0 as one world state (None on the other ranks).
    Collective on ``channel``: two allgathers (sizes, then the states padded to the
    largest), so every rank briefly holds every state; fine between steps for the error
    feedback of one model per rank."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    mine = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    sizes = channel.wait(channel.allgather_async(torch.tensor([mine.numel()], dtype=torch.int64),
                                                 name="acc.state.sizes")).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[:mine.numel()] = mine
    everyone = channel.wait(channel.allgather_async(padded, name=f"acc.state.{max(sizes)}")).view(len(sizes), -1)
    if channel.rank != 0:
        return None
    ranks = [torch.load(io.BytesIO(row[:n].numpy().tobytes()), weights_only=True) for row, n in zip(everyone, sizes)]
    return {"format": WORLD_FORMAT, "world_size": len(ranks), "ranks": ranks}
