"""Every rank's settings compared once, before the first collective that depends on them.

Ranks started with different settings would issue collectives that never pair (a hang) or
pair the wrong tensors. Instead every rank allgathers its settings (one fixed-size blocking
collective) and, if any differ, every rank raises the same ValueError naming the settings
that differ and which processes (numbered by rank in the job) have which value.
"""

from __future__ import annotations

import hashlib
import json

import torch

CONFIG_BYTES = 1024  # the settings' canonical JSON, zero-padded: one fixed-size allgather


def canonical(settings: dict) -> str:
    return json.dumps(settings, sort_keys=True, default=repr)


def agree(channel, settings: dict) -> None:
    """Compare ``settings`` (plain JSON values) with every rank's; raise the same
    ValueError on every rank if they differ."""
    mine = canonical(settings).encode()
    if len(mine) > CONFIG_BYTES:  # never in practice; still compared exactly
        mine = json.dumps({"config_sha256": hashlib.sha256(mine).hexdigest()}).encode()
    buffer = torch.zeros(CONFIG_BYTES, dtype=torch.uint8)
    buffer[:len(mine)] = torch.tensor(list(mine), dtype=torch.uint8)
    gathered = channel.wait(channel.allgather_async(buffer, name="acc.config"))
    configs = [json.loads(bytes(row.tolist()).rstrip(b"\0")) for row in gathered.view(-1, CONFIG_BYTES)]
    if any(c != configs[0] for c in configs):
        raise ValueError(mismatch_message(configs))


def mismatch_message(configs: list[dict]) -> str:
    """Which settings differ, and which processes have which value (the same text on every rank).
    Processes are called "process N" (N its rank in the job), never "rank N": a codec's
    settings have a ``rank`` of their own (PowerSGD's)."""
    differences = []
    for key in sorted({k for c in configs for k in c}):
        values = [repr(c[key]) if key in c else "(not set)" for c in configs]
        if len(set(values)) == 1:
            continue
        processes_by_value: dict[str, list[int]] = {}
        for process, value in enumerate(values):
            processes_by_value.setdefault(value, []).append(process)
        differences.append(f"{key!r}: " + " vs ".join(
            f"{value} (process{'es' if len(processes) > 1 else ''} {', '.join(map(str, processes))})"
            for value, processes in processes_by_value.items()))
    return ("AccordionCompressor: ranks were started with different compressor settings; every process "
            "must create AccordionCompressor with the same codec and arguments. Differing (process N is the "
            "job's rank N): "
            + "; ".join(differences) + ".")
