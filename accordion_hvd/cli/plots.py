"""Figures from the CSV files that ``MetricsLogger`` writes: ``python -m accordion_hvd.cli.plots``.

    python -m accordion_hvd.cli.plots runs/accordion                   # into runs/accordion/
    python -m accordion_hvd.cli.plots --compare low=runs/low high=runs/high accordion=runs/acc --out figs

One run: test accuracy against cumulative floats sent and against wall-clock time, and a
timeline of every layer's compression level (under it, for a DiLoCo run, how many inner steps
each round took: the interval its policy chose). Several runs (the results section: static
low, static high and Accordion side by side): one line per run on the accuracy plots.

Figures are drawn on ``matplotlib.figure.Figure`` objects, which render with Agg without
pyplot, so importing this module never changes the caller's matplotlib backend.
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import sys
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import EngFormatter

from .metrics import EVAL_CSV, LEVEL_PREFIX, STEPS_CSV

log = logging.getLogger("accordion_hvd.plots")

# Level colours: known levels first, then any other level string, then a missing cell.
LEVEL_COLOURS = {"normal": "#4C72B0", "critical": "#D64541", "dense": "#9A9A9A"}
OTHER_COLOURS = ("#55A868", "#8172B2", "#CCB974", "#64B5CD", "#E377C2", "#8C564B")
MISSING_COLOUR = "#FFFFFF"
# Timeline columns at most: fewer than the axes' pixels, so that drawing drops no column.
MAX_COLUMNS = 600
DPI = 120
INTERVAL_COLUMN = "sync_interval"


def _read_csv(path: Path) -> list[dict]:
    """Rows of a CSV file; a row cut short by a killed run is dropped."""
    if not path.is_file():
        raise FileNotFoundError(f"no {path.name} at {path}: is this a logdir written by MetricsLogger?")
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if rows and None in rows[-1].values():
        log.warning("%s: dropping its incomplete last row", path)
        rows.pop()
    return rows


def _column(rows: list[dict], name: str, path: Path) -> np.ndarray:
    try:
        return np.array([float(r[name]) for r in rows])
    except KeyError:
        raise ValueError(f"{path} has no column {name!r}") from None


def _line_style(i: int) -> dict:
    """The i-th line's colour, dash and marker: no two of up to 20 lines share a colour (tab20's
    strong shades first, then its light ones), and neighbours differ in dash and marker too, so
    a plot of a dozen methods stays readable in grey."""
    colour = colormaps["tab20"]((2 * i) % 20 + (i // 10) % 2)
    return {"color": colour, "linestyle": ("-", "--", "-.", ":")[i % 4], "marker": "osD^vP"[i % 6]}


def _accuracy_figure(curves: dict[str, tuple[np.ndarray, np.ndarray]], xlabel: str, title: str,
                     log_x: bool | None = None, metric: str = "accuracy") -> Figure:
    """Test accuracy (%) or perplexity against x, one line per curve. ``log_x=None``:
    logarithmic x when every x is positive and they span two decades or more (runs
    compressed by different factors then stay apart instead of squeezing the gentler ones
    against the axis)."""
    fig = Figure(figsize=(6.4, 4.2), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    scale = 100 if metric == "accuracy" else 1
    for i, (label, (x, acc)) in enumerate(curves.items()):
        ax.plot(x, scale * acc, markersize=3, label=label, **_line_style(i))
    xs = np.concatenate([x for x, _ in curves.values()])
    if log_x is None:
        log_x = bool(xs.size) and xs.min() > 0 and xs.max() / xs.min() >= 100
    if log_x:
        ax.set_xscale("log")
    elif "(s)" not in xlabel:  # counts: 20M rather than 2 with a 1e7 offset (seconds keep plain numbers: 0.5, not 500 m)
        ax.xaxis.set_major_formatter(EngFormatter())
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test accuracy (%)" if metric == "accuracy" else "validation perplexity")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if len(curves) > 1:
        ax.legend()
    return fig


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path)
    log.info("wrote %s", path)
    return path


def eval_metric(rows: list[dict]) -> str:
    """"accuracy" or "perplexity": the column an eval.csv fills."""
    return "perplexity" if rows and rows[0].get("perplexity") not in (None, "") else "accuracy"


def _eval_curves(logdir: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """floats sent, wall time and the evaluated metric of each evaluation, and its name."""
    path = logdir / EVAL_CSV
    rows = _read_csv(path)
    metric = eval_metric(rows)
    return _column(rows, "floats_sent", path), _column(rows, "wall_s", path), _column(rows, metric, path), metric


FLOATS_LABEL = "floats sent by rank 0, cumulative (count)"
TIME_LABEL = "wall-clock time (s)"


def _regime_matrix(rows: list[dict], layers: list[str], max_columns: int):
    """Level categories, and a (layers x columns) matrix of category indices. Over
    ``max_columns`` steps, each column is the most frequent level of its block of steps."""
    levels = {r[LEVEL_PREFIX + n] for r in rows for n in layers}
    categories = [c for c in LEVEL_COLOURS if c in levels] + sorted(levels - set(LEVEL_COLOURS) - {""})
    categories += [""] if "" in levels else []
    index = {c: i for i, c in enumerate(categories)}
    codes = np.array([[index[r[LEVEL_PREFIX + n]] for r in rows] for n in layers], dtype=np.int64)
    if codes.shape[1] > max_columns:
        starts = np.linspace(0, codes.shape[1], max_columns, endpoint=False).astype(np.int64)
        onehot = (codes[None] == np.arange(len(categories))[:, None, None]).astype(np.int32)
        codes = np.add.reduceat(onehot, starts, axis=2).argmax(axis=0)
    return categories, codes


def _intervals(rows: list[dict]) -> np.ndarray | None:
    """DiLoCo's inner steps per round at each logged step (steps.csv's ``sync_interval``, the
    periodic front ends' record), or None for a run without it."""
    if not rows or rows[0].get(INTERVAL_COLUMN) in (None, ""):
        return None
    return np.array([int(r[INTERVAL_COLUMN]) for r in rows])


