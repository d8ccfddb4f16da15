"""Every rank's settings compared once, before the first collective that depends on them.

Ranks started with different settings would issue collectives that never pair (a hang) or
pair the wrong tensors. Instead every rank allgathers its settings (one fixed-size blocking
collective) and, if any differ, every rank raises the same ValueError naming the settings
that differ and which processes (numbered by rank in the job) have which value.

The same allgather carries, at a job's first step, a digest of the model's parameters
(``parameters_digest``): ranks that start from different parameters (a Horovod user who did
not broadcast rank 0's) would train diverging replicas with no word, so every rank warns,
naming the remedy. A warning, not an error: Horovod itself allows it, and five of its own
optimizer tests train from parameters that differ on purpose (``make peer-tests``). Where some
rank has no digest (a world re-formed by Elastic: the ranks that trained on are past their
first step, and Elastic gave the joiners their parameters), the digests are not compared.
"""

from __future__ import annotations

import hashlib
import json
import logging

import torch

log = logging.getLogger("accordion_hvd.engine")

CONFIG_BYTES = 1024  # the settings' canonical JSON, zero-padded: one fixed-size allgather
START_KEY = "_start_sha256"  # the parameters' digest in the gathered JSON, compared apart


def canonical(settings: dict) -> str:
    return json.dumps(settings, sort_keys=True, default=repr)


def parameters_digest(tensors) -> str:
    """"SHAPES:VALUES", the sha256 of the tensors' shapes and dtypes and that of their bytes, in
    order (parameters on any device). Ranks whose shapes differ have another model: the
    exchange names the layer that differs (exchange/buckets.py), so only values are compared."""
    shapes, values = hashlib.sha256(), hashlib.sha256()
    for t in tensors:
        shapes.update(f"{tuple(t.shape)}{t.dtype};".encode())
        values.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return f"{shapes.hexdigest()[:16]}:{values.hexdigest()}"


def agree(channel, settings: dict, who: str = "AccordionCompressor", start: tuple[str, str] | None = None) -> None:
    """Compare ``settings`` (plain JSON values) with every rank's; raise the same ValueError
    on every rank if they differ, naming ``who`` (the front end the user created). ``start``:
    (this rank's ``parameters_digest``, what to do when they differ), compared where every
    rank has one (module doc)."""
    if len(canonical(settings)) > CONFIG_BYTES - 100:  # never in practice; still compared exactly
        settings = {"config_sha256": hashlib.sha256(canonical(settings).encode()).hexdigest()}
    mine = canonical({**settings, START_KEY: None if start is None else start[0]}).encode()
    buffer = torch.zeros(CONFIG_BYTES, dtype=torch.uint8)
    buffer[:len(mine)] = torch.tensor(list(mine), dtype=torch.uint8)
    gathered = channel.wait(channel.allgather_async(buffer, name="acc.config"))
    configs = [json.loads(bytes(row.tolist()).rstrip(b"\0")) for row in gathered.view(-1, CONFIG_BYTES)]
    starts = [c.pop(START_KEY, None) for c in configs]
    if any(c != configs[0] for c in configs):
        raise ValueError(mismatch_message(configs, who))
    if start is not None and None not in starts and len({d.split(":")[0] for d in starts}) == 1 \
            and len(set(starts)) > 1:
        differ = differences([{"parameters' sha256": f"{digest.split(':')[1][:12]}..."} for digest in starts])
        log.warning("%s: the model's parameters differ across ranks at the first step (%s): each rank trains its own "
                    "replica from them; %s", who, differ, start[1])


def mismatch_message(configs: list[dict], who: str = "AccordionCompressor") -> str:
    """Which settings differ, and which processes have which value (the same text on every rank)."""
    return (f"{who}: ranks were started with different settings; every process must create {who} with the same "
            f"arguments. Differing (process N is the job's rank N): {differences(configs)}.")


def differences(configs: list[dict]) -> str:
    """Each differing key and which processes have which value. Processes are called "process
    N" (N its rank in the job), never "rank N": a codec's settings have a ``rank`` of their own
    (PowerSGD's)."""
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
    return "; ".join(differences)
