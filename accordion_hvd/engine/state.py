"""The engine's checkpoint and statistics: ``state_dict``, ``load_state_dict``, ``stats``.

A state holds everything needed to resume bit for bit (each layer's codec state: error
feedback, warm-start Q, level; the controller's and policy's state; the counters), as plain
Python values and tensors, and says whose it is (rank, world size): accordion_hvd/checkpoint.py
has the rules for another rank's or another world's state.
"""

from __future__ import annotations

import torch

from .. import checkpoint
from ..checkpoint import current_world
from ..counters import Counters
from ..levels import DENSE, DENSE16
from .settings import canonical
from .whole import WholeBuffers

FORMAT = "accordion_hvd.AccordionCompressor/2"  # /2: levels as [kind, factor], not strings


def state_dict(engine) -> dict:
    engine.between.check("state_dict")
    world = current_world(engine.planes.channel_if_made)
    counters = engine.counters.state_dict()
    return {"format": FORMAT, "config": engine.config(), "steps": counters.pop("steps"),
            "rank": None if world is None else world[0], "world_size": None if world is None else world[1],
            "skipped_steps": engine.faults.count, **counters, "reported_lrs": engine.lrs.reported,
            "layers": {n: engine.codec.state_to_dict(s) for n, s in sorted(engine.layers.items())},
            "whole": engine.whole.state_dict(),  # flat buffers' error feedback (engine/whole.py)
            "controller": engine.controller.state_dict()}


def load_state_dict(engine, state: dict, error_feedback: bool = True) -> None:
    """See ``AccordionCompressor.load_state_dict``. Reads everything before changing anything:
    a malformed or mismatched state leaves the engine as it was."""
    engine.between.check("load_state_dict")
    world = current_world(engine.planes.channel_if_made)
    state, error_feedback = checkpoint.own_part(state, world, error_feedback)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else None
        raise ValueError(f"AccordionCompressor.load_state_dict: not an AccordionCompressor state_dict of this "
                         f"version (expected a dict with format={FORMAT!r}, got format={found!r})")
    mine = engine.config()
    theirs = state.get("config")
    if not isinstance(theirs, dict):
        raise ValueError("AccordionCompressor.load_state_dict: the state_dict has no 'config' dict (corrupted?)")
    if canonical(theirs) != canonical(mine):
        differing = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        raise ValueError("AccordionCompressor.load_state_dict: the checkpoint was made with different settings: "
                         + "; ".join(f"{k}: checkpoint {theirs.get(k)!r}, this compressor {mine.get(k)!r}"
                                     for k in differing))
    before = engine.controller.state_dict()
    try:
        layers = {str(n): engine.codec.state_from_dict(str(n), d) for n, d in state["layers"].items()}
        for n, layer in layers.items():
            if not bool(torch.isfinite(layer.residual).all()):
                raise ValueError(f"the error feedback of {n!r} is not finite")
        whole = WholeBuffers.parse(state.get("whole", {}))  # absent before the settled route existed
        counters = Counters.parse(state)
        skipped = int(state.get("skipped_steps", 0))
        reported = state["reported_lrs"]
        engine.controller.load_state_dict(state["controller"])
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        engine.controller.load_state_dict(before)
        what = f"missing entry {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ValueError(f"AccordionCompressor.load_state_dict: malformed state_dict ({what}); "
                         f"nothing was loaded") from exc
    if not error_feedback:
        for layer in layers.values():
            layer.residual.zero_()
        whole = {}
    # In place: read-only views of these (the network probe's) stay current.
    engine.layers.clear()
    engine.layers.update(layers)
    engine.whole.load(whole)
    engine.counters.load(counters)
    engine.faults.load(skipped)
    engine.lrs.load(reported)
    # Whose error feedback this is, checked against the data plane's rank at the first step
    # when no world was known at load time (loaded before hvd.init()).
    engine.loaded_owner = (state.get("rank"), state.get("world_size")) if error_feedback and world is None else None


def check_loaded_owner(engine) -> None:
    """A state loaded before this process knew its rank: whose it is, now that it does."""
    owner, engine.loaded_owner = engine.loaded_owner, None
    if owner is None:
        return
    # The same rule as at load time (checkpoint.own_part): raises for another rank's state.
    _, keep = checkpoint.own_part({"rank": owner[0], "world_size": owner[1]},
                                  (engine.channel.rank, engine.channel.size), error_feedback=True)
    if not keep:
        for layer in engine.layers.values():
            layer.residual.zero_()
        engine.whole.load({})


def stats(engine) -> dict:
    """See ``AccordionCompressor.stats``."""
    unused = engine.controller.unused()
    counters = engine.counters
    link = engine.between.link
    return {
        **counters.totals(),
        "steps": counters.steps,
        "skipped_steps": engine.faults.count,
        "layers": {n: {**counters.layer(n), "level": str(engine.layers[n].level if n in engine.layers else
                                                         DENSE16 if n in engine.whole.names else DENSE),
                       "unused": n in unused}
                   for n in sorted(counters.dense)},
        "link": None if link is None else {
            "latency_s": link.link.alpha, "bytes_per_s": 1.0 / link.link.beta, "collectives": link.collectives},
        "gate": engine.policy.verdict(),
    }
