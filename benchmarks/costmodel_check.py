"""How well the cost model predicts a step: accordion_hvd/costmodel.py against measured runs.

    .venv/bin/python benchmarks/costmodel_check.py benchmarks/results/costmodel-runs \\
        --out benchmarks/results/costmodel.md

Reads the per-run JSON that benchmarks/step_time.py writes. For ours, the step worker
records each collective of the compressor (name, algorithm, bytes, issue and completion
times) and the link the compressor fitted online to those timings
(``AccordionCompressor.measure_link``: latency and bandwidth from the minimum over ranks of
each collective's duration). For every such run and every step 4-12:

* **measured**: the step's wall time;
* **predicted**: ``costmodel.step_s`` fed with that step's compute as measured (forward;
  backward, with our hooks' math in it; the optimizer step less the compressor's waits on
  collectives) and its buckets as the step issued them (when each bucket's first round
  left, after how much of backward; each round's algorithm and bytes), on the run's online
  link. The network is modelled, compute is not: what the model predicts is how much of
  the communication hides under backward and how long the step waits for the rest.
* **cross**: a PowerSGD run predicts the other static rank's run in the same round (its P
  and Q rounds carry exactly 4x, or a quarter, the bytes): the question a network-aware
  policy asks of the model before it switches a level.

The error of a run is |median predicted - median measured| / median measured. The issue's
bar: median absolute error at most 15% on the emulated cluster.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from accordion_hvd.costmodel import Bucket, Link, Round, step_s  # noqa: E402

STEPS = range(3, 12)  # steps 4-12, as step_time.py's step_s
BAR = 0.15
CROSS = {"ours-r1": ("ours-r4", 4.0), "ours-r4": ("ours-r1", 0.25)}  # PowerSGD's bytes scale with the rank


def online_link(run: dict) -> Link | None:
    link = run.get("link") or {}
    if "bytes_per_s" not in link:
        return None
    return Link(alpha=link["latency_s"], beta=1.0 / link["bytes_per_s"])


def step_buckets(run: dict, s: int, scale: float = 1.0) -> list[Bucket]:
    """Step ``s``'s buckets from its collectives: ``acc.<round>.b<i>.<layers>`` names (P, Q,
    topk, D), in the order their first round left; PowerSGD's bytes times ``scale``."""
    t0, phase = run["step_starts"][s], run["phases"][s]
    end, backward_start = t0 + run["walls"][s], t0 + phase["forward"]
    found: dict[tuple[str, int], dict] = {}
    for _lane, _seq, name, kind, nbytes, issued, _done in run["collectives"]:
        parts = name.split(".")
        if not t0 <= issued < end or len(parts) != 4 or parts[0] != "acc" or not parts[2][1:].isdigit():
            continue  # another step's, or a control collective (configuration, layouts, learning rates)
        family, index = parts[1], int(parts[2][1:])
        entry = found.setdefault(("P" if family == "Q" else family, index), {"ready": None, "rounds": []})
        factor = scale if family in ("P", "Q") else 1.0
        entry["rounds"].append((family == "Q", Round(kind, nbytes * factor)))
        if family != "Q":
            entry["ready"] = min(max(issued - backward_start, 0.0), phase["backward"])
    buckets = [Bucket(e["ready"], [r for _, r in sorted(e["rounds"], key=lambda x: x[0])])
               for e in found.values() if e["ready"] is not None]
    return sorted(buckets, key=lambda b: b.ready_s)


def predict(run: dict, s: int, link: Link, scale: float = 1.0) -> float:
    phase, ours = run["phases"][s], run["ours"][s]
    optimizer = max(phase["step"] - ours["comm"], 0.0)  # decode and SGD; the waits are the model's to predict
    return step_s(phase["forward"], phase["backward"], step_buckets(run, s, scale), link, run["size"], optimizer)


def load(folder: Path) -> dict[str, dict[str, dict]]:
    """setting-round -> method -> run, for the files ``<setting>-r<round>-<method>.json``."""
    out: dict[str, dict[str, dict]] = {}
    for path in sorted(folder.glob("*.json")):
        stem = path.name[:-len(".json")]
        head, _, method = stem.partition("-r")
        round_, _, method = method.partition("-")
        out.setdefault(f"{head}-r{round_}", {})[method] = json.loads(path.read_text())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    rows, errors, cross_errors = [], [], []
    for key, methods in load(args.folder).items():
        for method, run in sorted(methods.items()):
            if "collectives" not in run:
                continue
            link = online_link(run)
            if link is None:
                rows.append(f"| {key} | {method} | no link: {run.get('link')} | | | | |")
                continue
            measured = statistics.median(run["walls"][s] for s in STEPS)
            predicted = statistics.median(predict(run, s, link) for s in STEPS)
            waits = statistics.median(run["ours"][s]["comm"] for s in STEPS)
            error = abs(predicted - measured) / measured
            errors.append(error)
            cross = ""
            if method in CROSS and CROSS[method][0] in methods:
                other, scale = CROSS[method]
                want = statistics.median(methods[other]["walls"][s] for s in STEPS)
                got = statistics.median(predict(run, s, link, scale) for s in STEPS)
                cross_errors.append(abs(got - want) / want)
                cross = f"{other}: {got:.3f} vs {want:.3f} ({100 * (got - want) / want:+.1f}%)"
            rows.append(f"| {key} | {method} | {link.alpha * 1e6:.0f} us, {8 / link.beta / 1e6:.0f} Mbit/s "
                        f"| {measured:.3f} | {predicted:.3f} | {100 * (predicted - measured) / measured:+.1f}% "
                        f"| {waits:.3f} | {cross} |")
    lines = ["| run | method | online link | measured (s) | predicted (s) | error | measured waits (s) "
             "| cross-prediction: predicted vs measured |", "|---|---|---|---:|---:|---:|---:|---|", *rows, ""]
    for what, values in (("prediction of the run itself", errors), ("cross-prediction", cross_errors)):
        if values:
            med = statistics.median(values)
            lines.append(f"Median absolute error, {what}: **{100 * med:.1f}%** over {len(values)} runs "
                         f"(max {100 * max(values):.1f}%; bar {100 * BAR:.0f}%: {'met' if med <= BAR else 'NOT met'}).")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
