"""The summary of protocol evidence-v4 (benchmarks/protocols/evidence-v4.md): per machine, per
setting, the baseline and ``diloco-v4``'s time to the target against the compute floor, and the
issue's bars judged on each machine apart.

    .venv/bin/python benchmarks/evidence_v4_report.py    # benchmarks/results/evidence-v4.md

Reads only committed files (``benchmarks/results/evidence-v4/MACHINE/...``). A cell whose runs
are not all there is shown with what there is; a bar that reads it says "not decided", unless a
seed already run never reached the target (then the method's mean is infinite: decided). Runs made
on a later VM under a machine's CPU name (amendment 3: ``instances/instances.json`` lists them)
are marked, and decide an "ahead of" bar only as a "yes".
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import evidence_v3_cells as cells  # noqa: E402
import evidence_v4 as v4  # noqa: E402
from evidence_v3_report import mean_sd, read_run, reached, seconds  # noqa: E402

ROOT = v4.REPO / "benchmarks" / "results" / v4.PROTOCOL
REPORT = ROOT.parent / f"{v4.PROTOCOL}.md"
FLOOR_BARS = {"10mbit": 1.5, "100mbit": 1.25}
# amendment 3: the runs made on a later VM than the one of a machine's sitting and targets ("A"),
# in ROOT / INSTANCES / "instances.json" (a folder beside the machines' that is not one)
INSTANCES = "instances"


def later_vms(out: Path) -> dict[str, str]:
    """{run folder relative to the machine's folder: VM} for the machine's runs made on a later VM
    (amendment 3); a run not listed ran on VM A, that of the sitting and the targets."""
    listed = ROOT / INSTANCES / "instances.json"
    if not listed.exists():
        return {}
    vms = json.loads(listed.read_text()).get(out.name, {}).get("vms", {})
    return {run: vm for vm, info in vms.items() if vm != "A" for run in info.get("runs", [])}


def runs_of(out: Path, setting: str, method: str, times: dict | None) -> tuple[str, dict[int, dict]]:
    """("measured" | "computed", {seed: run}) on one machine; a method of ``v4.COMPUTED`` away from
    100 Mbit/s computed from its 100 Mbit/s runs and its sitting's step at the setting's rate."""
    task, rate = v4.SETTINGS[setting]
    measured = method not in v4.COMPUTED or rate == "100mbit"
    source = setting if measured else f"{task}-100mbit"
    runs = {s: r for s in v4.SEEDS if (r := read_run(out / source / method / f"seed{s}", v4.PROTOCOL))}
    vms = later_vms(out)
    for s, r in runs.items():
        r["vm"] = vms.get(f"{source}/{method}/seed{s}", "A")
    if measured:
        return "measured", runs
    if times is None or (rate, cells.SITTING_METHOD[method]) not in times:
        return "computed", {}
    for r in runs.values():
        r["walls"] = cells.computed_walls(r["evals"], r["step_walls"], cells.step_time(times, rate, method))
    return "computed", runs


def setting_lines(out: Path, setting: str) -> tuple[list[str], list[str]]:
    """A setting's table on one machine, and its rows of the bars."""
    task, rate = v4.SETTINGS[setting]
    path = out / setting / "setting.json"
    frozen = json.loads(path.read_text()) if path.exists() else v4.setting_of(out, setting)
    if frozen is None:
        return [f"### {setting}", "", "No target yet on this machine (the baseline's runs or the sitting are missing).",
                ""], []
    target, floor, base_wall = frozen["target_perplexity"], frozen["floor_s"], frozen["baseline_wall_s"]
    times = v4.step_times(out, task)
    lines = [f"### {setting}", "",
             f"Target: validation perplexity {target:.2f} ({v4.BASELINE}'s mean final at 100 Mbit/s, this machine); "
             f"the baseline's mean wall time {base_wall:.0f} s{' (computed)' if 'computed' in frozen else ''}; "
             f"**compute floor {floor:.0f} s**; cap {frozen['cap_s']:.0f} s"
             f"{'' if path.exists() else ' (not frozen yet: no run of the method here)'}.", "",
             "| method | cell | seeds | time to target, mean s (x floor, x baseline) | sd s | validation after 6 epochs "
             "| test | floats sent per rank | bytes sent per rank | rounds |", "|---|---|---|---|---|---|---|---|---|---|"]
    bars, means, later = [], {}, {}
    for method in (v4.BASELINE, *v4.PEERS, "diloco-v4"):
        kind, runs = runs_of(out, setting, method, times)
        if not runs:
            continue
        mean, missed = reached(runs, target)
        if mean is None and missed:  # a seed that missed fixes the mean at inf, whatever the seeds still to run
            mean = math.inf
        means[method] = mean
        later[method] = sorted({r["vm"] for r in runs.values()} - {"A"})
        on_later = sum(r["vm"] != "A" for r in runs.values())
        hits = [t for r in runs.values() if (t := cells.time_to(r["evals"], r["walls"], target)) is not None]
        if mean is not None and math.isfinite(mean):
            shown = f"{mean:.0f} ({mean / floor:.2f}x, {mean / base_wall:.2f}x)"
        else:
            shown = (f"not reached in {len(missed)} ({'; '.join(missed)})" if missed else "") + \
                (f" ({len(runs)} of {len(v4.SEEDS)} seeds run)" if len(runs) < len(v4.SEEDS) else "")
        sent = list(runs.values())
        bytes_ = [r.get("bytes") for r in sent if r.get("bytes") is not None]
        syncs = [r["syncs"] for r in sent if r["syncs"] is not None]
        seeds = f"{len(runs)}" + (f" ({on_later} on VM {', '.join(later[method])})" if on_later else "")
        lines.append(f"| {method} | {kind} | {seeds} | {shown} | {mean_sd(hits, '.0f') if len(hits) > 1 else '-'} | "
                     f"{mean_sd([r['standard'] for r in sent])} | {mean_sd([r['test'] for r in sent])} | "
                     f"{statistics.mean(r['floats'] for r in sent):.3g} | "
                     f"{f'{statistics.mean(bytes_):.3g}' if bytes_ else '-'} | {mean_sd(syncs, '.0f') if syncs else '-'} |")
        if method != "diloco-v4" or task == v4.HELDOUT:  # the held-out task: the ordering only (the issue)
            continue
        reached_ = mean is not None and math.isfinite(mean)
        if rate in FLOOR_BARS:
            bar, limit = f"diloco-v4 within {FLOOR_BARS[rate]}x the compute floor", FLOOR_BARS[rate] * floor
            figure = f"{seconds(mean)} = {mean / floor:.2f}x" if reached_ else seconds(mean)
        else:
            bar, limit = "diloco-v4 not later than the baseline", base_wall
            figure = f"{seconds(mean)} vs {base_wall:.0f} s"
        met = "not decided" if mean is None else ("**yes**" if reached_ and mean <= limit else "no")
        if later[method]:  # (amendment 3: the floor and the baseline are VM A's)
            met = f"not decided (runs on VM {', '.join(later[method])})"
        bars.append(f"| {bar} | {setting} | {figure} | {met} |")
    if "diloco-v4" in means:
        bars += [ahead_row(setting, means, peer, later) for peer in v4.PEERS]
    return lines + [""], bars


def ahead_row(setting: str, means: dict[str, float | None], peer: str, later: dict[str, list[str]] | None = None) -> str:
    """The bar "diloco-v4 ahead of PEER in time to target" (amendment 1), from the setting's mean
    times to target (None: a seed not run yet); decided once both have all their seeds, or as
    "no" once diloco-v4 has a seed that never reached the target (its mean is infinite: behind
    one whose seeds all did, and neither is ahead when both missed). ``later``: each method's
    runs on a later VM than A (amendment 3): a peer's there (a faster VM) decide only a "yes";
    diloco-v4's, nothing."""
    def shown(method: str) -> str:
        return "no runs" if method not in means else "seeds missing" if means[method] is None else seconds(means[method])
    ours, theirs = means.get("diloco-v4"), means.get(peer)
    ours_missed = ours is not None and not math.isfinite(ours)  # "no", whatever the peer's runs show
    met = ("no (diloco-v4 has a seed that missed the target)" if ours_missed else
           "not decided" if ours is None or theirs is None else
           "**yes**" if ours < theirs else "no")
    later = later or {}
    if later.get("diloco-v4") and met != "not decided":
        met = f"not decided (diloco-v4's runs on VM {', '.join(later['diloco-v4'])})"
    elif later.get(peer) and met != "not decided" and not ours_missed:
        met = (f"**yes** ({peer}'s runs on the faster VM {', '.join(later[peer])})" if met == "**yes**" else
               f"not decided ({peer}'s runs on the faster VM {', '.join(later[peer])})")
    return f"| diloco-v4 ahead of {peer} | {setting} | {shown('diloco-v4')} vs {shown(peer)} | {met} |"


def main() -> None:
    from results_archive import restore  # the raw runs: unpacked from their archive if missing
    restore(ROOT)
    lines = [f"# {v4.PROTOCOL}: DiLoCo's defaults after v3, per machine", "",
             f"Protocol: [`benchmarks/protocols/{v4.PROTOCOL}.md`](../protocols/{v4.PROTOCOL}.md), committed before "
             f"the runs. `.venv/bin/python benchmarks/evidence_v4_report.py`; raw runs and sittings in "
             f"[{v4.PROTOCOL}/]({v4.PROTOCOL}/). Every figure of a machine's section was measured on that machine; "
             "*computed*: the method's 100 Mbit/s runs, each step at the sitting's median step at the rate, plus "
             "their own evaluations (v3's rule; the peers' steps from the peers' sitting, amendment 1). Amendment 5 "
             "dropped the cells not run by 2026-12-02 (no session could choose the VM they needed): a bar still "
             "\"not decided\" below stays so.", ""]
    machines = sorted(d for d in ROOT.iterdir() if d.is_dir() and d.name != INSTANCES) if ROOT.exists() else []
    for out in machines:
        lines += [f"## {out.name}", ""]
        bars = []
        for setting in v4.SETTINGS:
            table, rows = setting_lines(out, setting)
            lines += table
            bars += rows
        lines += [f"#### The bars on {out.name} (issue 63)", "", "| bar | setting | figure | met |", "|---|---|---|---|",
                  *bars, ""]
    REPORT.write_text("\n".join(lines))
    print(f"wrote {REPORT}")


if __name__ == "__main__":
    main()
