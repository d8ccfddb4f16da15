"""NetworkAware's bar, from a step_time.py CSV (benchmarks/results/network-aware-protocol.md).

    .venv/bin/python benchmarks/network_aware_bar.py benchmarks/results/network-aware-steps-v7.csv

Per model and link rate, within each round: NetworkAware's step over the fastest of the
peers (Horovod fp16 dense, static gentle PowerSGD rank 4, Accordion), and over Accordion's;
the median over rounds against the bar (at most 1.03x the fastest; below 1.0x Accordion at
100 Mbit/s). Prints a Markdown table (append it to the results file by hand, with a reading).
Where the per-run JSON beside the CSV records NetworkAware's decisions (``verify``), a second
table says, per run, what its check against the clock did: the windows that tried its own
levels, the verdicts, how many of the measured steps ran in those windows, its step over the
same round's Accordion on the steps where both ran Accordion's levels (the machine's noise),
and what a window's end cost it more than Accordion.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from collections import defaultdict
from pathlib import Path

WINDOW = 4  # steps per NetworkAware window in step_worker.py
OURS, PEERS, ACCORDION = "ours-network-aware", ("hvd-fp16", "ours-r4", "ours-accordion"), "ours-accordion"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", type=Path)
    p.add_argument("--ours", default=OURS, help=f"the method held to the bar (default {OURS}; e.g. "
                                                 "ours-network-aware-fp16)")
    args = p.parse_args()
    ours = args.ours
    steps: dict[tuple, dict[str, float]] = defaultdict(dict)
    with open(args.csv) as f:
        for row in csv.DictReader(f):
            if row["step_s"]:
                steps[(row["model"], row["rate"], row["round"])][row["method"]] = float(row["step_s"])
    ratios: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for (model, rate, _), methods in steps.items():
        if ours not in methods or not all(m in methods for m in PEERS):
            continue
        best = min(PEERS, key=methods.get)
        ratios[(model, rate)]["best"].append((methods[ours] / methods[best], best))
        ratios[(model, rate)]["accordion"].append(methods[ours] / methods[ACCORDION])
    flag = "" if ours == OURS else f" --ours {ours}"
    print(f"Command: `.venv/bin/python benchmarks/network_aware_bar.py {args.csv}{flag}`\n")
    print("| model | rate | NetworkAware / fastest peer, per round (which) | median | bar 1.03x | "
          "/ Accordion, per round | median | bar (100 Mbit/s) < 1.0x |")
    print("|---|---|---|---:|---|---|---:|---|")
    for (model, rate), r in sorted(ratios.items()):
        best = statistics.median(x for x, _ in r["best"])
        acc = statistics.median(r["accordion"])
        rounds = ", ".join(f"{x:.3f} ({peer})" for x, peer in r["best"])
        acc_bar = ("met" if acc < 1.0 else "not met") if rate == "100mbit" else "-"
        print(f"| {model} | {rate} | {rounds} | {best:.3f} | {'met' if best <= 1.03 else 'not met'} | "
              f"{', '.join(f'{x:.3f}' for x in r['accordion'])} | {acc:.3f} | {acc_bar} |")

    runs = sorted(args.csv.with_suffix("").glob(f"*-{ours}.json"))
    traced = [(path, json.loads(path.read_text())) for path in runs]
    traced = [(path, run) for path, run in traced if run.get("decisions")]
    if traced:
        print("\n| run | windows trying its own levels (after step) | verdicts: slower (after step) | "
              "measured steps in those windows | / Accordion on the other steps, window ends left out | "
              "window-end step minus Accordion's, median (s) |")
        print("|---|---|---|---:|---:|---:|")
    for path, run in traced:
        decisions = run["decisions"]
        trying = [d["after_step"] for d in decisions if d.get("verified", "").startswith("trying")]
        slower = [d["after_step"] for d in decisions if d.get("verified", "").startswith("measured slower")]
        last = len(run["walls"]) - 2  # the median is over steps 4..last (step_worker.py)
        own = {i for k in trying for i in range(k, k + WINDOW)}  # 0-based steps run at its own levels
        # the same round's Accordion, step by step: where NetworkAware ran Accordion's own levels
        # (leaving out the steps that end a window), any difference is the machine's noise
        peer = json.loads(path.with_name(path.name.replace(ours, ACCORDION)).read_text())["walls"]
        same = [i for i in range(3, last) if i not in own and (i + 1) % WINDOW]
        noise = statistics.median(run["walls"][i] for i in same) / statistics.median(peer[i] for i in same)
        ends = statistics.median(run["walls"][i] - peer[i] for i in range(WINDOW - 1, last, WINDOW))
        print(f"| {path.stem.removesuffix('-' + ours)} | {', '.join(map(str, trying)) or '-'} | "
              f"{', '.join(map(str, slower)) or '-'} | {len(own & set(range(3, last)))} of {last - 3} | "
              f"{noise:.3f} | {ends:+.3f} |")


if __name__ == "__main__":
    main()
