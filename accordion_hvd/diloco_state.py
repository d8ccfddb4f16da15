"""``acc.DiLoCo``'s checkpoint (diloco.py): ``state_dict`` and ``load_state_dict``, as the
engine's are apart from it (engine/state.py). A state holds what resumes the outer loop bit for
bit on the same world: the start-of-round parameters (float32), the outer optimizer's momentum,
the counters, the interval policy and its window's statistics, and the compressor's state."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("accordion_hvd.diloco")


def state_dict(diloco) -> dict:
    diloco.flush()
    return {"world": diloco.size, "inner_steps": diloco.inner_steps, "syncs": diloco.syncs,
            "skipped": diloco.skipped, "start": [t.clone() for t in diloco.start], "interval": diloco.interval,
            "since_sync": diloco.since_sync, "outer": diloco.outer.state_dict(),
            "compressor": diloco.compressor.state_dict(),
            **({} if diloco.policy is None else {"policy": diloco.policy.state_dict(),
                                                 "window": diloco.window.state_dict()})}


def load_state_dict(diloco, state: dict) -> None:
    """See ``DiLoCo.load_state_dict``. The one refusal (auto against a fixed interval) comes
    before anything changes."""
    if (diloco.policy is None) != ("policy" not in state):
        raise ValueError("DiLoCo.load_state_dict: the state was saved with sync_every "
                         f"{'auto' if 'policy' in state else state['interval']}, this DiLoCo has "
                         f"{'auto' if diloco.policy is not None else diloco.interval}; resume with the same")
    diloco.drop_in_flight()
    diloco.compressor.load_state_dict(state["compressor"])
    diloco.inner_steps, diloco.syncs, diloco.skipped = state["inner_steps"], state["syncs"], state["skipped"]
    diloco.since_sync = state["since_sync"]
    if diloco.policy is not None:
        diloco.interval = state["interval"]
        diloco.policy.load_state_dict(state["policy"])
        diloco.window.load_state_dict(state["window"])
    elif state["interval"] != diloco.interval:
        log.warning("DiLoCo: the state was saved with sync_every=%d, this job has %d: rounds every %d inner "
                    "steps from now on", state["interval"], diloco.interval, diloco.interval)
    if state["world"] != diloco.size:
        log.warning("DiLoCo: the state was saved by %d ranks, this job has %d: the outer optimizer restarts "
                    "(momentum zero) from the model's parameters", state["world"], diloco.size)
        return diloco.restart()
    with torch.no_grad():
        for start, saved in zip(diloco.start, state["start"]):
            start.copy_(saved)
    outer = diloco.outer
    outer.load_state_dict(state["outer"])  # its momentum; PyTorch restores the saved lr and momentum too:
    saved = outer.param_groups[0]
    if (saved["lr"], saved["momentum"]) != (diloco.outer_lr, diloco.outer_momentum):
        log.warning("DiLoCo: the state was saved with outer_lr=%g, outer_momentum=%g; this job's %g, %g from now "
                    "on", saved["lr"], saved["momentum"], diloco.outer_lr, diloco.outer_momentum)
    for group in outer.param_groups:
        group.update(lr=diloco.outer_lr, momentum=diloco.outer_momentum, nesterov=diloco.nesterov)
