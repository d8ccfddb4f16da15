"""The network-aware policy's search (policies/network_aware.py holds the policy, its check
against the clock and its state): the predicted step of a set of per-layer levels, the greedy
search for the fastest one within Accordion's error budget, and why a window's measurements
cannot feed them. Pure functions of a window's reports; every rank computes the same.

The search, from the budget's levels (Accordion's decision): (a) every layer, earliest-ready
first, takes its gentlest level that does not make the predicted step longer; (b) the error
this saved is spent on making layers more aggressive, the move that saves the most predicted
time per unit of error first, while one saves time and fits the budget; (c) (a) again. The
trades of (b) are kept only if they shorten the predicted step by ``min_gain``; every
prediction is made on a link ``headroom`` times slower than the one measured.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

from ..costmodel import Bucket, Link, Round, step_s
from ..levels import Level
from .base import NetworkReport

log = logging.getLogger("accordion_hvd.policies")

_SLACK = 1e-9  # relative: float noise in sums of errors and in simulated times


def choose(budget: dict[str, Level], errors: dict[str, dict[Level, float]], network: NetworkReport, *,
           headroom: float, tolerance: float, min_gain: float, host_s_per_byte: float
           ) -> tuple[dict[str, Level], dict]:
    """The levels of the fastest predicted step within the budget, and what the search saw
    (its predictions, for the policy's ``last``); the four steps of the module doc."""
    link = network.link
    network = replace(network, link=Link(alpha=link.alpha * headroom, beta=link.beta * headroom))
    layers = sorted(budget, key=lambda n: (network.ready_s[n], n))
    # each layer's candidates, gentlest (least error) first; ties keep the cheaper wire; a
    # level with an infinite error cannot carry the layer (float16 for values beyond its range)
    order = {n: sorted((lv for lv in errors[n] if math.isfinite(errors[n][lv])),
                       key=lambda lv: (errors[n][lv], _bytes(network.wire[n][lv]), str(lv)))
             for n in layers}
    limit = sum(errors[n][budget[n]] for n in layers) * (1 + _SLACK)
    levels = dict(budget)
    reference = predict(levels, network, host_s_per_byte)
    ceiling = reference * (1 + tolerance) + _SLACK * reference

    def error(lv):
        return sum(errors[n][lv[n]] for n in layers)

    def gentler():
        for n in layers:
            for candidate in order[n]:  # gentlest first: take the first that costs no time
                if errors[n][candidate] >= errors[n][levels[n]]:
                    break
                trial = {**levels, n: candidate}
                if predict(trial, network, host_s_per_byte) <= ceiling:
                    levels[n] = candidate
                    break

    gentler()
    free = dict(levels)  # gentler where it costs nothing: kept unless the trades below gain enough
    now = predict(levels, network, host_s_per_byte)
    while True:  # spend the saved error where it buys the most time
        best, best_rate = None, 0.0
        spare = limit - error(levels)
        for n in layers:
            for candidate in order[n]:
                extra = errors[n][candidate] - errors[n][levels[n]]
                if extra <= 0 or extra > spare:
                    continue
                trial = {**levels, n: candidate}
                saved = now - predict(trial, network, host_s_per_byte)
                if saved > _SLACK * now and saved / extra > best_rate:
                    best, best_rate = (n, candidate), saved / extra
        if best is None:
            break
        levels[best[0]] = best[1]
        now = predict(levels, network, host_s_per_byte)
    ceiling = min(ceiling, now * (1 + tolerance) + _SLACK * now)
    gentler()
    chosen = predict(levels, network, host_s_per_byte)
    if chosen > reference * (1 - min_gain):  # a gain within the model's error: not worth a trade
        levels, chosen = free, predict(free, network, host_s_per_byte)
    seen = {"predicted_s": chosen, "accordion_s": reference, "error": error(levels), "budget": error(budget),
            "changed": sum(levels[n] != budget[n] for n in layers), "host_s_per_byte": host_s_per_byte,
            "moved": {n: str(levels[n]) for n in layers if levels[n] != budget[n]}}
    log.info("NetworkAware: predicted step %.4f s (Accordion's levels: %.4f s), error %.4g of a budget of %.4g, "
             "%d of %d layers away from Accordion's level", chosen, reference, seen["error"], seen["budget"],
             seen["changed"], len(layers))
    return levels, seen


def predict(levels: dict[str, Level], network: NetworkReport, host_s_per_byte: float = 0.0) -> float:
    """Predicted seconds from the step's first ready gradient to its end, with ``levels``
    (the cost model's step: buckets issued when complete, one collective at a time, each
    round after its layers' math on the main thread, each bucket finished by theirs; a
    layer sent dense is an allreduce of its own, issued when it is ready).
    ``host_s_per_byte``: main-thread seconds charged before each round per byte it sends."""
    host = host_s_per_byte
    buckets = []
    for names in network.buckets:
        rounds: list[list] = []  # [kind, bytes, math seconds before it]
        finish = 0.0
        for n in names:
            wire = network.wire[n][levels[n]]
            kernel = network.kernel_s.get(n, {}).get(levels[n]) or (0.0,) * (len(wire) + 1)
            if wire[0][0] == "dense":  # outside the buckets: its own allreduce when ready
                buckets.append(Bucket(network.ready_s[n], [Round("allreduce", wire[0][1],
                                                                       kernel[0] + host * wire[0][1])],
                                      finish_s=kernel[-1]))
                continue
            for i, (kind, nbytes) in enumerate(wire):
                if i == len(rounds):
                    rounds.append([kind, 0, 0.0])
                rounds[i][1] += nbytes
                rounds[i][2] += kernel[i]
            finish += kernel[-1]
        if rounds:
            ready = max(network.ready_s[n] for n in names)
            buckets.append(Bucket(ready, [Round(kind, nbytes, math_s + host * nbytes)
                                          for kind, nbytes, math_s in rounds], finish_s=finish))
    buckets.sort(key=lambda b: b.ready_s)
    backward = max([network.backward_s, *(b.ready_s for b in buckets)])
    return step_s(0.0, backward, buckets, network.link, network.world)


def _bytes(wire) -> int:
    return sum(nbytes for _, nbytes in wire)


def wire_bytes(levels: dict[str, Level], network: NetworkReport) -> int:
    """Bytes one rank issues per step with ``levels``."""
    return sum(_bytes(network.wire[n][levels[n]]) for n in levels)


def unusable_network(network: NetworkReport | None, budget: dict[str, Level]) -> str | None:
    """Why this window's timings cannot predict a step, or None."""
    if network is None:
        return "no timings in this window (no exchange yet)"
    if network.link is None:
        return "no link measured in this window"
    missing = sorted(n for n in budget if n not in network.ready_s or n not in network.wire)
    if missing:
        return f"no measurements for {', '.join(missing[:3])}"
    timings = [network.backward_s, *(network.ready_s[n] for n in budget)]
    timings += [t for n in budget for kernel in network.kernel_s.get(n, {}).values() for t in kernel]
    if not all(isinstance(t, (int, float)) and math.isfinite(t) and t >= 0 for t in timings):
        return "a timing is negative or not finite"
    if not network.buckets:
        return "no exchange in this window"
    return None


def unusable_errors(errors: dict[str, dict[Level, float]] | None, budget: dict[str, Level]) -> str | None:
    """Why this window's level errors cannot bound a choice, or None."""
    if errors is None:
        return "no level errors in this window"
    missing = sorted(n for n in budget if n not in errors)
    if missing:
        return f"no level errors for {', '.join(missing[:3])}"
    if not all(e >= 0 for n in budget for e in errors[n].values()):  # NaN fails too
        return "a level error is negative or not a number"
    if not all(math.isfinite(errors[n].get(budget[n], math.nan)) for n in budget):
        return "a level Accordion chose has no finite error"
    return None
