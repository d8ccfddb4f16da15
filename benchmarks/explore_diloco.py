"""Exploratory runs of ``acc.DiLoCo`` variants beside evidence-v3's, never scored.

    .venv/bin/python benchmarks/explore_diloco.py --setting lstm-100mbit --variants auto,auto-reset
    .venv/bin/python benchmarks/explore_diloco.py --report    # benchmarks/results/explore-diloco.md

A variant is one of evidence-v3's methods with extra CLI flags (``VARIANTS``), run as the
protocol runs its pilots: on the pilot seed (3, never scored), the standard schedule (no
target, no cap), the same task, emulated cluster and records (benchmarks/evidence_v3.py),
from this checkout. What these runs are for: to choose what a later protocol scores. A
variant chosen on them is never scored by them. Records in
``benchmarks/results/explore-diloco/SETTING/VARIANT/seed3/``; a run whose ``run.json``
exists is not run again. Needs root (the emulated links) and nothing else running.
``--report`` tabulates them beside evidence-v3's own pilot of ``diloco-auto`` (the same seed,
at the runner's commit): the time to the setting's v3 target and the validation perplexity at
each epoch's end.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "benchmarks" / "cluster"))
from cluster import Cluster  # noqa: E402
from evidence_v3 import COMMON, METHODS, OUT as V3, PILOT_SEED, SETTINGS, TASKS, run_cli  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "explore-diloco"
VARIANTS = {  # name -> (evidence-v3's method, extra CLI flags)
    "auto": ("diloco-auto", []),  # as v3 froze it, at this checkout (the kernels' last-bit sums differ from a6af0df)
    "auto-reset": ("diloco-auto", ["--reset-momentum"]),
    "auto-overlap": ("diloco-auto", ["--overlap"]),
    # the compressor's windows of 16 rounds, not 100: the link gate's dense 16-bit trial (one
    # window) ends after 16 rounds (at 10 Mbit/s the first 128 inner steps, every one a round and
    # most of them dense 16-bit, took about half of v3's diloco-auto's time to target)
    "auto-window16": ("diloco-auto", ["--interval", "16"]),
    "auto-window16-reset": ("diloco-auto", ["--interval", "16", "--reset-momentum"]),  # both of the above
    # the inner learning rate of one rank's batch: the CLI scales --lr by the world size, right
    # for synchronous training (the gradient of every rank's batch averaged) but each inner step
    # of DiLoCo takes one rank's batch alone ("LR/2": the task's --lr halved, so scaled by 2 ranks
    # it is the task's one-rank rate)
    "auto-lr1": ("diloco-auto", ["--lr", "LR/2"]),
    "auto-reset-lr1": ("diloco-auto", ["--reset-momentum", "--lr", "LR/2"]),
    # the ladder's top rung 16, not 64 (so also windows of 16 inner steps): rounds at most 16
    # inner steps apart, where the transformer's runs fell behind 16-bit dense by 1.5-2 points
    # before the decay with rounds of 64
    "auto-reset-lr1-top16": ("diloco-auto", ["--reset-momentum", "--lr", "LR/2", "--sync-ladder", "1,4,16"]),
    "auto-reset-top16": ("diloco-auto", ["--reset-momentum", "--sync-ladder", "1,4,16"]),
    # plain averaging at every interval (outer lr 1, no momentum: local SGD with our codecs and
    # interval): the paper's outer Nesterov (0.7, 0.9) was tuned for rounds of 500 steps, and
    # v3's H pilot of diloco-paper got worse as H fell (transformer 37.28 at 256, 42.33 at 64,
    # 81.59 at 16); the auto ladder spends most rounds at 4 to 64
    "auto-plain": ("diloco-auto", ["--outer-lr", "1", "--outer-momentum", "0"]),
    "auto-plain-lr1-top16": ("diloco-auto", ["--outer-lr", "1", "--outer-momentum", "0", "--lr", "LR/2",
                                             "--sync-ladder", "1,4,16"]),
    "auto-window16-plain": ("diloco-auto", ["--interval", "16", "--outer-lr", "1", "--outer-momentum", "0"]),
    # the outer momentum for the top rung's rounds (64 inner steps) only, shorter rounds plain
    # averages (acc.DiLoCo(plain_below=64)): in a round of a few inner steps the pseudo-gradient
    # is close to the last one, so Nesterov's 0.7 / (1 - 0.9) moves the model ~7x as far as the
    # inner steps did; the transformer lost most to it in its first epoch (auto-plain 56.6 vs
    # auto 69.8 at step 168, rounds of 4 and 16), the LSTM gained from it over epochs 1-3
    "auto-reset-plain64": ("diloco-auto", ["--reset-momentum", "--plain-below", "64"]),
    # plain averaging with rounds of at most 4 or 16 inner steps (the ladder's top rung): is the
    # interval the transformer's remaining lever once the outer step is plain? (PyTorch's local
    # SGD, rounds of 4, ended the LSTM level with 16-bit dense, 31.98 vs 31.84, in v3)
    "auto-plain-top4": ("diloco-auto", ["--outer-lr", "1", "--outer-momentum", "0", "--sync-ladder", "1,4"]),
    "auto-plain-top16": ("diloco-auto", ["--outer-lr", "1", "--outer-momentum", "0", "--sync-ladder", "1,4,16"]),
    # evidence-v4's diloco-v4 (the library's defaults since 5f6d9e7: plain_below 64, reset_momentum,
    # windows of 16 rounds), and with the link ceiling on calm windows (acc.SyncInterval(budget=0.1):
    # no longer rounds than keep a round under a tenth of an inner step): where the link affords
    # short rounds, shorter (the transformer: 28.42 with rounds of at most 4, 29.40 with 64)
    "v4": ("diloco-auto", ["--interval", "16"]),
    # (the LSTM at 100 Mbit/s: held at rounds of 16 too, 32.14 against v4's 30.23)
    "v4-budget0.1": ("diloco-auto", ["--interval", "16", "--sync-budget", "0.1"]),
    # v4's defaults with the decay round, at 70ef1c4 (0ce5c71 for the LSTM; reverted after these
    # pilots: no lasting effect): the round that ends the decay's window, at 64 inner steps, a
    # plain average with the momentum dropped first, not the outer step with the old rate's
    # momentum (in v4's transformer pilot the perplexity fell by 0.4 over the 112 steps after the
    # decay, 16-bit dense's by about 2)
    "v4-decay-round": ("diloco-auto", ["--interval", "16"]),
    # v4's defaults with the tail of training synchronous, at the pilot commit 0fec90a (its change,
    # never landed: results/explore-diloco/pilot-tail-0fec90a.patch; --tail exists only there): once
    # the inner lr is at or below half its peak (after the decay, the last third), a round makes
    # the models alike and then either every step's gradients are averaged before the inner step
    # (16-bit, the inner AdamW state averaged once: one synchronous AdamW, as 16-bit dense trains)
    # or the models every step (rounds of 1). Is the transformer's gap to dense made in the tail?
    "v4-tail-grad": ("diloco-auto", ["--interval", "16", "--tail", "gradients:0.5"]),
    "v4-tail-models": ("diloco-auto", ["--interval", "16", "--tail", "models:0.5"]),
    # Is the AdamW models' gap local AdamW's own? The tail variants above left the transformer
    # where v4 ended (the gap is made before the decay), and even rounds of at most 4 ended 0.5
    # above 16-bit dense. Here the shortest local training there is: every inner AdamW step
    # followed by a plain float32 average of the models (DiLoCo as published, --codec none, at
    # H = 1, outer lr 1 and no momentum: no codec, no interval policy). It differs from
    # synchronous AdamW only in what AdamW's moments see: each rank's own gradient, not the
    # average, so in the noise-dominated regime each rank's second moment is about K times
    # the synchronous one's noise and its step about 1/sqrt(K) as long. "-lr-sqrt2" makes up
    # that factor (the task's --lr times sqrt(2), 2 ranks). Beside them 16-bit dense on the
    # same seed. Quality only: lossless and link-independent, so run at 1 Gbit/s (the fastest).
    "dense": ("ddp-fp16", []),
    "h1-plain-fp32": ("diloco-auto", ["--codec", "none", "--sync-every", "1", "--outer-lr", "1",
                                      "--outer-momentum", "0"]),
    "h1-plain-fp32-lr-sqrt2": ("diloco-auto", ["--codec", "none", "--sync-every", "1", "--outer-lr", "1",
                                               "--outer-momentum", "0", "--lr", "LR*sqrt2"]),
    # (h1-plain-fp32 ended at 28.00 against dense's 27.90 on this seed, step for step alike: local
    # AdamW is not the gap.) The same lossless plain averaging at fixed H = 4, 16, 64: how much of
    # v4's gap (29.62 at rounds of up to 64) the round length alone makes, without our codecs.
    # (They ended at 28.37, 29.18, 29.87 on the transformer; on the LSTM, SGD inside, at 16 and 64
    # 32.33 and 32.51 against dense's 31.75 on the seed: the round length costs AdamW more.)
    **{f"h{h}-plain-fp32": ("diloco-auto", ["--codec", "none", "--sync-every", str(h), "--outer-lr", "1",
                                            "--outer-momentum", "0"]) for h in (4, 16, 64)},
    # What overlapped rounds (acc.DiLoCo(overlap=True), off by default) cost in quality and save
    # in time, with v4's defaults where they pay (the LSTM, SGD inside) and where overlap has the
    # most to hide (10 Mbit/s): a round one round late against v4 itself, on the same VM.
    # (v4 reached v3's target at 437 s and ended at 30.21; with overlap 549 s and 31.12, the 6
    # epochs in 619 s against 659 s.)
    "v4-overlap": ("diloco-auto", ["--interval", "16", "--overlap"]),
}


def flags_for(task: str, flags: list[str]) -> list[str]:
    """A variant's flags for ``task``: "LR/2" is the task's --lr halved, "LR*sqrt2" times sqrt(2)."""
    lr = float(TASKS[task][TASKS[task].index("--lr") + 1])
    scaled = {"LR/2": f"{lr / 2:g}", "LR*sqrt2": f"{lr * 2 ** 0.5:.6g}"}
    return [scaled.get(flag, flag) for flag in flags]


def report() -> Path:
    """benchmarks/results/explore-diloco.md: each setting's runs, v3's pilot first."""
    lines = ["# Exploratory DiLoCo variants (never scored)", "",
             "`.venv/bin/python benchmarks/explore_diloco.py --report`; the runs and what they are for: "
             "[benchmarks/explore_diloco.py](../explore_diloco.py). One seed (3, the pilot seed) each: a "
             "difference here is a reason to score a variant in a later protocol, not a result. *Machine*: the "
             "CPU the run had; times from different CPUs are not comparable (the AMD EPYC VM took about 1.5x the "
             "Intel Xeon's time per run here), perplexities are.", ""]
    settings = sorted(d.name for d in OUT.iterdir() if d.is_dir()) if OUT.exists() else []
    for setting in settings:
        frozen = json.loads((V3 / setting / "setting.json").read_text()) if (V3 / setting / "setting.json").exists() else None
        target = frozen["target_perplexity"] if frozen else None
        runs = [("v3's pilot-diloco-auto", V3 / setting / "pilot-diloco-auto" / f"seed{PILOT_SEED}")]
        runs += [(variant, OUT / setting / variant / f"seed{PILOT_SEED}") for variant in VARIANTS]
        lines += [f"## {setting}", "", f"Target (v3's): validation perplexity {target:.2f}" if target else "No v3 target.", "",
                  "| run | commit | machine | time to target (s) | validation perplexity at each epoch's end | best |",
                  "|---|---|---|---|---|---|"]
        for name, where in runs:
            if not (where / "eval.csv").exists():
                continue
            with open(where / "eval.csv", newline="") as f:
                evals = list(csv.DictReader(f))
            record = json.loads((where / "run.json").read_text())
            ppl = [float(e["perplexity"]) for e in evals]
            reached = next((float(e["wall_s"]) for e in evals if target and float(e["perplexity"]) <= target), None)
            # eval.csv's epoch is the epochs done: an epoch's end is the first row of its number
            ends = [float(e["perplexity"]) for e, before in zip(evals, [None] + evals[:-1])
                    if int(e["epoch"]) >= 1 and (before is None or before["epoch"] != e["epoch"])]
            cpu = record.get("machine", "?").split(", ")[1] if ", " in record.get("machine", "") else "?"
            lines.append(f"| {name} | {record.get('commit', '?')} | {cpu} | {f'{reached:.0f}' if reached else 'not reached'} | "
                         f"{', '.join(f'{x:.2f}' for x in ends)} | {min(ppl):.2f} |")
        lines.append("")
    path = OUT.parent / "explore-diloco.md"
    path.write_text("\n".join(lines))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", choices=sorted(SETTINGS))
    p.add_argument("--variants", help="comma-separated, of: " + ", ".join(VARIANTS))
    p.add_argument("--timeout", type=float, default=7200, help="seconds per run")
    p.add_argument("--report", action="store_true", help="write benchmarks/results/explore-diloco.md and stop")
    args = p.parse_args()
    if args.report:
        from results_archive import restore  # the raw runs: unpacked from their archive if missing
        restore(OUT)
        restore(V3)  # evidence-v3's pilot, beside them in the report
        print(f"wrote {report()}")
        return
    if not args.setting or not args.variants:
        p.error("give --setting and --variants (or --report)")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: {unknown} unknown; the variants are {list(VARIANTS)}")
    task, rate = SETTINGS[args.setting]
    todo = [v for v in variants if not (OUT / args.setting / v / f"seed{PILOT_SEED}" / "run.json").exists()]
    print(f"{args.setting}: {len(todo)} runs now", flush=True)
    if not todo:
        return
    with Cluster(2, rate=rate, prefix="accx-") as cluster:
        for variant in todo:
            method, flags = VARIANTS[variant]
            launcher, method_args = METHODS[method]
            record = run_cli(cluster, launcher, [*TASKS[task], *COMMON, *method_args, *flags_for(task, flags),
                                                 "--seed", str(PILOT_SEED)],
                             OUT / args.setting / variant / f"seed{PILOT_SEED}",
                             {"explore": "diloco, never scored", "setting": args.setting, "variant": variant,
                              "method": method, "flags": flags, "seed": PILOT_SEED}, args.timeout)
            print(f"{args.setting} {variant} seed {PILOT_SEED}: exit {record['exit']}, {record['seconds']:.0f} s",
                  flush=True)


if __name__ == "__main__":
    main()
