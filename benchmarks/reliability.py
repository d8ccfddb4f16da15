"""Fault injection, measured: what each fault does to a run, and what survives.

    .venv/bin/python benchmarks/reliability.py                 # everything (about 15 min)
    .venv/bin/python benchmarks/reliability.py --only soak,nonfinite

Parts (each under real horovodrun, 2 ranks; the elastic part on the emulated cluster):
  badinput    the bad-input suite (tests/test_bad_input.py): cases, how each ended
  nonfinite   the training CLI on digits with NaN losses injected on one rank at three
              steps, against the same run without faults, over seeds (PowerSGD and TopK)
  divergence  ranks started with different settings: time until every rank has raised
  resume      checkpoint after epoch 2, resumed in a fresh job, against the uninterrupted
              run 66 steps later: bit-identical or not
  soak        5,000 steps with frequent level switches: RSS and open fds, floats_sent
  elastic     Horovod Elastic on the emulated cluster: a worker is killed mid-step, later a new
              host joins; accuracy against an undisturbed elastic run (needs root and ip/tc)
  network     faults on the emulated cluster's wire: a link slowed 100x for 20 s, a link cut
              for longer than the collective timeout, a frozen worker (SIGSTOP); plain jobs
              (Gloo and MPI, 2 and 4 nodes) and Horovod Elastic, state checked after recovery
Each part writes its section to benchmarks/results/reliability/<part>.md (with the machine and
its command), so a part can be rerun alone; benchmarks/results/reliability.md is assembled
from every section there.
"""

from __future__ import annotations

import argparse
import math
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO / "benchmarks" / "cluster"))
from localrun import horovodrun  # noqa: E402
from machine import cpu_model  # noqa: E402

PY = f"{Path(sys.executable).relative_to(REPO) if Path(sys.executable).is_relative_to(REPO) else sys.executable}"
FAULTS = ["50@1", "150@0", "250@1"]


def part_badinput() -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_bad_input.py"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300).stdout
    header = re.search(r"bad input: (.*?) =", out)
    rows = re.findall(r"^(\w+)\s+(error: .*|output: .*)$", out, re.M)
    lines = ["## Bad input", "", f"`{PY} -m pytest -q tests/test_bad_input.py`: "
             f"**{header.group(1) if header else 'summary missing: ' + out[-300:]}**. None crashed the "
             "process or hung; every compressor that refused an input computed its next steps exactly "
             "as a twin that never saw it.", "", "| case | how it ended |", "|---|---|"]
    lines += [f"| {name} | {ended.replace('|', '/')} |" for name, ended in rows]
    return lines + [""]


