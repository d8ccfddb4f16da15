"""Issue 80's pilots: candidate families for AdamW on slow links, on the pilot seed, never scored.

    .venv/bin/python benchmarks/explore_v5.py --pilots sparseloco-h1,signloco-h2   # run (resumable)
    .venv/bin/python benchmarks/explore_v5.py --pack      # raw runs -> results/explore-v5/runs.tar.xz + report

Each pilot is the training CLI on evidence-v4's transformer task (AdamW, 6 epochs, decay after
4; benchmarks/evidence_v3.py ``TASKS``) at the pilot seed 3, 2 ranks under ``torchrun`` on this
machine, one thread each. Quality only: what a run sends does not change its trajectory, so no
link is emulated; each run records its wire size (``wire_bits`` in steps.csv for the
published methods, the compressor's bytes for ours), and the report gives bits per parameter
per optimizer step beside the budget of issue 80 (0.6 waiting for the wire, 1.7 overlapped, at
10 Mbit/s within 1.5x the floor). The 16-bit dense reference on this seed (27.90 after 6
epochs) is explore-diloco's ``transformer-1gbit/dense`` run. Raw runs go to
``build/explore-v5/PILOT/`` while they run and into one archive with ``--pack``.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import platform
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRATCH = REPO / "build" / "explore-v5"
OUT = REPO / "benchmarks" / "results" / "explore-v5"
SEED = 3  # the pilot seed (evidence-v3/v4): no score uses it
PARAMS = 1_405_287  # the transformer's parameters
DENSE_FINAL = 27.90  # 16-bit dense's final on this seed (explore-diloco's transformer-1gbit dense)
TASK = ["--dataset", "text", "--model", "transformer", "--optimizer", "adamw", "--epochs", "6", "--lr", "0.001",
        "--lr-milestones", "4", "--batch-size", "32", "--interval", "0", "--eta", "0.5", "--no-progress",
        "--evals-per-epoch", "4", "--launcher", "ddp"]
PILOTS = {  # name -> (why it runs, CLI flags)
    "sparseloco-h1": ("SparseLoCo's message (TopK 3% of 4096-chunks, 2-bit values, decaying error feedback) every "
                      "step: 0.43 bits/param/step, inside the waiting budget; H=1 lossless averaging matched dense "
                      "(28.00 vs 27.90), so the message is all that can cost quality",
                      ["--codec", "none", "--sync", "sparseloco", "--sync-every", "1"]),
    "sparseloco-h4": ("SparseLoCo every 4 inner steps: 0.11 bits/param/step; lossless rounds of 4 ended 28.37",
                      ["--codec", "none", "--sync", "sparseloco", "--sync-every", "4"]),
    "signloco-h2": ("1-bit (scaled sign) pseudo-gradients with error feedback every 2 steps: 0.5 bits/param/step, "
                    "inside the waiting budget; AdamW's updates are nearly signs already",
                    ["--codec", "none", "--sync", "signloco", "--sync-every", "2"]),
    "signloco-h1": ("the same every step: 1 bit/param/step (overlapped budget only)",
                    ["--codec", "none", "--sync", "signloco", "--sync-every", "1"]),
    "onebit-adam-f134": ("1-bit Adam with a 10% synchronous warm-up (134 of 1344 steps; the paper's 15-25% costs "
                         "about 3x the floor at 10 Mbit/s in 16-bit): 1 bit/param/step after it",
                         ["--codec", "none", "--sync", "onebit-adam", "--freeze-step", "134"]),
    "onebit-adam-f67": ("1-bit Adam's warm-up halved (67 steps, 5%): onebit-adam-f134 followed dense step for step "
                        "from step 448 on (36.31 vs 36.31); how short may the synchronous part be?",
                        ["--codec", "none", "--sync", "onebit-adam", "--freeze-step", "67"]),
    "onebit-adam-f34": ("a quarter of it (34 steps, 2.5%)",
                        ["--codec", "none", "--sync", "onebit-adam", "--freeze-step", "34"]),
    "onebit-sharedv-64": ("1-bit Adam with no synchronous warm-up (the warm-up is its cost: 2.6 bits/param/step "
                          "at 134 steps, and shorter ones lost 1.7-2.0 points because the second moment froze early): "
                          "1-bit momentum from step 1, the second moment from each rank's own gradients averaged "
                          "over the ranks at steps 1, 2, 4, ... then every 64 (onebit_shared.py): about 1.4 "
                          "bits/param/step, 16-bit nowhere but the refreshes",
                          ["--codec", "none", "--sync", "onebit-adam", "--variance-every", "64"]),
    "onebit-sharedv-64x": ("onebit-sharedv-64 as our library would run it: the ranks' 1-bit messages averaged "
                           "exactly (an all-gather of them), not compressed again on a server side",
                           ["--codec", "none", "--sync", "onebit-adam", "--variance-every", "64"]),
    "onebit-adam-q8-f134": ("onebit-adam-f134 (27.29, level with dense from step 448, dense's 27.90 reached at step "
                            "1008) with its warm-up in the per-step default's 8-bit sparse chunks (2.9 bits/param/step "
                            "on this model) instead of 16 bits: the warm-up was 1.5 of its 2.6 bits/param/step; "
                            "onebit-sharedv-64 (no warm-up, the second moment shared from local ones) ended 28.24",
                            ["--codec", "none", "--sync", "onebit-adam", "--freeze-step", "134", "--warmup-bits", "8"]),
    "ours-onebit-f134": ("acc.OneBitAdam as the library runs it (--sync ours-onebit-adam: the 8-bit sparse-chunk "
                         "warm-up through our compressor, then acc.Sign with its kernels, the frozen stage's update "
                         "clipped at one learning rate per entry): does it reproduce onebit-adam-q8-f134 (27.23), and "
                         "does the clip cost quality where the freeze was safe? (On the digits CNN a freeze at step 10 "
                         "of 44 diverged without the clip and reached 0.958 with it, AdamW 0.953.)",
                         ["--codec", "none", "--sync", "ours-onebit-adam", "--freeze-step", "134"]),
    "ours-onebit-f34": ("the same with a quarter of the warm-up (34 steps, 2.5%): unclipped, f34 after a 16-bit "
                        "warm-up ended 30.00 and a freeze at 20 after an 8-bit one diverged; if the clip keeps "
                        "quality, the warm-up's cost falls about 4x (about 1.2 bits/param/step in all)",
                        ["--codec", "none", "--sync", "ours-onebit-adam", "--freeze-step", "34"]),
    "ours-onebit-f134-noclip": ("ours-onebit-f134 without the clip (--max-update none), the method as the pilot "
                                "onebit-adam-q8-f134 ran it: the library's run trailed that pilot's at every epoch's "
                                "end so far (53.32 / 38.23 against 50.40 / 36.59 after epochs 1 / 2); the clip, or "
                                "the library's warm-up (its chunk count the last step's, 1-d tensors of 1024 or more "
                                "compressed too)?",
                                ["--codec", "none", "--sync", "ours-onebit-adam", "--freeze-step", "134",
                                 "--max-update", "none"]),
    "ours-onebit-f134-clip3": ("ours-onebit-f134 with the frozen update clipped at 3 learning rates per entry "
                               "(--max-update 3): clipped at 1 it ended 27.59, unclipped 27.17; on the digits CNN "
                               "a clip at 3 still prevented the divergence of a freeze at step 10 (0.947, NaN "
                               "unclipped). If it keeps the transformer's quality, 3 becomes the default; if not, "
                               "the default is no clip with a documented warning",
                               ["--codec", "none", "--sync", "ours-onebit-adam", "--freeze-step", "134",
                                "--max-update", "3"]),
    "ours-topk3-h1": ("our own path for the same idea: acc.DiLoCo with our TopK codec (3%, float32 values, error "
                      "feedback without decay), plain averaging every step: does SparseLoCo's decay and 2-bit add "
                      "or cost quality against ours?",
                      ["--codec", "topk", "--ratio", "0.03", "--sync", "diloco", "--sync-every", "1", "--outer-lr",
                       "1", "--outer-momentum", "0"]),
    "default-8s": ("the per-step default's codec as it runs once its link gate chose compression (8-bit sparse "
                   "chunks, Quantize(8, skip_energy=0.05), every step, static: on this unshaped machine the gate "
                   "itself would choose 16-bit dense), never run on an AdamW model at 10 Mbit/s: its bits/param/step "
                   "on the transformer (the embedding's gradient is mostly empty rows, which sparse chunks skip) "
                   "decide its arithmetic",
                   ["--codec", "quantize", "--bits", "8", "--skip-energy", "0.05", "--policy", "static",
                    "--interval", "100"]),
    "dense": ("the harness check: DDP's fp16_compress_hook on this seed under this runner (explore-diloco's run "
              "of it on the emulated cluster ended at 27.90)", ["--codec", "fp16"]),
}


FINDINGS = [
    "## What the pilots say",
    "",
    "- Compressing AdamW's *update* (its pseudo-gradients, which Adam has whitened) in rounds of local steps costs "
    "this model 2.3 points or more at half a bit per parameter (sparseloco-h1, signloco-h2): that family is dropped.",
    "- In gradient space 1-bit Adam keeps quality (onebit-adam-f134: 27.29, dense's 27.90 reached at step 1064 of "
    "1344), but its 16-bit warm-up is most of its cost (2.6 bits/param/step), and shortening the warm-up costs "
    "quality (f67 29.64, f34 30.00): the second moment freezes before it settles.",
    "- No warm-up at all (onebit-sharedv-64: the second moment from each rank's own gradients, averaged over the "
    "ranks on a doubling schedule, the momentum exchanged whitened by it): 28.24, never at 27.90, at 1.44 "
    "bits/param/step. The same with the ranks' 1-bit messages averaged exactly, without DeepSpeed's second "
    "compression on the server side (onebit-sharedv-64x, run while the working tree held later, unrelated edits; "
    "the code it ran is commit 6d7ece9's): it stalled near perplexity 148. Without a warm-up and with the momentum "
    "compressed in gradient units (as published) the loss went from 9.0 to 87.6 at the second step (a 30-step "
    "check, not a pilot).",
    "- **The warm-up carried by the per-step default's 8-bit sparse chunks instead of 16 bits** "
    "(onebit-adam-q8-f134): 27.23, dense's 27.90 reached at step 1008 (the 16-bit warm-up's run: 1064), at 1.27 "
    "bits/param/step (the warm-up 2.63, then 1.12). By link arithmetic alone (0.34 s of compute per step, the bits "
    "waited for at 10 Mbit/s, one rank's message each way, no latency and no codec time; dense's 1344 steps at "
    "0.34 s as the floor), that is 1.16x the floor to 27.90, against 1.77x with the 16-bit warm-up; the per-step "
    "default's codec never reached 27.90 (27.99), and to the end it is 2.19x. One seed, quality only: the next step is this "
    "method built into the library (its 1-bit level under the codec protocol with kernels, the freeze chosen by "
    "the regime detector) and protocol v5's sitting to cost it. A freeze at step 20 after such a warm-up diverged "
    "within 5 steps (a 30-step check): entries the sparse chunks sent rarely have a small second moment.",
    "- **The library's acc.OneBitAdam** (--sync ours-onebit-adam: warm-up through our compressor, acc.Sign with its "
    "C++ kernels) without the clip (ours-onebit-f134-noclip): 27.17, dense's 27.90 reached at step 1008, 1.40 "
    "bits/param/step (its 1-d tensors go in 32 bits, the pilot counted 16): it reproduces onebit-adam-q8-f134. "
    "With the frozen update clipped at 1 learning rate (ours-onebit-f134, the library default when it ran): 27.59, "
    "27.90 first reached at step 1176: the clip at 1 costs 0.4 points here. With a quarter of the warm-up "
    "(ours-onebit-f34, clipped): 30.10, no better than the unclipped 16-bit f34 (30.00): the clip prevents the "
    "divergence, not the quality lost to a second moment frozen early. On the digits CNN a freeze at step 10 of 44 "
    "trained to 0.947 clipped at 3 or at 10 (0.958 at 1, NaN unclipped). Clipped at 3 (ours-onebit-f134-clip3) "
    "the transformer ended at 27.18, 27.90 first reached at step 1008, as unclipped: 3 is the library default "
    "since (it keeps the digits run's early freeze from diverging and costs nothing here).",
    "- **Rounds of local steps, overlapped or with averaged moments (Streaming DiLoCo with eager updates, "
    "DES-LOC): dropped by arithmetic, no pilot.** Both keep DiLoCo's rounds and change what a round sends or when "
    "it lands; neither can shorten the rounds below what the budget allows. Fully overlapped, 10 Mbit/s affords "
    "about 1.7 bits/param/step: 16-bit pseudo-gradients every 16 steps (1.0), 4-bit every 4 (1.0), plus "
    "DES-LOC's moments (2 tensors per parameter every 3H and 6H: +0.5 at 16-bit, H 16). The lossless H-sweep "
    "on this seed (evidence-v4's diagnosis, docs/api.md) bounds their quality from above: plain float32 "
    "averaging every 4 steps ended 28.37 and every 16 29.18, against dense's 27.90, with nothing compressed, "
    "nothing stale and nothing of ours in the way. At H 4 a 4-bit round costs 1.0 bit/param/step, about what "
    "acc.OneBitAdam's frozen stage costs (1.12), and could match its quality (27.18) only by beating lossless "
    "averaging at the same H (28.37). "
    "Averaging the moments (DES-LOC) is the remaining lever, and H 1 with each rank's own moments (28.00) "
    "shows they are not what costs quality here.",
]


def run(name: str, timeout: float) -> dict:
    where = SCRATCH / name
    if (where / "run.json").exists():
        return json.loads((where / "run.json").read_text())
    where.mkdir(parents=True, exist_ok=True)
    why, flags = PILOTS[name]
    args = [*TASK, *flags, "--seed", str(SEED), "--logdir", str(where)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29577",
           "-m", "accordion_hvd.train", *args]
    # the code that runs is the checkout's at the start (the ranks import it then)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    started = time.monotonic()
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    (where / "log.txt").write_text((out.stdout + out.stderr)[-20000:])
    record = {"pilot": name, "why": why, "seed": SEED, "exit": out.returncode,
              "seconds": round(time.monotonic() - started, 1),
              "command": "torchrun --nproc_per_node 2 -m accordion_hvd.train " + " ".join(args[:-1]) + " DIR",
              "commit": head.strip() + ("+uncommitted" if dirty else ""),
              "machine": f"{platform.node()}, {platform.processor() or platform.machine()}, 2 ranks x 1 thread"}
    (where / "run.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def summary(where: Path) -> dict:
    """Validation perplexity at each epoch's end, the best, bits/param/step, rounds."""
    with open(where / "eval.csv", newline="") as f:
        evals = list(csv.DictReader(f))
    with open(where / "steps.csv", newline="") as f:
        steps = list(csv.DictReader(f))
    ends = [float(e["perplexity"]) for e, before in zip(evals, [None] + evals[:-1])
            if int(e["epoch"]) >= 1 and (before is None or before["epoch"] != e["epoch"])]
    last = steps[-1]
    bits = float(last["wire_bits"]) if "wire_bits" in last else 8 * float(last["bytes_sent"])
    reach = next((int(e["step"]) for e in evals if float(e["perplexity"]) <= DENSE_FINAL), None)
    return {"ends": ends, "best": min(float(e["perplexity"]) for e in evals), "steps": int(last["step"]), "reach": reach,
            "bits_per_param_step": bits / PARAMS / int(last["step"]), "rounds": int(last.get("syncs") or 0)}


