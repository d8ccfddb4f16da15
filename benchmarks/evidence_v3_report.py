"""The summary of protocol evidence-v3 (benchmarks/protocols/evidence-v3.md): per setting, each
method's time to the target against the compute floor and the baseline, measured or computed
(the protocol's cells), then the issue's bars judged on them.

    .venv/bin/python benchmarks/evidence_v3_report.py    # benchmarks/results/evidence-v3.md, figures beside it

Reads only committed files: the runs under ``benchmarks/results/evidence-v3/SETTING/METHOD/seedS``
and the step-time sittings (``step-time-MODEL.csv``). A cell whose runs are not all there is shown
with what there is, and a bar that reads it says "not decided", unless a seed that ran never
reached the target: the bars need every seed, so that seed decides them ("no").
"""

from __future__ import annotations

import math
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import evidence_v3 as v3  # noqa: E402
import evidence_v3_cells as cells  # noqa: E402

REPORT = v3.OUT.parent / f"{v3.PROTOCOL}.md"
ORDER = ("hvd-fp16", "ddp-fp16", "default", "quantize-accordion", "batch-accordion", "torch-localsgd",
         "diloco-paper", "diloco-h-ours", "diloco-auto")
OURS, PEERS, RECOMMENDED = "diloco-auto", ("diloco-paper", "torch-localsgd", "default"), ("default", "diloco-auto")
FLOOR_BARS = {"10mbit": 1.5, "100mbit": 1.25}  # diloco-auto's time over the floor (lstm and transformer)


def read_run(where: Path, protocol: str = v3.PROTOCOL) -> dict | None:
    """A finished run: its evaluations, measured walls and the measures the tables show."""
    if v3.final_and_wall(where, protocol) is None:
        return None
    evals, step_walls = cells.records(where)
    log = (where / "log.txt").read_text()
    final = re.findall(r"final test perplexity: ([0-9.]+|inf|nan)", log)
    standard = [e for e in evals if int(e["epoch"]) == 6]
    last = (where / "steps.csv").read_text().splitlines()
    header, end = last[0].split(","), last[-1].split(",")
    return {"evals": evals, "step_walls": step_walls, "walls": [float(e["wall_s"]) for e in evals],
            "standard": float(standard[0]["perplexity"]) if standard else math.nan,
            "test": float(final[-1]) if final else math.nan, "floats": int(end[header.index("floats_sent")]),
            "syncs": int(end[header.index("syncs")]) if "syncs" in header else None, "diverged": "diverged" in log,
            "bytes": int(end[header.index("bytes_sent")]) if "bytes_sent" in header else None}


def cell(setting: str, method: str, times: dict | None) -> tuple[str, dict[int, dict]]:
    """("measured" | "computed" | "", {seed: run}) for a method at a setting, the computed runs'
    walls replaced by their steps x the sitting's step at the setting's rate + their evaluations."""
    task, rate = v3.SETTINGS[setting]
    if v3.runs_at(setting, method) and not (rate != "100mbit" and method in v3.BASELINES):  # (1 Gbit/s: a check)
        return "measured", {s: r for s in v3.SEEDS if (r := read_run(v3.run_dir(setting, method, s)))}
    source = f"{task}-100mbit"
    if times is None or method not in cells.SITTING_METHOD or not v3.runs_at(source, method):
        return "", {}
    runs = {s: r for s in v3.SEEDS if (r := read_run(v3.run_dir(source, method, s)))}
    if not runs:
        return "", {}
    step_s = cells.step_time(times, rate, method)
    for r in runs.values():
        r["walls"] = cells.computed_walls(r["evals"], r["step_walls"], step_s)
    return "computed", runs


def reached(runs: dict[int, dict], target: float) -> tuple[float | None, list[str]]:
    """The mean time to target over the protocol's seeds: inf when one that ran never reached
    it (with each such seed's best: the bars need every seed, so that decides them whatever
    the missing seeds would do), None while a seed is missing and none has missed."""
    times = {s: cells.time_to(r["evals"], r["walls"], target) for s, r in runs.items()}
    missed = [f"seed {s}: best {min(float(e['perplexity']) for e in runs[s]['evals']):.2f}"
              + (", diverged" if runs[s]["diverged"] else "") for s, t in times.items() if t is None]
    if len(runs) < len(v3.SEEDS) and not missed:
        return None, missed
    return (math.inf if missed else statistics.mean(times.values())), missed


def mean_sd(values: list[float], fmt: str = ".2f") -> str:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "-"
    sd = f" ± {format(statistics.stdev(values), fmt)}" if len(values) > 1 else ""
    return format(statistics.mean(values), fmt) + sd


