"""Time per training step against PyTorch DDP (its PowerSGD hook, fp16 and fp32 dense) and
the compute floor, on the emulated cluster, repeated in interleaved rounds.

    .venv/bin/python benchmarks/step_time.py                                  # the full grid
    .venv/bin/python benchmarks/step_time.py --models resnet18 --nodes 2 --rates 100mbit --rounds 2 \\
        --methods floor,ddp-r1,ours-r1 --out /tmp/st.md

Every method runs benchmarks/step_worker.py: the same model, synthetic batches, optimizer and
loop, one worker per emulated node, one thread per worker; ours and Horovod's under
``horovodrun --gloo``, DDP under ``torchrun`` (Gloo, default buckets), the floor as one copy
per node at the same time with no communication at all. In each round every method runs once,
back to back, so that slow phases of this shared machine hit all methods alike; ratios are
taken within a round. Reported per setting: each method's median step (steps 4-12, or to --steps - 2) over the
rounds with its range, its time over the floor, and the per-round ratios of ours to DDP's.

Writes the .md given by --out (default benchmarks/results/step-time.md), a .csv beside it with
every run, and the per-run JSON under a folder of the same name.

On a GPU machine (no emulated links: ``--local`` runs the workers as processes of this
machine, ``--nodes`` of them, and ``--rates`` is ignored):

    python benchmarks/step_time.py --local --device cuda --models resnet18 --nodes 2 \
        --methods floor,ddp-fp16,ddp-r4,ddp-ours-r4,ddp-r1,ddp-ours-r1 --out benchmarks/results/gpu/step-time.md

(the ours-* methods run under horovodrun: not on a machine without Horovod; ddp-ours-* is our
DDP hook under torchrun.)

Each worker takes GPU local rank mod the GPU count; with fewer GPUs than workers they share
one, and DDP runs on Gloo instead of NCCL (NCCL needs a GPU per rank): say so with the figures.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import sys
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "benchmarks" / "cluster"))
from machine import cpu_model  # noqa: E402
from report import kept_analysis  # noqa: E402
from step_worker import DDP, LAST, METHODS, PERIODIC  # noqa: E402

WORKER = REPO / "benchmarks" / "step_worker.py"
DEFAULT_METHODS = ("floor", "hvd-fp16", "ddp-fp16", "ddp-r1", "ours-r1", "ddp-r4", "ours-r4", "ours-accordion",
                   "ours-topk1", "plain-topk1")
# (ours, the peer it is held against): Accordion against DDP at its gentle rank.
PAIRS = [("ours-r1", "ddp-r1"), ("ours-r4", "ddp-r4"), ("ours-accordion", "ddp-r4"), ("ours-topk1", "plain-topk1"),
         ("hvd-fp16", "ddp-fp16"), ("ddp-ours-r1", "ddp-r1"), ("ddp-ours-r4", "ddp-r4"),
         ("ddp-ours-accordion", "ddp-r4"),
         # the same, against DDP's hook on a Gloo group per bucket (step_worker: ddp-pg-*)
         ("ours-r1", "ddp-pg-r1"), ("ours-r4", "ddp-pg-r4"), ("ours-accordion", "ddp-pg-r4"),
         ("ddp-ours-r1", "ddp-pg-r1"), ("ddp-ours-r4", "ddp-pg-r4"), ("ddp-ours-accordion", "ddp-pg-r4"),
         ("ddp-pg-r1", "ddp-r1"), ("ddp-pg-r4", "ddp-r4"),
         # acc.DiLoCo's rounds overlapped with the next round's inner steps, against waiting for each
         *((f"diloco-ours-overlap-h{h}", f"diloco-ours-h{h}") for h in (16, 64, 256))]


# Horovod's own methods run at Horovod's default cycle (1 ms): importing accordion_hvd would
# otherwise set ours (accordion_hvd/horovod/patches.py), and peers run at their own defaults.
HOROVOD_DEFAULTS = {"HOROVOD_CYCLE_TIME": "1"}


def gpus() -> str:
    import torch
    if not torch.cuda.is_available():
        return "(not visible here: see each run's JSON, field device)"
    return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"


class OneMachine:
    """``--local``: the cluster's launchers as processes of this machine (localrun.py), no
    emulated links; ``exec_everywhere`` tells copy k its index (ACCORDION_WORKER_INDEX), so
    that each floor copy takes its GPU as a launched worker would."""

    def __init__(self, workers: int) -> None:
        import localrun
        self.localrun, self.nodes, self.python = localrun, workers, sys.executable

    def __enter__(self) -> "OneMachine":
        return self

    def __exit__(self, *exc_info) -> None:
        pass

    def horovodrun(self, args, *, timeout: float, env: dict | None = None):
        return self.localrun.horovodrun(list(args), np=self.nodes, timeout=timeout, env=env)

    def torchrun(self, args, *, timeout: float) -> dict:
        return {0: self.localrun.torchrun(list(args), np=self.nodes, timeout=timeout)}

    def exec_everywhere(self, argv_of, *, timeout: float) -> dict:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(self.nodes) as pool:
            runs = [pool.submit(self.localrun.launch, list(argv_of(k)), timeout, {"ACCORDION_WORKER_INDEX": str(k)})
                    for k in range(self.nodes)]
            return {k: r.result() for k, r in enumerate(runs)}


def steps_for(method: str, steps: int) -> int:
    """A periodic method runs whole periods after its first one, two at least (step_worker's
    ``period_step_s``); every other method ``steps``."""
    if method not in PERIODIC:
        return steps
    period = 4 if method == "localsgd-p4" else int(method.rsplit("-h", 1)[1])
    return max(steps, 3 * period if period < 16 else 2 * period)


def run(cluster, method: str, model: str, out: Path, timeout: float, env: dict | None = None,
        steps: int = LAST + 2, device: str = "cpu") -> dict:
    out.unlink(missing_ok=True)  # a failed run must not leave an earlier run's result in its place
    steps = steps_for(method, steps)
    optimizer = "adamw" if model in ("transformer", "gru") else "sgd"  # the tasks' (evidence-v3)
    args = [str(WORKER), "--method", method, "--model", model, "--steps", str(steps), "--device", device,
            "--optimizer", optimizer, "--out", str(out)]  # --out last: the floor's copies each get their own
    if env is None:
        env = {} if method.startswith("ours-") else HOROVOD_DEFAULTS
    if method in DDP:
        check(cluster.torchrun(args, timeout=timeout))
        return read(out)
    if method == "floor":  # every node times itself; node1's is the one reported
        check(cluster.exec_everywhere(lambda k: [cluster.python, *args[:-1], f"{out}.node{k + 1}"], timeout=timeout))
        Path(f"{out}.node1").rename(out)
        return read(out)
    result = cluster.horovodrun(args, timeout=timeout, env=env)
    if result.returncode != 0:
        raise RuntimeError(why((result.stdout or "") + (result.stderr or "")))
    return read(out)


def check(results: dict) -> None:
    bad = {k: r for k, r in results.items() if r.returncode != 0}
    if bad:
        raise RuntimeError("\n".join(f"node{k + 1}: {why((r.stdout or '') + (r.stderr or ''))}"
                                     for k, r in bad.items()))


def why(output: str) -> str:
    """The lines of a failed run's output that say what failed (errors first), then its end."""
    errors = [line.strip() for line in output.splitlines() if "Error" in line or "error:" in line]
    return " | ".join(errors[:4])[:600] + " ... " + output[-300:]


