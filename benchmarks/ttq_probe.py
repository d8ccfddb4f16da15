"""Probes that choose a time-to-quality candidate before a protocol amendment (not protocol runs):
an evidence-v2 task (--task: the transformer, or the LSTM) on 2 emulated nodes, the protocol's
CLI arguments cut at --max-steps, seed 0.

    # step time: methods interleaved per round, median step over steps 20..N from steps.csv
    .venv/bin/python benchmarks/ttq_probe.py step --rate 100mbit --steps 80 --rounds 2 \\
        "fp16=--codec fp16" "q8=--codec quantize --bits 8 --policy static" \\
        "default=--codec default --interval 100 --low-rate 0"
    # quality per step: each method's eval.csv, steps.csv and log under --out/<name>/
    .venv/bin/python benchmarks/ttq_probe.py quality --rate 100mbit --steps 448 \\
        --out benchmarks/results/evidence-v2/probes "q8=--codec quantize --bits 8 --policy static"

(Amendment 4's 4-bit probe ran the quality mode with probes/q4-simulation.patch applied:
4 bits stored in int8, so its bytes, and its step time, are not 4 bits'.)
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "benchmarks" / "cluster"))
from cluster import Cluster  # noqa: E402
from time_to_quality import COMMON, TASKS  # noqa: E402


def run(cluster, task: str, cli: str, steps: int, logdir: Path):
    args = ["-m", "accordion_hvd.train", *TASKS[task]["args"], *COMMON, *cli.split(),
            "--seed", "0", "--max-steps", str(steps), "--logdir", str(logdir)]
    return cluster.horovodrun(args, timeout=1800)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("step", "quality"))
    p.add_argument("--task", choices=sorted(TASKS), default="transformer")
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--rounds", type=int, default=2, help="step mode: interleaved rounds")
    p.add_argument("--out", type=Path, default=None, help="quality mode: where each method's files go")
    p.add_argument("methods", nargs="+", help="NAME=CLI ARGUMENTS")
    args = p.parse_args()
    methods = dict(m.split("=", 1) for m in args.methods)
    medians: dict[str, list[float]] = {}
    with Cluster(2, rate=args.rate, prefix="accprobe-") as cluster:
        for r in range(args.rounds if args.mode == "step" else 1):
            for name, cli in methods.items():
                with tempfile.TemporaryDirectory() as tmp:
                    result = run(cluster, args.task, cli, args.steps, Path(tmp))
                    if args.mode == "quality":
                        dst = (args.out or Path(tmp)) / f"{args.task}-{args.rate}-{args.steps}steps-{name}"
                        dst.mkdir(parents=True, exist_ok=True)
                        (dst / "log.txt").write_text((result.stdout + result.stderr)[-3000:])
                        for f in ("eval.csv", "steps.csv"):
                            if (Path(tmp) / f).exists():
                                shutil.copy(Path(tmp) / f, dst / f)
                        print(name, "exit", result.returncode, "->", dst, flush=True)
                        continue
                    if result.returncode != 0:
                        print(name, "FAILED", (result.stdout + result.stderr)[-2000:], flush=True)
                        continue
                    rows = list(csv.DictReader(open(Path(tmp) / "steps.csv")))
                    walls = [float(x["wall_s"]) for x in rows]
                    gaps = [b - a for a, b in zip(walls, walls[1:])][20:]
                    medians.setdefault(name, []).append(statistics.median(gaps))
                    print(f"round {r} {name}: median step {medians[name][-1]:.3f} s (n={len(gaps)}), "
                          f"floats {rows[-1]['floats_sent']}", flush=True)
    if medians:
        print(json.dumps(medians))


if __name__ == "__main__":
    main()
