"""Why PowerSGD's Accordion loses on the LSTM (issue 45, item 4): per layer and per detection
window, the rule's statistic (the relative change of the layer's window gradient norm), the
level it chose, the compression error relative to the gradient, and validation perplexity.

    .venv/bin/python benchmarks/diagnose_accordion.py                 # both configurations, seed 0
    .venv/bin/python benchmarks/diagnose_accordion.py --configs v1 --seed 1

Each configuration is one training run of the CLI (``python -m accordion_hvd.train``, the
evidence-v2 LSTM task: 6 epochs, SGD with momentum, lr x0.1 at epoch 4, 4 evaluations per
epoch) under ``horovodrun -np 2`` on this machine (no emulated link: this is about quality,
not time), with two recorders put in place of the codec and the policy, both subclasses that
change nothing they compute:

* ``RecordingPowerSGD`` notes, per layer and step on rank 0, the norms of the gradient and of
  M = grad + e as the step starts, and of the error feedback the step left (what the layer's
  result did not carry): over |M|, the step's relative compression error; over |grad|, how
  many steps' worth of gradient the layer owes;
* ``RecordingAccordion`` notes, at every window's end, each layer's window norm, the rule's
  statistic ``|prev - new| / prev`` and the level it chose.

Configurations: ``v1``, evidence-v1's (rank 1 <-> 4, one window per epoch) and ``default``'s
codec levels under plain Accordion with the same windows (rank 16 <-> 32), for the contrast.
Results: ``benchmarks/results/diagnose-accordion/CONFIG-seedS/`` (the run's CSVs and
``diagnosis.json``), one PNG per configuration, and ``benchmarks/results/diagnose-accordion.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "results" / "diagnose-accordion"
TASK = ["--dataset", "text", "--model", "lstm", "--epochs", "6", "--lr", "0.5", "--lr-milestones", "4",
        "--batch-size", "32", "--interval", "0", "--eta", "0.5", "--evals-per-epoch", "4", "--no-progress",
        "--codec", "powersgd"]
CONFIGS = {"v1": ["--rank", "1", "--critical-rank", "4"], "default": ["--rank", "16", "--critical-rank", "32"]}


# --- the worker: the CLI with recorders --------------------------------------------------------
def worker(argv: list[str], record_to: str) -> None:
    import torch

    import accordion_hvd as acc
    from accordion_hvd.cli import train as cli
    from accordion_hvd.policies import Accordion

    rank = int(os.environ.get("HOROVOD_RANK", "0"))
    steps: dict[str, list] = {}     # layer -> [(|M|, |e| of the step before)], one per step
    windows: list[dict] = []

    class RecordingPowerSGD(acc.PowerSGD):
        """Both ways a step starts: one layer (``start``) or a bucket's layers in one call."""
        def start(self, state, grad, finite=None):
            before = float(state.residual.norm())          # e: what the last step did not carry
            p = super().start(state, grad, finite)
            steps.setdefault(state.name, []).append([float(state.residual.norm()), before, float(grad.norm())])
            return p

        def start_many(self, states, grads, finite):
            before = [float(s.residual.norm()) for s in states]
            payload = super().start_many(states, grads, finite)
            for s, b, g in zip(states, before, grads):
                steps.setdefault(s.name, []).append([float(s.residual.norm()), b, float(g.norm())])
            return payload

    class RecordingAccordion(Accordion):
        def end_window(self, report):
            prev = dict(self._prev)
            levels = super().end_window(report)
            windows.append({"steps": report.steps, "layers": {
                name: {"norm": norm, "change": (abs(prev[name] - norm) / prev[name]
                                                if prev.get(name) else None), "level": str(levels[name])}
                for name, norm in report.norms.items()}})
            return levels

        def lr_decreased(self, layers):
            windows.append({"lr_decreased_after_windows": len(windows)})
            return super().lr_decreased(layers)

    def make_compression(args):
        return acc.AccordionCompressor(RecordingPowerSGD(args.rank, args.critical_rank),
                                       policy=RecordingAccordion(args.eta), eta=args.eta,
                                       interval=None if args.interval == 0 else args.interval)

    cli.make_compression = make_compression
    torch.set_num_threads(1)
    cli.main(argv)
    if rank == 0:
        # step k's error feedback |e| (read as step k+1 starts) over |M| = |g + e| of step k, and
        # over |g| of step k: how many steps' worth of gradient the layer owes
        errors = {name: [b / m if m > 0 else 0.0 for (m, _, _), (_, b, _) in zip(rows, rows[1:])]
                  for name, rows in steps.items()}
        owed = {name: [b / g if g > 0 else 0.0 for (_, _, g), (_, b, _) in zip(rows, rows[1:])]
                for name, rows in steps.items()}
        Path(record_to).write_text(json.dumps({"windows": windows, "relative_error": errors, "owed": owed}) + "\n")