def pack() -> None:
    """The raw runs into one archive (members sorted, times zeroed: the same runs give the same
    bytes) and the report beside it."""
    OUT.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(p for p in SCRATCH.rglob("*") if p.is_file()):
            info = tar.gettarinfo(str(path), arcname=str(path.relative_to(SCRATCH)))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with open(path, "rb") as f:
                tar.addfile(info, f)
    import lzma
    (OUT / "runs.tar.xz").write_bytes(lzma.compress(buffer.getvalue(), preset=9))
    lines = ["# Issue 80's pilots (never scored)", "",
             "`.venv/bin/python benchmarks/explore_v5.py --pack`; the pilots and why each runs: "
             "[benchmarks/explore_v5.py](../../explore_v5.py); raw runs in `runs.tar.xz` (`tar xJf`). The transformer "
             "(AdamW), pilot seed 3, 2 ranks, quality only. 16-bit dense on this seed: 27.90 after 6 epochs "
             "(explore-diloco transformer-1gbit dense); lossless averaging every 1 / 4 / 16 / 64 steps 28.00 / 28.37 / "
             "29.18 / 29.87. Budget at 10 Mbit/s within 1.5x the floor (issue 80): 0.6 bits/param/step waiting, 1.7 "
             "overlapped.", "",
             "| pilot | commit | validation perplexity at each epoch's end | best | first at or below 27.90 "
             "(step of 1344) | bits/param/step | rounds |",
             "|---|---|---|---|---|---|---|"]
    for name in sorted(PILOTS, key=lambda n: "skipped" in json.loads((SCRATCH / n / "run.json").read_text())
                       if (SCRATCH / n / "run.json").exists() else True):
        where = SCRATCH / name
        if not (where / "run.json").exists():
            continue
        record = json.loads((where / "run.json").read_text())
        if "skipped" in record:
            lines.append(f"| {name} | - | {record['skipped']} | | | | |")
            continue
        if not (where / "eval.csv").exists():
            lines.append(f"| {name} | {record['commit']} | exit {record['exit']}, no evaluation | | | | |")
            continue
        s = summary(where)
        note = f" (stopped {record['stopped']})" if "stopped" in record else ""
        lines.append(f"| {name} | {record['commit']} | {', '.join(f'{x:.2f}' for x in s['ends'])}{note} | "
                     f"{s['best']:.2f} | {s['reach'] or 'never'} | {s['bits_per_param_step']:.3f} | {s['rounds']} |")
    (OUT / "README.md").write_text("\n".join(lines + ["", *FINDINGS]) + "\n")
    print(f"wrote {OUT / 'runs.tar.xz'} and {OUT / 'README.md'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pilots", help="comma-separated, of: " + ", ".join(PILOTS))
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--pack", action="store_true")
    args = p.parse_args()
    if args.pack:
        pack()
        return
    names = [n.strip() for n in (args.pilots or "").split(",") if n.strip()]
    unknown = sorted(set(names) - set(PILOTS))
    if not names or unknown:
        p.error(f"--pilots: give some of {list(PILOTS)} (unknown: {unknown})")
    for name in names:
        record = run(name, args.timeout)
        print(f"{name}: " + (record["skipped"] if "skipped" in record else
                             f"exit {record['exit']}, {record['seconds']:.0f} s"), flush=True)


if __name__ == "__main__":
    main()
