"""How well the cost model predicts a step: accordion_hvd/costmodel.py against measured runs.

    .venv/bin/python benchmarks/costmodel_check.py benchmarks/results/costmodel-runs \\
        benchmarks/results/costmodel-runs-4nodes --out benchmarks/results/costmodel.md

Reads the per-run JSON that benchmarks/step_time.py writes. For ours, the step worker
records each collective of the compressor (name, algorithm, bytes, issue and completion
times) and the link the compressor fitted online to those timings
(``AccordionCompressor.measure_link``: latency and bandwidth from the minimum over ranks of
each collective's duration). For every such run and every step 4-12:

* **measured**: the step's wall time;
* **predicted**: ``costmodel.step_s`` fed with that step's compute as measured on every
  rank (forward; backward, with our hooks' math in it; the optimizer step; each less the
  compressor's waits on collectives inside it) and its buckets as rank 0 issued them (when
  each bucket's first round left, after how much of backward; each round's algorithm and
  bytes), on the run's online link. Collectives pair across ranks, so they leave when the
  rank whose backward ends last issues them: that rank's compute drives the simulation,
  rank 0's bucket times stretched to its backward. The network is modelled, compute is
  not: what the model predicts is how much of the communication hides under backward, and
  how long a step waits for the rest and for the slower rank.
* **waits**: the step's waits on collectives, measured (the compressor's own clock) and
  predicted (the predicted step less the compute above): the network part alone, a
  harder test than the step, which compute dominates on this model;
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


def rank_compute(run: dict, s: int) -> list[tuple[float, float, float]]:
    """Each rank's step ``s`` without its waits on collectives: (forward, backward,
    optimizer step) seconds, the part the model takes as measured."""
    out = []
    for r in run.get("ranks") or [run]:
        phase, ours = r["phases"][s], r["ours"][s]
        in_backward = ours.get("comm_backward", 0.0)
        out.append((phase["forward"], max(phase["backward"] - in_backward, 0.0),
                    max(phase["step"] - (ours["comm"] - in_backward), 0.0)))
    return out


def step_buckets(run: dict, s: int, scale: float = 1.0, stretch: float = 1.0) -> list[Bucket]:
    """Step ``s``'s buckets from rank 0's collectives: ``acc.<round>.b<i>.<layers>`` names (P,
    Q, topk, D), in the order their first round left, each ready when rank 0 issued its first
    round (times ``stretch``: on a rank whose backward is that much longer); PowerSGD's
    bytes times ``scale``."""
    t0, phase = run["step_starts"][s], run["phases"][s]
    end, backward_start = t0 + run["walls"][s], t0 + phase["forward"]
    backward = rank_compute(run, s)[0][1]
    found: dict[tuple[str, int], dict] = {}
    for _lane, _seq, name, kind, nbytes, issued, _done in run["collectives"]:
        parts = name.split(".")
        if not t0 <= issued < end or len(parts) != 4 or parts[0] != "acc" or not parts[2][1:].isdigit():
            continue  # another step's, or a control collective (configuration, layouts, learning rates)
        family, index = parts[1], int(parts[2][1:])
        entry = found.setdefault(("P" if family == "Q" else family, index), {"ready": None, "rounds": []})
        factor = scale if family in ("P", "Q") else 1.0
        entry["rounds"].append((family == "Q", Round(kind, nbytes * factor)))
        if family != "Q":  # issued by a hook before any wait of the step: rank 0's compute so far
            entry["ready"] = min(max(issued - backward_start, 0.0), backward) * stretch
    buckets = [Bucket(e["ready"], [r for _, r in sorted(e["rounds"], key=lambda x: x[0])])
               for e in found.values() if e["ready"] is not None]
    return sorted(buckets, key=lambda b: b.ready_s)


def compute_s(run: dict, s: int) -> float:
    """Rank 0's step ``s`` without its waits."""
    return sum(rank_compute(run, s)[0])