# --- the parent: run, then read -----------------------------------------------------------------
def run(config: str, seed: int) -> Path:
    where = OUT / f"{config}-seed{seed}"
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "diagnosis.json"
        cmd = [str(REPO / ".venv" / "bin" / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
               sys.executable, str(Path(__file__).resolve()), "--worker", str(record), "--",
               *TASK, *CONFIGS[config], "--seed", str(seed), "--logdir", tmp]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=7200)
        where.mkdir(parents=True, exist_ok=True)
        (where / "log.txt").write_text((result.stdout + result.stderr)[-20000:])
        if result.returncode != 0:
            raise SystemExit(f"{config} seed {seed}: exit {result.returncode}; see {where / 'log.txt'}")
        for name in ("eval.csv", "steps.csv", "diagnosis.json"):
            shutil.copy(Path(tmp) / name, where / name)
    return where


def per_window(where: Path) -> tuple[list[dict], dict[str, list[float]], list[tuple[float, float]]]:
    """Windows (without the learning-rate markers), each layer's mean relative error per
    window (steps split by the windows' lengths), and (epoch, validation perplexity)."""
    import csv

    d = json.loads((where / "diagnosis.json").read_text())
    wins = [w for w in d["windows"] if "layers" in w]
    def by_window(series):
        out = {}
        for name, values in series.items():
            means, at = [], 0
            for w in wins:
                chunk = values[at:at + w["steps"]]
                means.append(sum(chunk) / len(chunk) if chunk else math.nan)
                at += w["steps"]
            out[name] = means
        return out
    errors = by_window(d["relative_error"])
    owed = by_window(d.get("owed", {}))
    with open(where / "eval.csv") as f:
        rows = list(csv.DictReader(f))
    per_epoch = max(1, len(rows) // 6)
    valid = [((i + 1) / per_epoch, float(r["perplexity"])) for i, r in enumerate(rows)]
    return wins, errors, owed, valid


def plot(config: str, where: Path, png: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wins, errors, owed, valid = per_window(where)
    layers = [n for n in wins[0]["layers"]]
    xs = list(range(1, len(wins) + 1))
    fig, axes = plt.subplots(5, 1, figsize=(8, 12), sharex=True)
    for i, name in enumerate(layers):
        ch = [w["layers"][name]["change"] for w in wins]
        axes[0].plot(xs, [math.nan if c is None else c for c in ch], "o-", color=f"C{i}", label=name)
        axes[1].plot(xs, [1 if w["layers"][name]["level"] == "critical" else 0 for w in wins], "o-",
                     color=f"C{i}", alpha=0.7)
        axes[2].plot(xs, errors.get(name, [math.nan] * len(xs)), "o-", color=f"C{i}")
        axes[3].plot(xs, owed.get(name, [math.nan] * len(xs)), "o-", color=f"C{i}")
    axes[0].axhline(0.5, color="black", linewidth=1, label="eta")
    axes[0].set(ylabel="|prev - new| / prev", yscale="log")
    axes[1].set(ylabel="level chosen\n(1 critical, 0 normal)", ylim=(-0.2, 1.2))
    axes[2].set(ylabel="relative compression\nerror |e| / |g + e|", ylim=(0, 1))
    axes[3].set(ylabel="error feedback over\nthe step's gradient |e| / |g|", yscale="log")
    axes[4].plot([e for e, _ in valid], [p for _, p in valid], "k.-")
    axes[4].set(ylabel="validation perplexity", xlabel="window (epoch) at whose end the level was chosen")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"PowerSGD Accordion on the LSTM: {config} ({' '.join(CONFIGS[config])})")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    lines = [f"### {config}: `{' '.join(CONFIGS[config])}`", "", f"![{config}]({png.parent.name}/{png.name})", "",
             "| window | " + " | ".join(layers) + " |", "|---|" + "---|" * len(layers)]
    for k, w in enumerate(wins):
        cells = []
        for name in layers:
            c = w["layers"][name]["change"]
            cells.append(f"{'-' if c is None else f'{c:.2f}'} → {w['layers'][name]['level']}, "
                         f"err {errors.get(name, [math.nan] * len(wins))[k]:.2f}, "
                         f"owed {owed.get(name, [math.nan] * len(wins))[k]:.1f}")
        lines.append(f"| {k + 1} | " + " | ".join(cells) + " |")
    lines += ["", "Validation perplexity per evaluation: " + ", ".join(f"{p:.1f}" for _, p in valid), ""]
    return lines


def main() -> None:
    if "--worker" in sys.argv:
        at = sys.argv.index("--worker")
        worker(sys.argv[at + 3:], sys.argv[at + 1])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help="of: " + ", ".join(CONFIGS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-only", action="store_true", help="only redraw from the recorded runs")
    args = p.parse_args()
    from results_archive import restore  # the raw runs: unpacked from their archive if missing
    restore(OUT)
    lines = ["# PowerSGD Accordion on the LSTM, window by window", "",
             "`.venv/bin/python benchmarks/diagnose_accordion.py` (see its docstring). Per window: the rule's "
             "statistic → the level chosen for the next window, the mean relative compression error |e| / |g + e| "
             "of the window's steps, and the error feedback over the step's own gradient |e| / |g| (how many "
             "steps' worth of gradient the layer owes; rank 0). A learning-rate decay makes every layer "
             "critical until the next window's end (not shown in the level).", ""]
    for config in args.configs.split(","):
        where = OUT / f"{config}-seed{args.seed}"
        if not args.report_only:
            where = run(config, args.seed)
        lines += plot(config, where, OUT / f"{config}-seed{args.seed}.png")
    (OUT.parent / "diagnose-accordion.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
