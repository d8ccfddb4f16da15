"""The link gate's trials on a shaped link: how many steps each rate pays in 16 bits.

A check of issue 80's item 0, not a scored run: the transformer (the v5 task, pilot seed 3) on
2 emulated nodes (benchmarks/cluster, needs root) at each rate, under the per-step default
(``--codec default``, windows of 100 steps, horovodrun) and under ``acc.DiLoCo`` with its
automatic interval (``--sync diloco``: windows of 16 rounds, every round at interval 1 at the
start, torchrun), each stopped after ``--steps`` optimizer steps. Per run it keeps the gate's
verdict line, the steps each level ran, and the bits per parameter per step of the critical
windows (what crossed the wire, from the run's steps.csv). Usage:

    python benchmarks/gate_check.py [--rates 10mbit,1gbit] [--steps 260] [--out DIR]
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "cluster"))
from cluster import Cluster  # noqa: E402
from protocol_costs import per_step  # noqa: E402

PARAMS = 1_405_287  # the transformer's parameters
TASK = ["--dataset", "text", "--model", "transformer", "--optimizer", "adamw", "--epochs", "6", "--lr", "0.001",
        "--lr-milestones", "4", "--batch-size", "32", "--eta", "0.5", "--no-progress", "--evals-per-epoch", "4",
        "--seed", "3"]
METHODS = {"default": ("horovod", ["--codec", "default", "--interval", "100"]),
           "diloco": ("torchrun", ["--launcher", "ddp", "--codec", "default", "--sync", "diloco", "--interval", "16"])}


def one(cluster: Cluster, method: str, steps: int, where: Path) -> dict:
    launcher, flags = METHODS[method]
    where.mkdir(parents=True, exist_ok=True)
    args = ["-m", "accordion_hvd.train", *TASK, *flags, "--max-steps", str(steps), "--logdir", str(where)]
    if launcher == "horovod":
        done = cluster.horovodrun(args, timeout=1800)
        code, out = done.returncode, done.stdout + done.stderr
    else:
        done = cluster.torchrun(args, timeout=1800)
        code = max(r.returncode for r in done.values())
        out = "".join(r.stdout + r.stderr for _, r in sorted(done.items()))
    (where / "log.txt").write_text(out[-30000:])
    with open(where / "steps.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    verdict = next((line.split("link-gate: ", 1)[1] for line in out.splitlines() if "link-gate: " in line
                    and "trials under way" not in line), None)
    levels = [r.get("level/embedding.weight") or "" for r in rows]
    dense_steps = sum(level == "dense16" for level in levels)
    per_step_bits = [8 * b for b in per_step(where)[1]]
    return {"method": method, "rate": cluster.rate, "exit": code, "steps": len(rows), "verdict": verdict,
            "embedding_steps_in_dense16": dense_steps, "embedding_levels_seen": sorted(set(levels)),
            "bits_per_param_step": sum(per_step_bits) / PARAMS / max(len(rows), 1),
            "bits_per_param_step_by_100": [round(sum(per_step_bits[i:i + 100]) / PARAMS / len(per_step_bits[i:i + 100]), 3)
                                           for i in range(0, len(per_step_bits), 100)],
            "seconds": float(rows[-1]["wall_s"]) if rows else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="10mbit,1gbit")
    parser.add_argument("--steps", type=int, default=260)
    parser.add_argument("--methods", default="default,diloco")
    parser.add_argument("--out", type=Path, default=Path("build/gate-check"))
    a = parser.parse_args()
    results = []
    for rate in a.rates.split(","):
        with Cluster(2, rate=rate, prefix="accgc-") as cluster:
            for method in a.methods.split(","):
                result = one(cluster, method, a.steps, a.out / f"{method}-{rate}")
                print(json.dumps(result), flush=True)
                results.append(result)
    (a.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
