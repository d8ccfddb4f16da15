"""What a user meets in a first hour with ``python -m accordion_hvd.train``: ``--help`` says
each option's default, the progress bar counts what the run will do (``--max-steps``
included), and a run's output says each thing once, on rank 0, with no warning the user
did not cause."""

import re

import pytest
import torch

from accordion_hvd.cli import train
from launch import run_module


def _help_entries(capsys) -> dict[str, str]:
    """``--help``'s options section as {option: its entry, whitespace collapsed}."""
    with pytest.raises(SystemExit) as exc:
        train.parse_args(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    section = re.split(r"^(?:options|optional arguments):\n", text, flags=re.M)[1]
    entries = {}
    for block in re.split(r"\n(?=  -)", section):  # an entry starts at an option, indented by 2
        entry = " ".join(block.split())
        entries[entry.split()[0].rstrip(",")] = entry
    return entries


def test_help_shows_every_default_and_it_is_the_one_used(capsys):
    entries = _help_entries(capsys)
    defaults = train.parse_args([])
    missing = [option for option, entry in entries.items() if option != "-h" and "(default" not in entry]
    assert not missing, f"no default in --help for {missing}"
    for option in ("--eta", "--interval", "--rank", "--ratio", "--epochs", "--batch-size", "--lr", "--max-steps",
                   "--large-passes", "--codec", "--dataset"):
        shown = re.search(r"\(default: ([^)]*)\)", entries[option])
        assert shown, entries[option]
        assert shown.group(1) == str(getattr(defaults, option[2:].replace("-", "_"))), entries[option]


@pytest.mark.parametrize("case, expected", [
    ((22, 15, 0, 0, 0), 330),     # every epoch
    ((22, 15, 0, 0, 30), 30),     # a 30-step smoke run: 30, not 330
    ((22, 15, 0, 0, 1000), 330),  # --max-steps beyond the epochs: the epochs
    ((22, 5, 2, 44, 0), 66),      # resumed after 2 epochs: the 3 epochs left
    ((22, 5, 2, 44, 50), 6),      # resumed at step 44 with --max-steps 50 (which counts all steps)
    ((22, 5, 2, 44, 44), 1),      # resumed at --max-steps: the loop still takes one step
    ((22, 2, 2, 44, 50), 0),      # resumed with no epoch left
])
def test_progress_total_is_the_steps_the_run_takes(case, expected):
    assert train.progress_total(*case) == expected


def _bar_counts(out: str) -> list[tuple[int, int]]:
    """Every (done, total) the rank-0 bar drew ("training: ...| 22/30 [...")."""
    return [(int(n), int(total)) for n, total in re.findall(r"training[^|\n\r]*:[^|\n\r]*\|[^|\n\r]*\| (\d+)/(\d+) ",
                                                          out)]


def _accordion_lines_of_rank(out: str, rank: int) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(f"[{rank}]") and "accordion_hvd." in line]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One short 2-rank run, as a user's first: detection every 10 steps, --max-steps 30 of
    2 epochs' 44, progress bar on, figures written. Shared by the tests below (one job)."""
    logdir = tmp_path_factory.mktemp("smoke")
    out = run_module("accordion_hvd.train", "--codec", "powersgd", "--critical-rank", "4", "--interval", "10", "--epochs", "2",
                     "--max-steps", "30", "--logdir", str(logdir), np=2, backend="gloo")
    return out, logdir


@pytest.mark.horovod
def test_progress_bar_total_is_max_steps(smoke_run):
    out, _ = smoke_run
    assert "stopped after 30 optimizer steps" in out, out
    counts = _bar_counts(out)
    assert counts and {total for _, total in counts} == {30}, (counts, out)
    assert counts[-1] == (30, 30), out


@pytest.mark.horovod
def test_step_windows_bring_no_epoch_end_warning(smoke_run):
    # --interval 10: the CLI detects every 10 steps, so it must not call epoch_end() (which
    # the controller ignores with a warning on every rank); with --interval 0 it must.
    out, _ = smoke_run
    assert "epoch_end() ignored" not in out, out


@pytest.mark.horovod
def test_each_figure_is_announced_once_on_rank_0(smoke_run):
    out, logdir = smoke_run
    pngs = sorted(logdir.glob("*.png"))
    assert pngs, out
    for png in pngs:
        assert out.count(f"wrote {png}\n") == 1, out
    # Per-job facts (the figures, the epochs, warnings about the run) come from rank 0 alone.
    assert not _accordion_lines_of_rank(out, 1), out


@pytest.mark.horovod
def test_batch_mode_with_step_windows_and_max_steps(tmp_path):
    """--batch-mode with --interval: no epoch_end() warning from either controller (the
    compressor's or the batch size's), and with --max-steps the bar counts the steps to it."""
    out = run_module("accordion_hvd.train", "--codec", "powersgd", "--critical-rank", "4", "--batch-mode", "--interval", "10",
                     "--epochs", "2", "--max-steps", "15", np=2, backend="gloo")
    assert "stopped after 15 optimizer steps" in out and "epoch_end() ignored" not in out, out
    counts = _bar_counts(out)
    assert counts and {total for _, total in counts} == {15} and counts[-1] == (15, 15), (counts, out)
    assert not _accordion_lines_of_rank(out, 1), out


@pytest.mark.parametrize("interval, calls", [(0, 1), (10, 0)])
def test_epoch_end_is_called_only_for_epoch_windows(monkeypatch, interval, calls):
    """The CLI's epoch end is a detection point (compression and batch size) with --interval 0
    and only then: with windows of N steps the controllers would ignore it with a warning."""
    called = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def epoch_end(self):
            called.append(self.name)

        def stats(self):
            return {"floats_sent": 0}

    monkeypatch.setattr(train, "evaluate", lambda *args: 0.5)
    args = train.parse_args(["--interval", str(interval), "--epochs", "3"])
    task = train.Task(train=None, valid=None, test=None, metric="accuracy", classes=10)
    from accordion_hvd.cli.frontends import FrontEnd  # the face's defaults (evaluating, record)

    one_rank = type("OneRank", (FrontEnd,), {"rank": 0, "sum": lambda self, values, name: values})()
    run = train.Run(args, front=one_rank, device=None, task=task, model=torch.nn.Linear(2, 2), net=None, opt=None,
                    compression=Recorder("compression"), batch=Recorder("batch"), base_lr=0.02)
    bar = type("Bar", (), {"set_postfix": lambda self, **kw: None})()
    assert train.end_epoch(run, 0, torch.tensor(1.0), bar) == 0.5
    assert called == ["compression", "batch"] * calls and run.epoch == 1
