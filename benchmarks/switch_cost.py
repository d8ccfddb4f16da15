"""Does a level switch itself cost accuracy? PowerSGD rank 4 -> rank 1, side by side.

    .venv/bin/python benchmarks/switch_cost.py --seeds 0,1 --epochs 10

On the synthetic task, Accordion's runs sat below static rank 1 for several epochs after
switching from rank 4 to rank 1. That could be the switch (the error feedback built at rank
4, or the Q columns kept from it), or noise. This isolates the switch: a scheduled policy
keeps every compressed layer at rank 4 for the first ``--after`` epochs and at rank 1 after
(no norms, no learning-rate rule), against static rank 1 and against two variants that
reset state at the switch: error feedback zeroed (``reset e``) or Q drawn afresh instead of
keeping its first column (``reset Q``). Every run is the training CLI under horovodrun (no
learning-rate decay). Writes benchmarks/results/switch-cost-<dataset>.md and a CSV.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
BIN = Path(sys.executable).parent
VARIANTS = {  # label -> (epochs at rank 4 first, what is reset at the switch)
    "static rank 1": (0, ""),
    "rank 4 then 1": (None, ""),
    "rank 4 then 1, reset e": (None, "e"),
    "rank 4 then 1, reset Q": (None, "q"),
}


def worker(after: int, reset: str, train_argv: list[str]) -> None:
    """One training run (under horovodrun) with the scheduled policy."""
    from accordion_hvd.cli import train
    from accordion_hvd.codecs import PowerSGD
    from accordion_hvd.levels import CRITICAL, NORMAL
    from accordion_hvd.codecs.powersgd import _as_transposed
    from accordion_hvd import AccordionCompressor
    from accordion_hvd.policies.base import Policy

    class FirstWindows(Policy):
        """The gentle level for the first ``after`` windows, then the aggressive one."""
        name, uses_norms, reacts_to_lr = "first-windows", False, False

        def __init__(self) -> None:
            self.windows = 0

        def config(self) -> dict:
            return {"policy": self.name, "after": after, "reset": reset}

        def initial_level(self, layer: str) -> str:
            return CRITICAL if after > 0 else NORMAL

        def end_window(self, report) -> dict[str, str]:
            self.windows += 1
            return {layer: CRITICAL if self.windows < after else NORMAL for layer in report.norms}

    class Resetting(PowerSGD):
        def set_level(self, state, level: str) -> None:
            down = self.level_rank(level, state.shape) < state.rank
            super().set_level(state, level)
            if down and reset == "e":
                state.residual.zero_()
            elif down and reset == "q":
                state.q = _as_transposed(self._fresh_columns(state.name, state.q.shape[0], 0, state.rank,
                                                             state.q.dtype, state.q.device))

    train.make_compression = lambda args: AccordionCompressor(Resetting(1, 4), policy=FirstWindows(), interval=None)
    train.main(train_argv)


def run(label: str, after: int, reset: str, seed: int, args) -> list[float]:
    logdir = RESULTS / f"switch-cost-{args.dataset}" / "runs" / f"{label.replace(' ', '-').replace(',', '')}-seed{seed}"
    cmd = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, __file__,
           "--worker", str(after), reset or "-", "--", "--codec", "powersgd", "--rank", "1", "--critical-rank", "4",
           "--dataset", args.dataset, "--epochs", str(args.epochs), "--seed", str(seed), "--no-progress",
           "--logdir", str(logdir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{label}, seed {seed} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    with open(logdir / "eval.csv") as f:
        return [float(row["accuracy"]) for row in csv.DictReader(f)]


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(int(argv[1]), "" if argv[2] == "-" else argv[2], argv[4:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="synthetic")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--after", type=int, default=2, help="epochs at rank 4 before the switch")
    p.add_argument("--seeds", default="0,1")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    curves: dict[str, list[list[float]]] = {}
    for seed in seeds:
        for label, (after, reset) in VARIANTS.items():
            curve = run(label, args.after if after is None else after, reset, seed, args)
            curves.setdefault(label, []).append(curve)
            print(f"{label:24s} seed {seed}: " + " ".join(f"{100 * a:.1f}" for a in curve), flush=True)
    write_report(args, seeds, curves)


def write_report(args, seeds: list[int], curves: dict[str, list[list[float]]]) -> None:
    from machine import cpu_model
    from report import kept_analysis

    after = slice(args.after, None)  # the epochs after the switch
    head = "| run | " + " | ".join(str(e + 1) for e in range(args.epochs)) + " | after the switch |"
    table = [head, "| --- |" + " ---: |" * (args.epochs + 1)]
    base = [statistics.mean(c[after]) for c in curves["static rank 1"]]
    for label, runs in curves.items():
        per_epoch = [100 * statistics.mean(c[e] for c in runs) for e in range(args.epochs)]
        mean_after = [statistics.mean(c[after]) for c in runs]
        diff = ", ".join(f"{100 * (m - b):+.2f}" for m, b in zip(mean_after, base))
        table.append(f"| {label} | " + " | ".join(f"{a:.1f}" for a in per_epoch)
                     + f" | {100 * statistics.mean(mean_after):.2f} ({diff}) |")
    out = RESULTS / f"switch-cost-{args.dataset}.md"
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "seed", *(f"epoch{e + 1}" for e in range(args.epochs))])
        for label, runs in curves.items():
            writer.writerows([label, seed, *c] for seed, c in zip(seeds, runs))
    text = [f"# Does switching PowerSGD from rank 4 to rank 1 cost accuracy? ({args.dataset}, 2 ranks)", "",
            f"Machine: {cpu_model()}, {os.cpu_count()} cores. Command: `.venv/bin/python "
            f"benchmarks/switch_cost.py {' '.join(sys.argv[1:])}`. Test accuracy (%) after each epoch, mean over "
            f"seeds {seeds}; rank 4 for the first {args.after} epochs, then rank 1; no learning-rate decay. "
            f"*After the switch*: the mean over epochs {args.after + 1}-{args.epochs}, and in brackets, per seed, "
            f"its difference from static rank 1 in points.", "", *table]
    out.write_text("\n".join(text + kept_analysis(out)) + "\n")
    print("\n".join(text))


if __name__ == "__main__":
    main()
