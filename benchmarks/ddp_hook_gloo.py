"""Does DDP's ``powerSGD_hook`` run on Gloo with the LM task's default buckets?

The DDP peer (benchmarks/ddp_train.py) failed in every LSTM cell of the step-time runs
(costmodel-runs.md) with the cause unknown. This script tries it a few times, side by side,
at DDP's default buckets and at one bucket, and classifies each try from its output:

    .venv/bin/python benchmarks/ddp_hook_gloo.py --tries 3

Each try is ``torchrun --nproc_per_node 2`` on loopback, ``ddp_train.py --model lstm --rank 1
--max-steps 20``, with a time limit. Writes ``benchmarks/results/ddp-hook-gloo.md`` and each
try's output under ``benchmarks/results/ddp-hook-gloo/``.

Why it fails (the table shows it): with default buckets the LSTM model is two buckets after
DDP's rebuild at step 1, and PowerSGD starts at step 2. The hook issues its P and Q
allreduces from inside future callbacks, which Gloo runs on its worker threads; two buckets'
callbacks then race to issue their allreduces, Gloo numbers collectives in the order they are
issued, and the two ranks pair different tensors ("Received data size doesn't match expected
size ... collective mismatch"), or, with Gloo's 2 threads, every thread blocks in a callback
and the job hangs. One bucket has one callback chain at a time: deterministic. So does a
Gloo group per bucket (``ddp_train.group_per_bucket``, ``--group-per-bucket``), which keeps
DDP's default buckets: each group's collectives come from one chain, in one order.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "results" / "ddp-hook-gloo"
CONFIGS = {  # name: (ddp_train.py's extra arguments, the logs' file prefix)
    "default buckets (2)": ([], "default"),
    "one bucket (--bucket-cap-mb 1000)": (["--bucket-cap-mb", "1000"], "one-bucket"),
    "default buckets (2), a Gloo group per bucket (--group-per-bucket)": (["--group-per-bucket"], "group-per-bucket"),
}


def classify(code: int, output: str) -> str:
    if code == 0 and "final test perplexity" in output:
        return "ran"
    if code == 124:
        return "hung (killed at the time limit)"
    if "doesn't match expected size" in output:
        return "collective mismatch (Gloo EnforceNotMet)"
    return f"failed, exit {code}"


def one_try(extra: list[str], port: int, limit: int) -> tuple[int, str]:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    command = ["timeout", str(limit), sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(port), "--tee", "3", str(REPO / "benchmarks" / "ddp_train.py"),
               "--model", "lstm", "--epochs", "1", "--lr", "0.5", "--rank", "1", "--max-steps", "20", *extra]
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO)
    return done.returncode, done.stdout + done.stderr


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tries", type=int, default=3)
    p.add_argument("--limit", type=int, default=90, help="seconds one try may take")
    args = p.parse_args()
    import torch
    OUT.mkdir(parents=True, exist_ok=True)
    rows, port = [], 29700
    for i in range(args.tries):  # interleaved, so that a noisy moment hits both configurations
        for name, (extra, prefix) in CONFIGS.items():
            port += 1
            code, output = one_try(extra, port, args.limit)
            outcome = classify(code, output)
            log = OUT / f"{prefix}-try{i + 1}.txt"
            ranks_output = [line for line in output.splitlines() if line.startswith("[default")]
            log.write_text("\n".join(ranks_output)[-6000:] + "\n")
            rows.append((name, i + 1, outcome, log.name))
            print(f"{name} try {i + 1}: {outcome}", flush=True)
    lines = ["# DDP's powerSGD_hook on Gloo: default buckets, one bucket, a group per bucket (LM task)", "",
             f"Command: `.venv/bin/python benchmarks/ddp_hook_gloo.py --tries {args.tries}` "
             f"(torch {torch.__version__}, Python {platform.python_version()}, {platform.node()}). "
             "Each try: 2 ranks on loopback, `ddp_train.py --model lstm --rank 1 --max-steps 20`, "
             f"{args.limit} s limit. Why: see the script's docstring.", "",
             "| buckets | try | outcome | log |", "|---|---:|---|---|"]
    lines += [f"| {name} | {i} | {outcome} | `ddp-hook-gloo/{log}` |" for name, i, outcome, log in rows]
    (OUT.parent / "ddp-hook-gloo.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
