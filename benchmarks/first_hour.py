"""A new user's first job, timed: Gloo or MPI, Horovod's cycle at its default or ours, plain
Horovod or our compressor, on one machine (``horovodrun -np 2 -H localhost:2``).

    .venv/bin/python benchmarks/first_hour.py                      # 3 rounds, ~10 minutes
    .venv/bin/python benchmarks/first_hour.py --rounds 1 --steps 60 --out /tmp/first-hour.md

Every configuration trains the same MLP (784-512-512-10, 0.67M parameters, batch 64 per
rank, synthetic data, SGD) for ``--steps`` steps under ``horovodrun`` and reports the median
step time of the steps after the first 10 (warm-up). Configurations:

* backend: ``--gloo`` or ``--mpi``;
* method: Horovod's own allreduce (``hvd.Compression.none``), Horovod's fp16, our
  ``ours-default``, the default when these figures were measured, now named explicitly
  (``AccordionCompressor(PowerSGD(rank=1, critical_rank=4))``, Accordion; today's
  ``AccordionCompressor()`` is docs/time-to-quality.md's), and TopK 1%;
* Horovod's cycle: its default (1 ms; ``$HOROVOD_CYCLE_TIME`` unset) or 20 ms
  (``acc.quiet_horovod_cycle()`` before ``hvd.init()``).

Rounds are interleaved (every configuration once per round, in a shuffled order), and the
table gives, per configuration, the median over all rounds of each run's median step,
with every round's value. One thread per rank (``OMP_NUM_THREADS=1``), as horovodrun jobs
here run. Writes the .md given by ``--out`` and the per-run JSON lines beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from machine import cpu_model  # noqa: E402

BIN = Path(sys.executable).parent
MPI_ARGS = "--allow-run-as-root --oversubscribe"
METHODS = ("horovod-fp32", "horovod-fp16", "ours-default", "ours-topk1")
BACKENDS = ("gloo", "mpi")
CYCLES = ("default", "20")
WARMUP = 10


def worker(method: str, cycle: str, steps: int) -> None:
    """One rank of one configuration: prints one JSON line (rank 0) with every step's time."""
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    import accordion_hvd as acc

    if cycle != "default":
        acc.quiet_horovod_cycle(float(cycle))
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 10))
    compression = {"horovod-fp32": hvd.Compression.none, "horovod-fp16": hvd.Compression.fp16,
                   "ours-default": acc.AccordionCompressor(acc.PowerSGD(rank=1, critical_rank=4)),
                   "ours-topk1": acc.AccordionCompressor(acc.TopK(ratio=0.01))}[method]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(hvd.rank())
    x, y = torch.randn(64, 784, generator=gen), torch.randint(0, 10, (64,), generator=gen)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        seconds.append(time.perf_counter() - start)
    mean = hvd.allreduce(torch.tensor(seconds, dtype=torch.float64), op=hvd.Average, name="first-hour.times")
    timed = mean.tolist()[WARMUP:]
    if hvd.rank() == 0:  # one short line: launchers split long ones
        print("RESULT " + json.dumps({"median_step_s": statistics.median(timed), "steps": len(timed),
                                      "cycle_env": os.environ.get("HOROVOD_CYCLE_TIME")}), flush=True)


def run(backend: str, method: str, cycle: str, steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "HOROVOD_CYCLE_TIME"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    cmd = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", f"--{backend}"]
    if backend == "mpi":
        cmd.append(f"--mpi-args={MPI_ARGS}")
    cmd += [sys.executable, __file__, "--worker", method, cycle, str(steps)]
    started = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env).stdout
    decoder = json.JSONDecoder()  # raw_decode: mpirun may append another rank's text to the line
    found = [decoder.raw_decode(line.split("RESULT ", 1)[1])[0] for line in out.splitlines() if "RESULT " in line]
    if not found:
        raise RuntimeError(f"{backend} {method} cycle {cycle}: no result:\n{out[-3000:]}")
    return {"backend": backend, "method": method, "cycle": cycle, **found[0],
            "wall_s": round(time.monotonic() - started, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=150, help="steps per run (the first 10 are not timed)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "first-hour.md")
    args = p.parse_args()
    configs = [(b, m, c) for b in BACKENDS for m in METHODS for c in CYCLES]
    raw = args.out.with_suffix(".jsonl")
    raw.parent.mkdir(parents=True, exist_ok=True)
    runs = []
    with raw.open("w") as log:
        for r in range(args.rounds):
            order = configs[:]
            random.Random(r).shuffle(order)
            for backend, method, cycle in order:
                result = {"round": r, **run(backend, method, cycle, args.steps)}
                runs.append(result)
                log.write(json.dumps(result) + "\n")
                log.flush()
                print(json.dumps(result), flush=True)
    write_table(args, runs, configs, raw)


def write_table(args, runs: list[dict], configs: list, raw: Path) -> None:
    def cell(backend, method, cycle):
        values = [x["median_step_s"] * 1e3 for x in runs if (x["backend"], x["method"], x["cycle"]) == (backend, method, cycle)]
        return statistics.median(values), values

    lines = [f"# First-hour job: Gloo or MPI, Horovod's cycle, plain Horovod or ours ({time.strftime('%Y-%m-%d')})", "",
             f"`.venv/bin/python benchmarks/first_hour.py --rounds {args.rounds} --steps {args.steps}` on "
             f"{cpu_model()} ({os.cpu_count()} cores), {platform.system()}; `horovodrun -np 2 -H localhost:2`, one "
             f"thread per rank, MLP 784-512-512-10, batch 64 per rank. Median step (ms) of steps {WARMUP + 1}-"
             f"{args.steps} of each run (the ranks' mean per step), then the median over the {args.rounds} rounds "
             f"(every round's value in brackets). Raw runs: [{raw.name}]({raw.name}).", "",
             "| method | Gloo, 1 ms cycle (Horovod's default) | Gloo, 20 ms cycle | MPI, 1 ms cycle (Horovod's default) "
             "| MPI, 20 ms cycle |", "|---|---|---|---|---|"]
    for method in METHODS:
        cells = []
        for backend in BACKENDS:
            for cycle in CYCLES:
                median, values = cell(backend, method, cycle)
                cells.append(f"{median:.1f} [{', '.join(f'{v:.1f}' for v in values)}]")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