def read(out: Path) -> dict:
    return json.loads(out.read_text())


def spread(values: list[float], fmt: str) -> str:
    if not values:
        return "failed"
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def times(text: str) -> str:
    """'1.02 (0.98-1.05)' -> '1.02 (0.98-1.05)x'; 'failed' stays as it is."""
    return text if text == "failed" else text + "x"


def section(step: dict[str, list], methods: list[str]) -> list[str]:
    floors = step.get("floor", [])
    out = ["| method | step (s), median (range) over rounds | over the floor (s) | / floor | failed |",
           "|---|---|---|---|---|"]
    for name in methods:
        values = step[name]
        done = [v for v in values if v is not None]
        over = [v - f for v, f in zip(values, floors) if v is not None and f is not None]
        ratio = [v / f for v, f in zip(values, floors) if v is not None and f is not None]
        no_floor = name == "floor" or "floor" not in step  # nothing to compare with: a dash, not "failed"
        out.append(f"| {name} | {spread(done, '.3f')} | "
                   f"{spread(over, '+.3f') if not no_floor else '-'} | "
                   f"{times(spread(ratio, '.3f')) if not no_floor else '-'} | {len(values) - len(done)} |")
    pairs = [(ours, peer) for ours, peer in PAIRS if ours in step and peer in step]
    if pairs:  # (a sitting of peers alone has none: no empty table)
        out += ["", "| ours | peer | ours / peer, median (range) over rounds | rounds where ours was faster |",
                "|---|---|---|---|"]
    for ours, peer in pairs:
        ratios = [o / p for o, p in zip(step[ours], step[peer]) if o is not None and p is not None]
        out.append(f"| {ours} | {peer} | {times(spread(ratios, '.3f'))} | {sum(r < 1 for r in ratios)} of "
                   f"{len(ratios)} |")
    return out + [""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="resnet18,cnn-wide")
    p.add_argument("--nodes", default="2,4")
    p.add_argument("--rates", default="100mbit,1gbit")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--steps", type=int, default=LAST + 2,
                   help=f"steps per run; the median is over steps 4 to steps - 2 (default {LAST + 2}: 4-{LAST})")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "step-time.md")
    p.add_argument("--start-round", type=int, default=0,
                   help="rounds before this one are read from their JSON, not run (adding rounds to a run)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the workers train")
    p.add_argument("--local", action="store_true",
                   help="no emulated cluster: --nodes workers as processes of this machine (a GPU machine); "
                        "--rates is ignored")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rebuild the tables from the per-run JSON already under --out's folder "
                        "(after an interrupted run; a run without its JSON counts as failed)")
    args = p.parse_args()
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown or args.rounds < 1:
        p.error(f"unknown methods {unknown} (known: {', '.join(METHODS)})" if unknown else "--rounds must be >= 1")
    if args.steps < LAST + 2:
        p.error(f"--steps must be at least {LAST + 2}, got {args.steps}")
    if args.device == "cuda" and not args.report_only:
        import torch
        if not torch.cuda.is_available():
            p.error("--device cuda: no CUDA GPU on this machine")
    if args.local:
        args.rates = "local"
    else:
        from cluster import Cluster  # needs root, ip and tc: refuses with one line otherwise

    raw = args.out.with_suffix("")
    if args.report_only or args.start_round:  # rounds read back from their JSON
        from results_archive import restore  # unpacked from their archive if missing
        restore(raw)
    raw.mkdir(parents=True, exist_ok=True)
    rows, sections = [], []
    for model in args.models.split(","):
        for nodes in (int(n) for n in args.nodes.split(",")):
            for rate in args.rates.split(","):
                step = {m: [] for m in methods}
                machine = OneMachine(nodes) if args.local else None
                with nullcontext() if args.report_only else machine or Cluster(nodes, rate=rate, prefix="accstep-") \
                        as cluster:
                    for round_ in range(args.rounds):
                        for name in methods:
                            out = raw / f"{model}-{nodes}n-{rate}-r{round_}-{name}.json"
                            try:
                                reuse = args.report_only or round_ < args.start_round
                                result = read(out) if reuse else run(cluster, name, model, out, args.timeout,
                                                                     steps=args.steps, device=args.device)
                                # a periodic method's step: the mean over whole periods, a sync in each
                                seconds, error = result.get("period_step_s", result["step_s"]), ""
                            except Exception as exc:  # a timeout, a crash: record it, go on
                                seconds, error = None, f"{type(exc).__name__}: {exc}"
                            step[name].append(seconds)
                            rows.append({"model": model, "nodes": nodes, "rate": rate, "round": round_,
                                         "method": name, "step_s": seconds, "error": error[:900]})
                            print(f"{model}, {nodes} nodes, {rate}, round {round_ + 1}/{args.rounds}: {name}: "
                                  + (f"FAILED {error[:900]}" if seconds is None else f"{seconds:.4f} s/step"),
                                  flush=True)
                sections += [f"## {model}, {nodes} nodes, {rate} links", "", *section(step, methods)]
    with open(args.out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    command = (f".venv/bin/python benchmarks/step_time.py --models {args.models} --nodes {args.nodes} "
               + ("--local " if args.local else f"--rates {args.rates} ")
               + (f"--device {args.device} " if args.device != "cpu" else "")
               + f"--rounds {args.rounds} --methods {args.methods} "
               + (f"--steps {args.steps} " if args.steps != LAST + 2 else "")
               + f"--out {os.path.relpath(args.out, REPO)}")
    header = ["# Time per step: ours against DDP and the compute floor", "",
              f"Machine: {platform.node()}, {cpu_model()}, {os.cpu_count()} cores"
              + (f", GPUs: {gpus()}" if args.device == "cuda" else "")
              + (" (--local: the workers are processes of this machine, no emulated links)" if args.local else "")
              + f" shared by all nodes (one worker "
              "per node, 1 thread each). Synthetic batches of 32 per worker, SGD with momentum; median of steps "
              f"4-{args.steps - 2} of each run (benchmarks/step_worker.py). {args.rounds} rounds; in each, every method ran "
              f"once, back to back. Command: `{command}`. Per-run JSON: `{os.path.relpath(raw, REPO)}/`.", "",
              "*ours / peer* < 1 means our step is the faster one; it is computed within each round. "
              "*over the floor* is a method's step minus the floor's step of the same round.", ""]
    args.out.write_text("\n".join(header + sections + kept_analysis(args.out)) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
