"""Where a training step's time goes: each phase of the step, for variants that switch one
thing at a time (Horovod's cycle, our data plane), on the emulated cluster.

    .venv/bin/python benchmarks/step_profile.py                    # 2 nodes, 100 Mbit/s, 2 rounds
    .venv/bin/python benchmarks/step_profile.py --rounds 1 --out /tmp/profile.md
    .venv/bin/python benchmarks/step_profile.py --set threads --rounds 3 \
        --out benchmarks/results/step-profile-threads.md   # what each thread of a worker costs

Every variant runs benchmarks/step_worker.py (ResNet-18, batch 32, one thread per worker).
Per step the worker times forward, backward (which includes Horovod's hooks and our
``compress``) and the optimizer step (Horovod's ``synchronize``: the waits on its handles,
our ``decompress``, then SGD); the compressor adds its own seconds in compression math and in
waiting on its collectives. Medians of steps 4-12 of each run, then the median over rounds.

``--set threads`` adds where each worker's CPU went over the same steps (per step, mean of
the ranks): its training (main) thread's CPU, its other threads' (Horovod's background loop,
the Gloo transports, our heartbeat), and the training thread's time off the CPU (waiting, or
runnable while another thread had its core). On this emulated cluster the workers share the VM's
cores, so a background thread's CPU comes out of some worker's compute.

Writes the .md given by --out (default benchmarks/results/step-profile-runs.md) with the
per-run JSON beside it; benchmarks/results/step-profile.md is the hand-written reading.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "benchmarks" / "cluster"))
from machine import cpu_model  # noqa: E402
from phases import cpu_cells  # noqa: E402
from step_time import run  # noqa: E402

CYCLE = "HOROVOD_CYCLE_TIME"
CYCLE_VARIANTS = [  # label, method, environment of the horovodrun job (None: not a Horovod job)
    ("compute floor (no communication)", "floor", None),
    ("Horovod initialized, never called, 1 ms cycle (Horovod's default)", "hvd-idle", {CYCLE: "1"}),
    ("Horovod initialized, never called, 20 ms cycle", "hvd-idle", {CYCLE: "20"}),
    ("DDP powerSGD_hook rank 1", "ddp-r1", None),
    ("DDP powerSGD_hook rank 4", "ddp-r4", None),
    ("ours rank 1, Horovod's collectives as data plane, 1 ms cycle", "ours-r1",
     {CYCLE: "1", "ACCORDION_DATA_PLANE": "horovod"}),
    ("ours rank 1, our Gloo group, 1 ms cycle", "ours-r1", {CYCLE: "1"}),
    ("ours rank 1, our Gloo group, 20 ms cycle (the default now)", "ours-r1", {}),
    ("ours rank 4, our Gloo group, 20 ms cycle (the default now)", "ours-r4", {}),
]
THREAD_VARIANTS = [
    ("compute floor (no communication)", "floor", None),
    ("Horovod initialized, never called, 20 ms cycle (ours)", "hvd-idle", {CYCLE: "20"}),
    ("Horovod initialized, never called, 100 ms cycle", "hvd-idle", {CYCLE: "100"}),
    ("ours rank 1 (20 ms cycle, the default)", "ours-r1", {}),
    ("ours rank 1, 100 ms cycle", "ours-r1", {CYCLE: "100"}),
    ("ours rank 4", "ours-r4", {}),
    ("DDP powerSGD_hook rank 1, a Gloo group per bucket", "ddp-pg-r1", None),
    ("DDP, our hook, rank 1", "ddp-ours-r1", None),
]
VARIANT_SETS = {"cycle": CYCLE_VARIANTS, "threads": THREAD_VARIANTS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--set", choices=sorted(VARIANT_SETS), default="cycle",
                   help="cycle: Horovod's cycle and our data plane, one at a time; threads: the same phases "
                        "with each worker's CPU by thread")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "step-profile-runs.md")
    args = p.parse_args()
    variants, threads = VARIANT_SETS[args.set], args.set == "threads"
    from cluster import Cluster

    raw = args.out.with_suffix("")
    raw.mkdir(parents=True, exist_ok=True)
    results: dict[int, list[dict]] = {i: [] for i in range(len(variants))}
    with Cluster(args.nodes, rate=args.rate, prefix="accprof-") as cluster:
        for round_ in range(args.rounds):
            for i, (label, method, env) in enumerate(variants):
                out = raw / f"v{i}-{method}-r{round_}.json"
                try:
                    results[i].append(run(cluster, method, "resnet18", out, 600, env=env))
                except Exception as exc:  # record and go on
                    print(f"{label}: FAILED {exc}", flush=True)
                    continue
                print(f"round {round_ + 1}: {label}: {results[i][-1]['step_s']:.3f} s/step", flush=True)
    header = ["variant", "step", "forward", "backward", "optimizer step", "our math", "our waits"]
    if threads:
        header += ["training thread CPU", "other threads' CPU", "training thread off the CPU", "other threads by name"]
    rows = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 2) + "---|"]
    for i, (label, _, _) in enumerate(variants):
        runs = results[i]
        if not runs:
            rows.append(f"| {label} | failed |" + " |" * (len(header) - 2))
            continue

        def med(fn):
            return statistics.median(statistics.median(fn(r, k) for k in range(3, 12)) for r in runs)
        step = statistics.median(r["step_s"] for r in runs)
        cells = [med(lambda r, k, ph=ph: r["phases"][k][ph]) for ph in ("forward", "backward", "step")]
        ours = ([med(lambda r, k, key=key: r["ours"][k][key]) for key in ("compress", "comm")]
                if runs[0]["ours"] else None)
        rows.append(f"| {label} | {step:.3f} | " + " | ".join(f"{c:.3f}" for c in cells) + " | "
                    + (" | ".join(f"{c:.3f}" for c in ours) if ours else "- | -")
                    + ("".join(f" | {c}" for c in cpu_cells(runs)) if threads else "") + " |")
    command = (f".venv/bin/python benchmarks/step_profile.py {'--set threads ' if threads else ''}--rate {args.rate} "
               f"--nodes {args.nodes} --rounds {args.rounds} --out {os.path.relpath(args.out, REPO)}")
    text = ["# Step profile, measured", "",
            f"Machine: {platform.node()}, {cpu_model()}, {os.cpu_count()} cores shared by {args.nodes} emulated "
            f"nodes at {args.rate}; ResNet-18, batch 32 per worker, 1 thread per worker. Seconds per step, "
            f"median of steps 4-12, median over {args.rounds} rounds. Command: `{command}`. Per-run JSON: "
            f"`{os.path.relpath(raw, REPO)}/`.", "", *rows, ""]
    args.out.write_text("\n".join(text))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
