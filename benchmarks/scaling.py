"""Step time at 2 to 256 workers, predicted by the cost model from runs on 2 nodes.

    .venv/bin/python benchmarks/scaling.py benchmarks/results/costmodel-runs \\
        --out benchmarks/results/scaling.md

We have two cores, not 256 machines: this predicts. For each model and link rate measured
on 2 emulated nodes (benchmarks/step_time.py, with the step worker's collective timings):

* **the link**: the median latency and bandwidth that our compressor fitted online in that
  setting's runs (``AccordionCompressor.measure_link``); a third, faster link is the
  1 Gbit/s fit with 10x the bandwidth (same latency), labelled as such;
* **our methods**: each run's steps 4-12, their buckets and rounds as issued (bytes, and
  each bucket's ready time as a fraction of backward), on a **common compute**: the floor
  run's forward, backward and optimizer step, plus the method's own codec math (its
  median seconds of compression per step, added to backward). On this shared VM the
  compute of two runs minutes apart differs by 10-20%, which would otherwise decide
  which method "wins"; the math is what truly differs between them. Replayed by
  ``costmodel.step_s`` at each world size, the median over the steps. Straggling ranks
  are not modelled (benchmarks/costmodel_check.py does, for the runs as measured); PowerSGD's rounds are allreduces (ring: bytes on the
  critical path nearly constant in the world size, latency terms growing with it); TopK's
  are allgathers (each rank receives every other rank's values: growing with the world);
* **16-bit dense** (the baseline that counts): the floor run's compute, and DDP's buckets
  (1 MB, then 25 MB of float32 gradients, in reverse registration order) of fp16
  gradients, each bucket ready when backward has reached its last parameter, assuming
  backward produces gradients at a constant rate per byte (an assumption: convolutions'
  compute is not proportional to their parameters). Checked against the measured
  ``ddp-fp16`` runs on 2 nodes where the folder has them.

Compute per worker stays as measured on this VM (weak scaling, batch 32 per worker); what
changes with the world size is only the network, and nothing here models congestion,
stragglers or a switch's oversubscription. Writes the .md and a PNG per model beside it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from accordion_hvd.costmodel import Bucket, Link, Round, step_s  # noqa: E402
from costmodel_check import STEPS, load, online_link, rank_compute, step_buckets  # noqa: E402
from report import kept_analysis  # noqa: E402

WORLDS = (2, 4, 8, 16, 32, 64, 128, 256)
OURS = ("ours-r1", "ours-r4", "ours-accordion", "ours-topk1", "ours-topk10")
LABELS = {"fp16": "16-bit dense (DDP buckets)", "ours-r1": "ours PowerSGD r1", "ours-r4": "ours PowerSGD r4",
          "ours-accordion": "ours Accordion r1<->4", "ours-topk1": "ours TopK 1%", "ours-topk10": "ours TopK 10%"}
FIRST_BUCKET, BUCKET = 1 << 20, 25 << 20  # DDP's defaults, in float32 bytes


def dense_buckets(model: str, backward_s: float) -> list[Bucket]:
    """DDP's buckets of ``model``'s gradients, sent in fp16 (see module doc)."""
    from step_worker import build_model
    sizes = [p.numel() * 4 for p in reversed(list(build_model(model)[0].parameters()))]
    total, done, cap, current, buckets = sum(sizes), 0, FIRST_BUCKET, 0, []
    for i, nbytes in enumerate(sizes):
        current += nbytes
        done += nbytes
        if current >= cap or i == len(sizes) - 1:
            buckets.append(Bucket(backward_s * done / total, [Round("allreduce", current / 2)]))
            current, cap = 0, BUCKET
    return buckets


def median_step(run: dict, fn) -> float:
    return statistics.median(fn(s) for s in STEPS)


def floor_compute(floor: dict) -> tuple[float, float, float]:
    """The floor run's median forward, backward and optimizer step."""
    return tuple(median_step(floor, lambda s, k=k: floor["phases"][s][k]) for k in ("forward", "backward", "step"))


def predict_ours(run: dict, floor: dict, link: Link, world: int) -> float:
    """``run``'s buckets and rounds on the floor's compute plus ``run``'s own codec math (see
    module doc): the methods differ by their math and their traffic only, not by the noise
    of the moment each ran at."""
    forward, backward, optimizer = floor_compute(floor)
    backward += statistics.median(run["ours"][s]["compress"] for s in STEPS)

    def one(s: int) -> float:
        own = rank_compute(run, s)[0][1]
        buckets = step_buckets(run, s, stretch=backward / own if own > 0 else 1.0)
        return step_s(forward, backward, buckets, link, world, optimizer)
    return median_step(run, one)