def _interval_panel(ax, steps: list[int], intervals: np.ndarray) -> None:
    """How often the ranks met, under the levels (same steps): a step line on a log2 axis."""
    ax.step(steps, intervals, where="post", color="#333333", linewidth=1.2)
    ax.set_yscale("log", base=2)
    rungs = sorted(set(intervals.tolist()))
    ax.set_yticks(rungs, [str(r) for r in rungs], fontsize=8)
    ax.minorticks_off()
    ax.set_ylim(min(rungs) / 1.5, max(rungs) * 1.5)
    ax.set_ylabel("inner steps\nper round")
    ax.set_xlabel("training step")


def _regimes_figure(rows: list[dict], layers: list[str], title: str, max_columns: int = MAX_COLUMNS) -> Figure:
    """The level of every layer at every logged step (one row per layer); for a DiLoCo run
    (steps.csv has ``sync_interval``) the interval in a panel under it, on the same steps."""
    categories, codes = _regime_matrix(rows, layers, max_columns)
    others = iter(OTHER_COLOURS * (1 + len(categories) // len(OTHER_COLOURS)))
    colours = [LEVEL_COLOURS.get(c) or (MISSING_COLOUR if c == "" else next(others)) for c in categories]
    steps = [int(r["step"]) for r in rows]
    n = len(layers)
    intervals = _intervals(rows)
    height = max(2.6, 0.26 * n + 1.6)
    if intervals is None:
        fig = Figure(figsize=(11, height), dpi=DPI, layout="constrained")
        ax = fig.add_subplot()
    else:
        fig = Figure(figsize=(11, height + 1.4), dpi=DPI, layout="constrained")
        ax, below = fig.subplots(2, 1, sharex=True, height_ratios=[height, 1.4])
        _interval_panel(below, steps, intervals)
    # Columns are taken as evenly spaced from the first logged step to the last.
    ax.imshow(codes, cmap=ListedColormap(colours), vmin=-0.5, vmax=len(categories) - 0.5,
              interpolation="nearest", aspect="auto", extent=(steps[0], steps[-1] + 1, n - 0.5, -0.5))
    ax.set_yticks(range(n), layers, fontsize=8 if n <= 12 else 6)
    if intervals is None:
        ax.set_xlabel("training step")
    ax.set_ylabel("layer")
    block = len(rows) / codes.shape[1]
    ax.set_title(title + (f" (one column = {block:.1f} logged steps, most frequent level)" if block > 1 else ""))
    handles = [Patch(facecolor=col, edgecolor="black", linewidth=0.5, label=c or "not logged")
               for c, col in zip(categories, colours)]
    fig.legend(handles=handles, loc="outside upper right", ncols=len(handles), fontsize=8, frameon=False)
    return fig


def plot_run(logdir, out_dir=None) -> list[Path]:
    """accuracy_vs_floats.png, accuracy_vs_time.png and regimes.png of one run, in
    ``out_dir`` (default: the logdir). A figure with no data yet (a run killed before its
    first evaluation, a run with no compressed layers) is skipped with a warning."""
    logdir = Path(logdir)
    out = Path(out_dir) if out_dir is not None else logdir
    steps = _read_csv(logdir / STEPS_CSV)
    floats, wall, acc, metric = _eval_curves(logdir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    what = "test accuracy" if metric == "accuracy" else "validation perplexity"
    if acc.size:
        curve = {logdir.name: (floats, acc)}
        written.append(_save(_accuracy_figure(curve, FLOATS_LABEL, f"{what} vs communication: {logdir.name}",
                                              metric=metric), out / f"{metric}_vs_floats.png"))
        curve = {logdir.name: (wall, acc)}
        written.append(_save(_accuracy_figure(curve, TIME_LABEL, f"{what} vs time: {logdir.name}", metric=metric),
                             out / f"{metric}_vs_time.png"))
    else:
        log.warning("%s has no evaluations yet: no accuracy figures", logdir / EVAL_CSV)
    layers = [c[len(LEVEL_PREFIX):] for c in (steps[0] if steps else {}) if c.startswith(LEVEL_PREFIX)]
    if layers:
        written.append(_save(_regimes_figure(steps, layers, f"compression level per layer: {logdir.name}"),
                             out / "regimes.png"))
    else:
        log.warning("%s has no steps or no layer levels: no regimes figure", logdir / STEPS_CSV)
    return written


def plot_curves(curves: dict[str, tuple[np.ndarray, np.ndarray]], xlabel: str, title: str, path,
                log_x: bool | None = None, metric: str = "accuracy") -> Path:
    """One PNG: test accuracy (a fraction) or perplexity against any x, one line per label."""
    return _save(_accuracy_figure(curves, xlabel, title, log_x, metric=metric), Path(path))


def compare_runs(runs: dict, out_dir) -> list[Path]:
    """compare_accuracy_vs_floats.png and compare_accuracy_vs_time.png: one line per run,
    ``runs`` mapping a legend label to a logdir."""
    if not runs:
        raise ValueError("compare_runs: no runs given")
    evals = {label: _eval_curves(Path(d)) for label, d in runs.items()}
    metrics = {m for *_, m in evals.values()}
    if len(metrics) > 1:
        raise ValueError(f"compare_runs: the runs evaluate different metrics ({sorted(metrics)})")
    metric = metrics.pop()
    what = "test accuracy" if metric == "accuracy" else "validation perplexity"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    by_floats = {label: (f, a) for label, (f, _, a, _) in evals.items()}
    by_time = {label: (w, a) for label, (_, w, a, _) in evals.items()}
    return [
        _save(_accuracy_figure(by_floats, FLOATS_LABEL, f"{what} vs communication", metric=metric),
              out / f"compare_{metric}_vs_floats.png"),
        _save(_accuracy_figure(by_time, TIME_LABEL, f"{what} vs time", metric=metric),
              out / f"compare_{metric}_vs_time.png"),
    ]


def main(argv=None) -> list[Path]:
    p = argparse.ArgumentParser(prog="python -m accordion_hvd.cli.plots", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logdir", nargs="?", help="a run's logdir: draw its figures")
    p.add_argument("--out", help="where to write the PNGs (default: LOGDIR; with only --compare: the folder that "
                                 "holds the compared runs)")
    p.add_argument("--compare", nargs="+", metavar="LABEL=DIR", help="runs to draw side by side")
    args = p.parse_args(argv)
    if args.logdir is None and not args.compare:
        p.error("give a LOGDIR, --compare LABEL=DIR ..., or both")
    runs = {}
    for item in args.compare or ():
        label, sep, path = item.partition("=")
        if not (sep and label and path):
            p.error(f"--compare expects LABEL=DIR, got {item!r}")
        runs[label] = path
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    written = []
    try:
        if args.logdir is not None:
            written += plot_run(args.logdir, args.out)
        if runs:
            written += compare_runs(runs, args.out or args.logdir or os.path.commonpath(
                [str(Path(d).resolve().parent) for d in runs.values()]))
    except (OSError, ValueError) as exc:
        p.exit(1, f"{p.prog}: error: {exc}\n")
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main(sys.argv[1:])