def predict(run: dict, s: int, link: Link, scale: float = 1.0, world: int | None = None) -> float:
    """Rank 0's step ``s``: the collectives leave when the rank whose backward ends last
    issues them (its compute; rank 0's buckets, stretched to its backward), and rank 0
    finishes with its own optimizer step. ``world``: another world size than the run's."""
    compute = rank_compute(run, s)
    forward, backward, _ = max(compute, key=lambda c: c[0] + c[1])
    stretch = backward / compute[0][1] if compute[0][1] > 0 else 1.0
    return step_s(forward, backward, step_buckets(run, s, scale, stretch), link, world or run["size"], compute[0][2])


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
    p.add_argument("folders", type=Path, nargs="+")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    from results_archive import restore  # the raw runs: unpacked from their archive if missing
    for folder in args.folders:
        restore(folder)
    rows, errors, cross_errors, wait_errors = [], [], [], []
    runs = {k: v for folder in args.folders for k, v in load(folder).items()}
    for key, methods in runs.items():
        for method, run in sorted(methods.items()):
            if "collectives" not in run:
                continue
            link = online_link(run)
            if link is None:
                rows.append(f"| {key} | {method} | no link: {run.get('link')} | | | | | | |")
                continue
            measured = statistics.median(run["walls"][s] for s in STEPS)
            predicted = statistics.median(predict(run, s, link) for s in STEPS)
            waits = statistics.median(run["ours"][s]["comm"] for s in STEPS)
            predicted_waits = statistics.median(predict(run, s, link) - compute_s(run, s) for s in STEPS)
            error = abs(predicted - measured) / measured
            errors.append(error)
            wait_errors.append(abs(predicted_waits - waits))
            cross = ""
            if method in CROSS and CROSS[method][0] in methods:
                other, scale = CROSS[method]
                want = statistics.median(methods[other]["walls"][s] for s in STEPS)
                got = statistics.median(predict(run, s, link, scale) for s in STEPS)
                cross_errors.append(abs(got - want) / want)
                cross = f"{other}: {got:.3f} vs {want:.3f} ({100 * (got - want) / want:+.1f}%)"
            rows.append(f"| {key} | {method} | {link.alpha * 1e6:.0f} us, {8 / link.beta / 1e6:.0f} Mbit/s "
                        f"| {measured:.3f} | {predicted:.3f} | {100 * (predicted - measured) / measured:+.1f}% "
                        f"| {waits:.3f} | {predicted_waits:.3f} | {cross} |")
    command = "`" + " ".join([".venv/bin/python benchmarks/costmodel_check.py", *map(str, args.folders)]
                             + ([f"--out {args.out}"] if args.out else [])) + "`"
    lines = ["# The cost model against measured steps", "",
             f"Command: {command}. Runs: benchmarks/step_time.py on the emulated cluster (their tables are in the "
             "`.md` files beside their folders). What each column is: the docstring of benchmarks/costmodel_check.py.",
             "", "| run | method | online link | measured (s) | predicted (s) | error | waits measured (s) "
             "| waits predicted (s) | cross-prediction: predicted vs measured |",
             "|---|---|---|---:|---:|---:|---:|---:|---|", *rows, ""]
    for what, values in (("prediction of the run itself", errors), ("cross-prediction", cross_errors)):
        if values:
            med = statistics.median(values)
            lines.append(f"Median absolute error, {what}: **{100 * med:.1f}%** over {len(values)} runs "
                         f"(max {100 * max(values):.1f}%; bar {100 * BAR:.0f}%: {'met' if med <= BAR else 'NOT met'}).")
    if wait_errors:
        lines.append(f"Waits alone: median |predicted - measured| **{1000 * statistics.median(wait_errors):.0f} ms** "
                     f"per step (max {1000 * max(wait_errors):.0f} ms) over {len(wait_errors)} runs.")
    if args.out:  # the hand-written reading below the tables, kept across reruns
        from report import kept_analysis
        lines += kept_analysis(args.out)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