def setting_table(setting: str) -> tuple[list[str], dict]:
    """The setting's lines and what the bars read: {"floor", "baseline_wall", "means": {method: s or None}}."""
    task, rate = v3.SETTINGS[setting]
    frozen = v3.frozen_setting(setting)
    sitting = cells.sitting_file(v3.OUT, task)
    times = cells.step_times(sitting) if sitting.exists() else None
    if frozen is None:
        return [f"## {setting}", "", "No target yet (the baselines' runs or the step-time sitting are missing).", ""], {}
    target, base_wall, base = frozen["target_perplexity"], frozen["baseline_wall_s"], frozen["baseline"]
    baseline_runs = [cells.records(v3.OUT / where) for where in frozen["from"] if f"/{base}/" in f"/{where}"]
    floor = cells.floor_seconds(baseline_runs, times[(rate, "floor")]) if times and (rate, "floor") in times else None
    floor_text = f"{floor:.0f} s" if floor else "not measured yet"
    worst = max(float(evals[-1]["perplexity"]) for evals, _ in baseline_runs)  # the protocol's "also" target
    lines = [f"## {setting}", "",
             f"Target: validation perplexity {target:.2f} ({base}'s mean final, {v3.PROTOCOL}/{frozen['from'][0].split('/')[0]}); "
             f"the baseline's mean wall time {base_wall:.0f} s{' (computed)' if 'computed' in frozen else ''}; "
             f"cap {frozen['cap_s']:.0f} s; **compute floor {floor_text}**. *To {worst:.2f}*: time to the worst of the "
             f"baseline's final validation perplexities.", "",
             "| method | cell | seeds | time to target, mean s (x floor, x baseline) | sd s | to "
             f"{worst:.2f}, mean s | validation after 6 epochs | test | floats sent per rank | syncs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    means, missing, rows = {}, {}, [(m, *cell(setting, m, times)) for m in ORDER]
    if rate == "1gbit":  # the computation's check: the faster baseline's seed 0 measured at this rate
        rows += [(m, "measured (check)", {s: r for s in v3.SEEDS if (r := read_run(v3.run_dir(setting, m, s)))})
                 for m in v3.BASELINES]
    for method, kind, runs in rows:
        if not runs:
            continue
        if kind == "measured (check)":
            lines.append(check_row(method, runs, rows_of(rows, method)))
            continue
        mean, missed = reached(runs, target)
        means[method], missing[method] = mean, missed
        if mean is not None and math.isfinite(mean):
            over = f", {mean / floor:.2f}x" if floor else ""
            shown = f"{mean:.0f} ({over[2:]}{', ' if over else ''}{mean / base_wall:.2f}x)"
        else:
            shown = (f"not reached in {len(missed)} ({'; '.join(missed)})" if missed else "") + \
                (f" ({len(runs)} of {len(v3.SEEDS)} seeds run)" if len(runs) < len(v3.SEEDS) else "")
        hits = [t for r in runs.values() if (t := cells.time_to(r["evals"], r["walls"], target)) is not None]
        syncs = [r["syncs"] for r in runs.values() if r["syncs"] is not None]
        loose, _ = reached(runs, worst)
        lines.append(f"| {method} | {kind} | {len(runs)} | {shown} | {mean_sd(hits, '.0f') if len(hits) > 1 else '-'} | "
                     f"{seconds(loose).removesuffix(' s')} | {mean_sd([r['standard'] for r in runs.values()])} | {mean_sd([r['test'] for r in runs.values()])} | "
                     f"{statistics.mean(r['floats'] for r in runs.values()):.3g} | "
                     f"{mean_sd(syncs, '.0f') if syncs else '-'} |")
    return lines + [""], {"floor": floor, "baseline_wall": base_wall, "means": means, "missed": missing}


def seconds(mean: float | None) -> str:
    return "-" if mean is None else ("not reached" if math.isinf(mean) else f"{mean:.0f} s")


def rows_of(rows: list[tuple], method: str) -> dict[int, dict]:
    """The computed runs of ``method`` among a setting's rows."""
    return next((runs for m, kind, runs in rows if m == method and kind == "computed"), {})


def check_row(method: str, measured: dict[int, dict], computed: dict[int, dict]) -> str:
    """The 1 Gbit/s check: a baseline's seed measured at the rate beside the same seed computed."""
    cells_ = []
    for seed, run in sorted(measured.items()):
        real = run["walls"][-1]
        other = computed.get(seed)
        cells_.append(f"seed {seed}: {real:.0f} s measured, " +
                      (f"{other['walls'][-1]:.0f} s computed ({real / other['walls'][-1]:.2f}x)" if other else
                       "not computed"))
    return f"| {method} | measured (check): the whole run's wall | {len(measured)} | {'; '.join(cells_)} | | | | | | |"


def bars(judged: dict[str, dict]) -> list[str]:
    """The issue's bars on the settings' means ({setting: setting_table's second value}; a mean
    is inf where a seed never reached the target, which decides a bar; None while a seed is
    missing and none missed: not decided)."""
    out = ["| bar | setting | figure | met |", "|---|---|---|---|"]

    def row(bar: str, setting: str, figure: str, met: bool | None) -> None:
        out.append(f"| {bar} | {setting} | {figure} | {'not decided' if met is None else ('**yes**' if met else 'no')} |")

    for setting, got in judged.items():
        if not got:
            continue
        task, rate = v3.SETTINGS[setting]
        means, floor = got["means"], got["floor"]
        ours = means.get(OURS)
        if task != "heldout" and rate in FLOOR_BARS:
            limit = FLOOR_BARS[rate]
            row(f"diloco-auto within {limit}x the compute floor", setting,
                f"not reached ({'; '.join(got.get('missed', {}).get(OURS, []))})" if ours is not None and math.isinf(ours) else
                f"{ours / floor:.2f}x" if ours is not None and floor else "-",
                None if ours is None or floor is None else ours <= limit * floor)
        for peer in PEERS:
            theirs = means.get(peer)
            row(f"diloco-auto ahead of {peer}", setting, f"{seconds(ours)} vs {seconds(theirs)}",
                False if ours is not None and math.isinf(ours) else  # never reached: ahead of no one
                None if theirs is None or ours is None else ours < theirs)
        if rate == "1gbit":
            for method in RECOMMENDED:
                mine = means.get(method)
                row(f"{method} not later than the baseline", setting,
                    f"{seconds(mine)} vs {got['baseline_wall']:.0f} s",
                    None if mine is None else mine <= got["baseline_wall"])
    return out


def five_x_check() -> list[str]:
    """The protocol's condition on the slow rate: 16-bit dense's step at least 5x the compute-only step."""
    out = []
    for task in v3.TASK_RATES:
        sitting = cells.sitting_file(v3.OUT, task)
        if not sitting.exists():
            continue
        times = cells.step_times(sitting)
        floor = times.get(("10mbit", "floor"))
        for base in v3.BASELINES:
            step = times.get(("10mbit", base))
            if floor and step:
                out.append(f"- {task}: {base} {step:.3f} s / floor {floor:.3f} s = **{step / floor:.1f}x** "
                           f"({'at least' if step >= 5 * floor else 'under'} 5x)")
    return out


def main() -> None:
    from results_archive import restore  # the raw runs: unpacked from their archive if missing
    restore(v3.OUT)
    lines = [f"# {v3.PROTOCOL}: how often, not only how much", "",
             f"Protocol: [`benchmarks/protocols/{v3.PROTOCOL}.md`](../protocols/{v3.PROTOCOL}.md), committed before "
             f"the runs. `.venv/bin/python benchmarks/evidence_v3_report.py`; raw runs and the step-time sittings in "
             f"[{v3.PROTOCOL}/]({v3.PROTOCOL}/). *computed*: the method's 100 Mbit/s runs, each step at the "
             f"sitting's median step at this rate, plus their own evaluations (the protocol's rule).", "",
             "*Floats sent*: a value sent whole counts one float whatever its width (the 16-bit baselines' and "
             "our 16-bit dense layers' too); a compressed payload counts its bytes over 4. Bytes are not in these "
             "records: the CLI at the runner's commit (a6af0df) wrote floats only (its steps.csv has `bytes_sent` "
             "since). On the wire the 16-bit baselines send 2 bytes a float, DiLoCo as published and PyTorch's local "
             "SGD 4 (float32); ours mixes both kinds, so its bytes lie between 2 and 4 times its floats.", "",
             "The slow rate's check (the step-time sitting, 10 Mbit/s):", "", *five_x_check(), ""]
    judged = {}
    for setting in v3.SETTINGS:
        table, got = setting_table(setting)
        lines += table
        judged[setting] = got
    lines += ["## The bars (issue 63)", "", *bars(judged), ""]
    REPORT.write_text("\n".join(lines))
    print(f"wrote {REPORT}")


if __name__ == "__main__":
    main()