def predict_dense(floor: dict, model: str, link: Link, world: int) -> float:
    forward, backward, optimizer = floor_compute(floor)
    return step_s(forward, backward, dense_buckets(model, backward), link, world, optimizer)


def settings(folder: Path) -> dict[tuple[str, str], dict[str, dict]]:
    """(model, rate) -> method -> run, from the 2-node runs (the first round of each)."""
    out: dict[tuple[str, str], dict[str, dict]] = {}
    for key, methods in sorted(load(folder).items()):
        model, nodes, rate = key.rsplit("-r", 1)[0].rsplit("-", 2)
        if nodes == "2n":
            for method, run in methods.items():
                out.setdefault((model, rate), {}).setdefault(method, run)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    from results_archive import restore  # the raw runs: unpacked from their archive if missing
    restore(args.folder)
    found = settings(args.folder)
    lines = ["# Step time at 2 to 256 workers, predicted by the cost model", "",
             f"Command: `.venv/bin/python benchmarks/scaling.py {args.folder} --out {args.out}`. Inputs: the 2-node runs "
             f"in `{args.folder}` (benchmarks/step_time.py on the emulated cluster). How each number is made: the "
             "docstring of benchmarks/scaling.py; how well the model predicts the measured runs: "
             "[costmodel.md](costmodel.md). Plots: `scaling-MODEL.png` beside this file.", ""]
    figures = {}
    for model in sorted({m for m, _ in found}):
        links: dict[str, tuple[Link, str]] = {}
        for (m, rate), methods in found.items():
            fitted = [online_link(r) for name, r in methods.items() if name in OURS and online_link(r)]
            if m == model and fitted:
                link = Link(statistics.median(x.alpha for x in fitted), statistics.median(x.beta for x in fitted))
                links[rate] = (link, f"fitted online, median of {len(fitted)} runs")
        if "1gbit" in links:
            base = links["1gbit"][0]
            links["10gbit"] = (Link(base.alpha, base.beta / 10), "1 Gbit/s fit with 10x the bandwidth (extrapolated)")
        lines += [f"## {model}", ""]
        curves: dict[str, dict[str, list[float]]] = {}
        for rate, (link, how) in sorted(links.items(), key=lambda kv: kv[1][0].beta, reverse=True):
            methods = found.get((model, rate)) or found[(model, "1gbit")]  # 10gbit: the 1 Gbit/s runs' compute
            table = {}
            if "floor" in methods:
                table["fp16"] = [predict_dense(methods["floor"], model, link, w) for w in WORLDS]
            for name in OURS:
                if name in methods and "collectives" in methods[name] and "floor" in methods:
                    table[name] = [predict_ours(methods[name], methods["floor"], link, w) for w in WORLDS]
            curves[rate] = table
            lines += [f"### {rate}: {link.alpha * 1e6:.0f} us per message, {8 / link.beta / 1e6:.0f} Mbit/s ({how})",
                      "", "| predicted s/step | " + " | ".join(str(w) for w in WORLDS) + " |",
                      "|---|" + "---:|" * len(WORLDS)]
            for name, values in table.items():
                lines.append(f"| {LABELS[name]} | " + " | ".join(f"{v:.2f}" for v in values) + " |")
            winners = [min(table, key=lambda n: table[n][i]) for i in range(len(WORLDS))]
            lines.append("| **fastest** | " + " | ".join(LABELS[w].replace("ours ", "") for w in winners) + " |")
            if "ddp-fp16" in methods and "floor" in methods:
                measured = median_step(methods["ddp-fp16"], lambda s: methods["ddp-fp16"]["walls"][s])
                lines += ["", f"Check at 2 workers: 16-bit dense predicted {table['fp16'][0]:.2f} s, DDP's "
                              f"`fp16_compress_hook` measured {measured:.2f} s "
                              f"({100 * (table['fp16'][0] - measured) / measured:+.0f}%)."]
            lines.append("")
        figures[model] = curves
    lines += kept_analysis(args.out)  # the hand-written reading below the tables, kept across reruns
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(figures, args.out)


def plot(figures: dict, out: Path) -> None:
    from matplotlib.figure import Figure
    for model, curves in figures.items():
        fig = Figure(figsize=(4.2 * len(curves), 3.6))
        for i, (rate, table) in enumerate(curves.items()):
            ax = fig.add_subplot(1, len(curves), i + 1)
            for name, values in table.items():
                ax.plot(WORLDS, values, marker="o", markersize=3, label=LABELS[name])
            ax.set_xscale("log", base=2)
            ax.set_xlabel("workers")
            ax.set_ylabel("predicted seconds per step")
            ax.set_title(f"{model}, {rate}")
            ax.grid(alpha=0.3)
        fig.axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out.with_name(f"{out.stem}-{model}.png"), dpi=110)


if __name__ == "__main__":
    main()
