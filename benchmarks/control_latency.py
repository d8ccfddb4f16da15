"""How long one control-plane reduction takes on each plane the compressor can use.

The regime controller's reductions are a few floats (norms, timings), so what they cost is
latency: Horovod's collectives wait for its background cycle and negotiation, MPI's and a Gloo
group's start at once (accordion_hvd/comm/control.py says why the compressor prefers the
latter under ``horovodrun --gloo``). Each plane reduces 30 float64 values 40 times; before each
timed reduction an untimed one lines the ranks up and rank r sleeps 3r ms, as ranks arrive at
a window's end at slightly different times. Reported: the median and mean per rank.

Run it through this script (it launches horovodrun itself, 2 ranks, --gloo then --mpi):
    .venv/bin/python benchmarks/control_latency.py --out benchmarks/results/control-latency.md
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROUNDS, VALUES = 40, 30


def worker(backend: str) -> None:
    import horovod.torch as hvd

    from accordion_hvd import quiet_horovod_cycle
    from accordion_hvd.comm.control import HorovodControlPlane
    from accordion_hvd.comm.gloo import GlooChannel

    quiet_horovod_cycle()  # as in a job that uses the compressor
    hvd.init()
    channel = GlooChannel()
    planes = {"Horovod's collectives": HorovodControlPlane(), "the compressor's": channel.control_plane()}
    for label, plane in planes.items():
        seconds = []
        for i in range(ROUNDS):
            plane.allreduce([1.0] * VALUES, name=f"line-up.{i}")
            time.sleep(0.003 * hvd.rank())
            start = time.perf_counter()
            plane.allreduce([1.0] * VALUES, name=f"timed.{i}")
            seconds.append(time.perf_counter() - start)
        print(f"RESULT|{backend}|{label} ({plane.kind})|{hvd.rank()}|{statistics.median(seconds) * 1e3:.2f}|"
              f"{statistics.mean(seconds) * 1e3:.2f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--worker", choices=("gloo", "mpi"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker)
        return
    sys.path.insert(0, str(REPO / "benchmarks"))
    from machine import cpu_model

    rows = []
    for backend in ("gloo", "mpi"):
        run = subprocess.run([str(REPO / ".venv" / "bin" / "horovodrun"), f"--{backend}", "-np", "2", "-H",
                              "localhost:2", sys.executable, __file__, "--out", str(args.out), "--worker", backend],
                             capture_output=True, text=True, timeout=300, cwd=REPO)
        plain = re.sub(r"\[\d+(?:,\d+)?\]<std(?:out|err)>:", "", run.stdout)  # horovodrun's rank tags
        found = [list(m) for m in re.findall(r"RESULT\|(\w+)\|([^|\n]+)\|(\d+)\|(\d+\.\d\d)\|(\d+\.\d\d)", plain)]
        if run.returncode != 0 or not found:
            raise SystemExit(f"horovodrun --{backend} failed ({run.returncode}):\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
        rows += sorted(found)
    lines = ["# One control-plane reduction, per plane", "",
             f"Machine: {cpu_model()}, 2 ranks on one host (horovodrun -np 2 -H localhost:2). {VALUES} float64 values, "
             f"{ROUNDS} timed reductions per plane, rank r arriving 3r ms late. Command: "
             f"`.venv/bin/python benchmarks/control_latency.py --out {args.out}`.", "",
             "| launch | plane | rank | median (ms) | mean (ms) |", "|---|---|---:|---:|---:|"]
    lines += [f"| --{b} | {plane} | {rank} | {median} | {mean} |" for b, plane, rank, median, mean in rows]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