def cli_accuracy(args: list[str], timeout: float = 600) -> tuple[float, int, str]:
    result = horovodrun(["-m", "accordion_hvd.train", "--no-progress", *args], np=2, backend="gloo", timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{result.stdout[-2000:]}")
    accuracy = float(re.search(r"final test accuracy: ([0-9.]+)", result.stdout).group(1))
    skipped = len(set(re.findall(r"step (\d+) skipped on every rank", result.stdout)))
    return accuracy, skipped, result.stdout


def part_nonfinite(seeds: int, epochs: int) -> list[str]:
    codecs = {"PowerSGD 1 <-> 4": ["--codec", "powersgd", "--rank", "1", "--critical-rank", "4"],
              "TopK 1% <-> 10%": ["--codec", "topk", "--ratio", "0.01", "--critical-ratio", "0.1"]}
    faults = [a for f in FAULTS for a in ("--inject-nonfinite", f)]
    lines = ["## Non-finite gradients", "",
             f"The training CLI on digits, 2 ranks (Gloo), {epochs} epochs, lr decay at epoch {epochs * 2 // 3}; "
             f"faulty runs get a NaN loss (so every gradient is NaN) on one rank at steps "
             f"{', '.join(FAULTS)} (`--inject-nonfinite STEP@RANK`). Command: `{PY} -m accordion_hvd.train "
             f"--epochs {epochs} --lr-milestones {epochs * 2 // 3} --seed S <codec> [--inject-nonfinite ...]` under "
             "`horovodrun -np 2 --gloo`.", "",
             "| codec | seed | clean accuracy | with faults | difference (points) | steps skipped |",
             "|---|---|---|---|---|---|"]
    for label, codec in codecs.items():
        diffs = []
        for seed in range(seeds):
            common = [*codec, "--epochs", str(epochs), "--lr-milestones", str(epochs * 2 // 3), "--seed", str(seed)]
            clean, _, _ = cli_accuracy(common)
            faulty, skipped, _ = cli_accuracy([*common, *faults])
            diffs.append(100 * (faulty - clean))
            lines.append(f"| {label} | {seed} | {100 * clean:.2f}% | {100 * faulty:.2f}% | {diffs[-1]:+.2f} | "
                         f"{skipped} of {len(FAULTS)} |")
            print(lines[-1], flush=True)
        lines.append(f"| {label} | mean | | | {statistics.mean(diffs):+.2f} | |")
    return lines + ["", "Every faulty step was skipped on both ranks (logged by each), no error-feedback "
                    "buffer saw a NaN (checked in tests/test_nonfinite.py and under horovodrun in "
                    "tests/test_reliability_horovod.py), and training went on.", ""]


def part_divergence() -> list[str]:
    lines = ["## Rank divergence", "",
             "Ranks started with different compressor settings (tests/workers/mismatch_check.py MODE under "
             "`horovodrun -np 2`): every rank must raise the same error at the first step.", "",
             "| setting that differs | backend | exit | every rank raised the same error | seconds |",
             "|---|---|---|---|---|"]
    for mode in ("rank", "codec", "ratio", "eta", "policy", "interval"):
        for backend in ("gloo", "mpi"):
            started = time.monotonic()
            result = horovodrun(["tests/workers/mismatch_check.py", mode], np=2, backend=backend, timeout=120)
            elapsed = time.monotonic() - started
            plain = re.sub(r"\[[\d,]+\]<std(?:out|err)>:", "", result.stdout)
            messages = dict(re.findall(r"^rank (\d+): (ValueError: .*)$", plain, re.M))
            same = sorted(messages) == ["0", "1"] and len(set(messages.values())) == 1
            lines.append(f"| {mode} | {backend} | {result.returncode} | {'yes' if same else 'NO'} | {elapsed:.1f} |")
            print(lines[-1], flush=True)
    return lines + ["", "Seconds include launching Python and Horovod on both ranks.", ""]


def part_resume() -> list[str]:
    cases = {"PowerSGD Accordion 1 <-> 4": ["--codec", "powersgd", "--rank", "1", "--critical-rank", "4",
                                            "--lr-milestones", "3"],
             "PowerSGD static rank 2": ["--codec", "powersgd", "--rank", "2"],
             "TopK Accordion 10% <-> 60%": ["--codec", "topk", "--ratio", "0.1", "--critical-ratio", "0.6"],
             "TopK static 5%": ["--codec", "topk", "--ratio", "0.05"]}
    lines = ["## Exact resume", "",
             "A run of 5 epochs against one stopped after epoch 2 (step 44) and resumed in a fresh "
             "`horovodrun` from its checkpoint (`--checkpoint`, `--resume`), compared at the end (step 110, "
             "66 steps after the checkpoint): every parameter, error-feedback buffer, level and counter.", "",
             "| case | steps after the checkpoint | parameters | error feedback, levels, floats sent |",
             "|---|---|---|---|"]
    for label, codec in cases.items():
        with tempfile.TemporaryDirectory() as tmp:
            whole, half, resumed = (Path(tmp) / n for n in ("whole", "half", "resumed"))
            for extra in (["--epochs", "5", "--checkpoint", str(whole)], ["--epochs", "2", "--checkpoint", str(half)],
                          ["--epochs", "5", "--resume", str(half), "--checkpoint", str(resumed)]):
                cli_accuracy([*codec, *extra])
            same_params = same_state = True
            for rank in range(2):
                a = torch.load(f"{whole}.rank{rank}", weights_only=False)
                b = torch.load(f"{resumed}.rank{rank}", weights_only=False)
                after = a["step"] - torch.load(f"{half}.rank{rank}", weights_only=False)["step"]
                same_params &= a["step"] == b["step"] and all(torch.equal(a["model"][n], b["model"][n]) for n in a["model"])
                ca, cb = a["compression"], b["compression"]
                same_state &= (ca["sent"] == cb["sent"] and ca["controller"]["levels"] == cb["controller"]["levels"]
                               and all(torch.equal(ca["layers"][n]["residual"], cb["layers"][n]["residual"])
                                       for n in ca["layers"]))
        lines.append(f"| {label} | {after} | {'bit-identical' if same_params else 'DIFFERENT'} | "
                     f"{'bit-identical' if same_state else 'DIFFERENT'} |")
        print(lines[-1], flush=True)
    return lines + [""]


def part_soak(steps: int) -> list[str]:
    lines = ["## Soak", "",
             f"`tests/workers/soak_check.py CODEC {steps}` under `horovodrun -np 2`: a detection window every 4 "
             "steps and a rank-dependent loss scale that changes the averaged norms every second window, so "
             "levels switch all run long. RSS and open file descriptors after a 500-step warm-up and at the end.",
             "", "| codec | backend | steps | level switches | RSS start (MiB) | RSS end (MiB) | fds start / end | "
             "floats_sent (both ranks) |", "|---|---|---|---|---|---|---|---|"]
    for codec, backend in (("powersgd", "gloo"), ("powersgd", "mpi"), ("topk", "gloo"), ("topk", "mpi")):
        result = horovodrun(["tests/workers/soak_check.py", codec, str(steps)], np=2, backend=backend, timeout=900)
        found = re.findall(r"rank (\d): SOAK steps=\d+ switches=(\d+) rss_start_kb=(\d+) rss_end_kb=(\d+) "
                           r"fds_start=(\d+) fds_end=(\d+) floats_sent=(\d+)", result.stdout)
        if result.returncode != 0 or len(found) != 2:
            lines.append(f"| {codec} | {backend} | {steps} | FAILED | | | | {result.stdout[-200:]!r} |")
            continue
        for rank, switches, rss0, rss1, fd0, fd1, sent in sorted(found):
            lines.append(f"| {codec} (rank {rank}) | {backend} | {steps} | {switches} | {int(rss0) / 1024:.1f} | "
                         f"{int(rss1) / 1024:.1f} | {fd0} / {fd1} | {int(sent):,} |")
            print(lines[-1], flush=True)
    return lines + [""]


def part_elastic(epochs: int, seeds: int) -> list[str]:
    from cluster import Cluster  # benchmarks/cluster: needs root, ip and tc

    script = ["benchmarks/elastic_train.py", "--epochs", str(epochs), "--step-seconds", "0.02"]
    runs = {"undisturbed": [], "a worker dies at step 60": ["--die-on", "node2", "--die-at", "60"],
            "dies at step 60, a new host joins": ["--die-on", "node2", "--die-at", "60"]}
    lines = ["## Worker failure under Horovod Elastic", "",
             "The emulated cluster (benchmarks/cluster/: network namespaces, 1 Gbit/s links), "
             "`horovodrun --gloo --min-np 1 --max-np 2 --host-discovery-script benchmarks/cluster/discover_hosts.sh` "
             f"over node1 and node2, `{' '.join(script)} --seed S` (digits, PowerSGD Accordion 1 <-> 4, lr 0.02 "
             "per rank times the world size of the moment, state in `hvd.elastic.TorchState` committed every 5 "
             "steps and at each epoch's end). The worker on node2 is killed (SIGKILL) in the middle of step 60's "
             "backward pass (its compressed exchanges in flight on the other rank); in the third run node3 is added to "
             "the discovery file a second after node2's worker is gone. `ranks agree`: parameters, levels, "
             "PowerSGD's Q and the counters are the same on every rank at the end (by digest).", "",
             "| run | seed | final accuracy | world sizes | steps | ranks agree | seconds |",
             "|---|---|---|---|---|---|---|"]
    accuracy: dict[str, list[float]] = {label: [] for label in runs}
    for seed in range(seeds):
        for label, extra in runs.items():
            with Cluster(3, rate="1gbit", prefix="accrel-") as cluster, tempfile.TemporaryDirectory() as tmp:
                cluster.set_hosts(["node1:1", "node2:1"])
                died = Path(tmp) / "died"
                if "joins" in label:
                    threading.Thread(target=_add_host_after_death, args=(cluster, died), daemon=True).start()
                started = time.monotonic()
                result = cluster.horovodrun([*script, "--seed", str(seed), *extra, "--died-file", str(died)], np=2,
                                            elastic=True, timeout=900)
                elapsed = time.monotonic() - started
            out = result.stdout + result.stderr
            final = re.search(r"final test accuracy: ([0-9.]+); world sizes (\[.*?\]); steps (\d+); "
                              r"ranks agree: (\w+)", out)
            if result.returncode != 0 or not final:
                lines.append(f"| {label} | {seed} | FAILED (exit {result.returncode}) | | | | {elapsed:.0f} |")
                print(out[-3000:], flush=True)
            else:
                accuracy[label].append(100 * float(final.group(1)))
                lines.append(f"| {label} | {seed} | {accuracy[label][-1]:.2f}% | {final.group(2)} | {final.group(3)} | "
                             f"{final.group(4)} | {elapsed:.0f} |")
            print(lines[-1], flush=True)
    lines += ["", "| run | mean accuracy over seeds | against undisturbed (points) |", "|---|---|---|"]
    base = statistics.mean(accuracy["undisturbed"]) if accuracy["undisturbed"] else float("nan")
    for label, values in accuracy.items():
        if values:
            lines.append(f"| {label} | {statistics.mean(values):.2f}% | {statistics.mean(values) - base:+.2f} |")
    return lines + [""]


def _add_host_after_death(cluster, died: Path) -> None:
    """Once node2's worker is gone (its file appears), give Horovod a new host a second later."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not died.exists():
        time.sleep(0.2)
    time.sleep(1)
    cluster.set_hosts(["node1:1", "node2:1", "node3:1"])


COLLECTIVE_TIMEOUT = 20  # ACCORDION_COLLECTIVE_TIMEOUT of the network runs; Horovod's own Gloo timeout stays 30 s
STOP_BOUND = 30 + 10     # the larger of the two timeouts, plus the diagnosis (2.5-5 s) and the exit
CLI_RUN = ["-m", "accordion_hvd.train", "--no-progress", "--codec", "powersgd", "--rank", "1", "--critical-rank", "4"]


def _step_seconds(steps_csv: Path) -> list[float]:
    import csv
    with open(steps_csv) as f:
        walls = [float(row["wall_s"]) for row in csv.DictReader(f)]
    return [b - a for a, b in zip(walls, walls[1:])]


def names_collective_and_rank(error: str) -> bool:
    return "collective" in error and ("not responding" in error or "unreachable" in error)


def what_it_said(error: str) -> str:
    """An error line in short: its type, the collective, and whom it blames."""
    kind = error.split(":", 1)[0].rsplit(".", 1)[-1]
    name = re.search(r"collective (['\"])(.*?)\1", error)
    blame = re.search(r"(not responding \(seen from rank \d+\): (?:rank \d+ \(\w+\)(?:, )?)+|unreachable from rank "
                      r"\d+: rank \d+ \(\w+\))", error)
    if not name:
        return f"{kind}: {error.split(':', 1)[-1].strip()[:120]}"
    return f"{kind} in `{name.group(2)[:60]}`" + (f", {blame.group(1).rstrip(', ')}" if blame else ", nobody blamed")


NETWORK_CASES = ("slow", "cut", "freeze", "elastic")


def part_network(seeds: int, cases: tuple[str, ...] = NETWORK_CASES) -> list[str]:
    from cluster import Cluster
    from faults import Fault, rows_in, run_with_fault

    counts = {"injected": 0, "as designed": 0, "hangs": 0, "mismatches": 0}
    env = {"ACCORDION_COLLECTIVE_TIMEOUT": str(COLLECTIVE_TIMEOUT)}
    lines = ["## Faults on the wire", "",
             "The emulated cluster (benchmarks/cluster/, 1 Gbit/s links), faults from benchmarks/cluster/faults.py: "
             "**slow**: node2's link at 10 Mbit/s both ways for 20 s, then back; **cut**: node2's switch port down "
             "(frames dropped silently, as with a pulled cable) for 60 s, longer than the collective timeout; "
             "**freeze**: node2's worker stopped (SIGSTOP) for 60 s, then continued. "
             f"`ACCORDION_COLLECTIVE_TIMEOUT={COLLECTIVE_TIMEOUT}`; Horovod's own Gloo timeout is left at its 30 s, "
             f"so the bound for every rank to stop is {STOP_BOUND} s after the fault (the larger timeout, plus the "
             "diagnosis and the exit).", "",
             "### Plain jobs", "",
             f"The training CLI (`{' '.join(CLI_RUN[1:])} --epochs E`, digits; the slow-link runs with "
             "`--model cnn-wide`, 2.2 M parameters, so that the link matters) under `horovodrun`; the fault starts "
             "once 40 steps are done. A frozen worker cannot stop itself: it is named by the others, and ends when "
             "continued (horovodrun's SIGTERM stays pending on a stopped process).", "",
             "| fault | nodes | backend | exit | each node's worker ended, seconds after the fault | every rank that "
             "could named the collective and the unreachable rank | what each rank said | step time before / during / "
             "after (ms) |",
             "|---|---|---|---|---|---|---|---|"]
    plain = [("slow", 2, "gloo", 40), ("slow", 4, "gloo", 40), ("cut", 2, "gloo", 300), ("cut", 4, "gloo", 300),
             ("cut", 2, "mpi", 300), ("freeze", 2, "gloo", 300), ("freeze", 4, "gloo", 300)]
    for kind, nodes, backend, epochs in [case for case in plain if case[0] in cases]:
        with Cluster(nodes, rate="1gbit", prefix="accnet-") as cluster, tempfile.TemporaryDirectory() as tmp:
            steps = Path(tmp) / "steps.csv"
            fault = Fault(kind, "node2", hold=20 if kind == "slow" else 60)
            model = ["--model", "cnn-wide"] if kind == "slow" else []
            run = run_with_fault(cluster, [*CLI_RUN, *model, "--epochs", str(epochs), "--logdir", tmp], fault,
                                 ready=lambda: rows_in(steps) >= 40, progress=lambda: rows_in(steps),
                                 timeout=300, marker="accordion_hvd.train", backend=backend, env=env)
            step_s = _step_seconds(steps) if steps.exists() else []
        counts["injected"] += run.fault_at is not None
        counts["hangs"] += run.returncode is None
        errors = run.rank_errors()
        said = "; ".join(f"rank {r}: {what_it_said(e)}" for r, e in sorted(errors.items())) or "-"
        if kind == "slow":
            a, b = run.progress
            phases = [step_s[:a], step_s[a:b], step_s[b:]] if a is not None and b is not None else [[], [], []]
            medians = " / ".join(f"{1000 * statistics.median(x):.0f}" if x else "-" for x in phases)
            before = statistics.median(phases[0]) if phases[0] else float("nan")
            cost = sum(x - before for x in phases[1])
            ok = run.returncode == 0 and not errors
            counts["as designed"] += ok
            lines.append(f"| slow | {nodes} | {backend} | {run.returncode} | finished normally; the 20 s at 10 Mbit/s "
                         f"cost {cost:.1f} s | no error (none expected) | - | {medians} |")
        elif run.fault_at is None:
            ok = False
            lines.append(f"| {kind} | {nodes} | {backend} | {run.returncode} | fault never injected | | | |")
        else:
            # node2 is rank 1 (one slot per node, in order); a frozen rank cannot speak for itself.
            speakers = [r for r in range(nodes) if not (kind == "freeze" and r == 1)]
            every = all(r in errors and names_collective_and_rank(errors[r]) for r in speakers)
            in_time = all(run.stopped.get(f"node{r + 1}", math.inf) <= STOP_BOUND for r in speakers)
            ok = run.returncode not in (0, None) and every and in_time
            counts["as designed"] += ok
            ended = ", ".join(f"{node} {t:.1f}" for node, t in sorted(run.stopped.items())) or "-"
            lines.append(f"| {kind} | {nodes} | {backend} | {run.returncode} | {ended} | {'yes' if every else 'no'} "
                         f"| {said} | - |")
        print(lines[-1], flush=True)
        print("\n".join(run.log), flush=True)
        if not ok:
            print(run.stderr[-4000:], flush=True)

    lines += ["", "### Under Horovod Elastic", "",
              "`horovodrun --gloo --min-np 1 --max-np 2 --blacklist-cooldown-range 10 20 --host-discovery-script "
              "benchmarks/cluster/discover_hosts.sh`, `benchmarks/elastic_train.py --epochs 20 --step-seconds 0.02 "
              "--seed S` (digits, PowerSGD Accordion 1 <-> 4, state in `hvd.elastic.TorchState` committed every 5 "
              "steps); the fault starts after step 60. After each recovery every surviving rank compares 15 pieces "
              "of its state (parameters, momentum, each layer's error feedback and warm-start Q, levels, controller "
              "and policy state, window sums, counters, step) with its digest of the last commit; a host that "
              "rejoins after the blacklist cooldown gets the state by `sync`.", "",
              "| run | seed | exit | final accuracy | world sizes | steps | recoveries checked | pieces compared | "
              "state mismatches | ranks agree | seconds |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    accuracy: dict[str, list[float]] = {}
    script = ["benchmarks/elastic_train.py", "--epochs", "20", "--step-seconds", "0.02"]
    for seed in range(seeds if "elastic" in cases else 0):
        for label, kind in (("undisturbed", None), ("link cut for 60 s", "cut"), ("worker frozen for 60 s", "freeze")):
            with Cluster(2, rate="1gbit", prefix="accnet-") as cluster, tempfile.TemporaryDirectory() as tmp:
                cluster.set_hosts(["node1:1", "node2:1"])
                mark = Path(tmp) / "mark"
                args = [*script, "--seed", str(seed), "--mark-at", "60", "--mark-file", str(mark), "--pid-dir", tmp]
                common = dict(np=2, elastic=True, env=env, extra=["--blacklist-cooldown-range", "10", "20"])
                if kind is None:
                    started = time.monotonic()
                    result = cluster.horovodrun(args, timeout=900, **common)
                    returncode, out, seconds = result.returncode, result.stdout + result.stderr, time.monotonic() - started
                else:
                    run = run_with_fault(cluster, args, Fault(kind, "node2", hold=60), ready=mark.exists,
                                         timeout=900, marker="elastic_train.py", **common)
                    returncode, out, seconds = run.returncode, run.stdout + run.stderr, run.ended_at
                    counts["injected"] += run.fault_at is not None
                    counts["hangs"] += run.returncode is None
            final = re.search(r"final test accuracy: ([0-9.]+); world sizes (\[.*?\]); steps (\d+); ranks agree: "
                              r"(\w+); recoveries checked: (\d+); pieces compared: (\d+); state mismatches: (\d+)", out)
            if returncode != 0 or not final:
                lines.append(f"| {label} | {seed} | {returncode} | FAILED | | | | | | | {seconds:.0f} |")
                print(out[-4000:], flush=True)
            else:
                accuracy.setdefault(label, []).append(100 * float(final.group(1)))
                mismatches = int(final.group(7))
                counts["mismatches"] += mismatches
                recovered = int(final.group(5)) >= 1
                if kind is not None:
                    counts["as designed"] += recovered and mismatches == 0 and final.group(4) == "True"
                lines.append(f"| {label} | {seed} | 0 | {accuracy[label][-1]:.2f}% | {final.group(2)} | {final.group(3)} "
                             f"| {final.group(5)} | {final.group(6)} | {mismatches} | {final.group(4)} | {seconds:.0f} |")
            print(lines[-1], flush=True)
    lines += ["", "| run | mean accuracy over seeds | against undisturbed (points) |", "|---|---|---|"]
    base = statistics.mean(accuracy["undisturbed"]) if accuracy.get("undisturbed") else float("nan")
    for label, values in accuracy.items():
        lines.append(f"| {label} | {statistics.mean(values):.2f}% | {statistics.mean(values) - base:+.2f} |")
    lines += ["", f"**Counts**: faults injected {counts['injected']}; ended as designed (survived, or every rank "
                  f"stopped in time naming the collective and the unreachable rank) {counts['as designed']}; hangs "
                  f"{counts['hangs']}; state mismatches after recovery {counts['mismatches']}.", ""]
    return lines


PARTS = ("badinput", "nonfinite", "divergence", "resume", "soak", "elastic", "network")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {PARTS}")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=20, help="non-finite and elastic runs")
    p.add_argument("--soak-steps", type=int, default=5000)
    p.add_argument("--cases", default=",".join(NETWORK_CASES), help=f"network part: which of {NETWORK_CASES}")
    p.add_argument("--out", type=Path, default=RESULTS / "reliability.md")
    args = p.parse_args()
    chosen = [x for x in args.only.split(",") if x]
    for part in chosen:
        if part not in PARTS:
            p.error(f"--only: unknown part {part!r} (known: {', '.join(PARTS)})")
    sections = {"badinput": part_badinput, "nonfinite": lambda: part_nonfinite(args.seeds, args.epochs),
                "divergence": part_divergence, "resume": part_resume, "soak": lambda: part_soak(args.soak_steps),
                "elastic": lambda: part_elastic(args.epochs, args.seeds), "network": lambda: part_network(args.seeds, tuple(args.cases.split(",")))}
    fragments = args.out.with_suffix("")
    fragments.mkdir(parents=True, exist_ok=True)
    for part in chosen:
        print(f"--- {part}", flush=True)
        started = time.monotonic()
        try:
            body = sections[part]()
        except Exception as exc:  # one part failing must not lose the others
            body = [f"## {part}: FAILED", "", f"```\n{exc}\n```", ""]
            print(f"{part} failed: {exc}", flush=True)
        command = f"`{PY} benchmarks/reliability.py --only {part} --seeds {args.seeds} --epochs {args.epochs}`"
        body[1:1] = ["", f"*{machine()}; {command}; {time.monotonic() - started:.0f} s.*"]
        (fragments / f"{part}.md").write_text("\n".join(body) + "\n")
    done = [fragments / f"{part}.md" for part in PARTS if (fragments / f"{part}.md").exists()]
    header = ["# Reliability: faults injected and what survived", "",
              "Each section below was measured by `benchmarks/reliability.py --only PART` (its command and "
              "machine are under its title); the goal is that nothing is lost.", ""]
    args.out.write_text("\n".join(header) + "\n" + "\n".join(f.read_text() for f in done))
    print(f"wrote {args.out} from {len(done)} sections")


def machine() -> str:
    return (f"{platform.node()}, {cpu_model()}, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}, Python {platform.python_version()}")


if __name__ == "__main__":
    main()
