"""MetricsLogger's CSV and TensorBoard records, the figures drawn from them, the CLI."""

import csv
import io
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from accordion_hvd.cli import metrics, plots
from accordion_hvd.cli.metrics import LEVEL_CODES, MetricsLogger, progress

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["conv1.weight", "conv2.weight", "fc.weight", "fc.bias"]
STEPS = 300
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def level(layer: str, step: int) -> str | None:
    """Synthetic regimes: critical for the first 50 steps and in steps 150-199 (conv1 from
    160); the bias stays dense; fc.weight reports a custom level, then none at all."""
    if layer == "fc.bias":
        return "dense"
    if layer == "fc.weight" and step >= 250:
        return None
    if layer == "fc.weight" and step >= 200:
        return "rank8"
    start = 160 if layer == "conv1.weight" else 150
    return "critical" if step < 50 or start <= step < 200 else "normal"


def step_values(step: int) -> dict:
    return dict(epoch=step // 100, loss=1.0 / (step + 1), lr=0.1 * 0.99 ** step, floats_sent=1000 * step + 7,
                floats_dense=50_000 * step, compress_s=step * 1e-4, comm_s=2.5e-3, wall_s=0.01 * step + 1 / 3)


def write_run(logdir, steps=STEPS, evals=(99, 199, 299), tensorboard=True, scale=1):
    """A run of ``steps`` steps; ``scale`` multiplies floats_sent (a more compressed run)."""
    with MetricsLogger(logdir, layers=LAYERS, tensorboard=tensorboard) as m:
        for s in range(steps):
            v = step_values(s)
            v["floats_sent"] *= scale
            levels = {n: lv for n in LAYERS if (lv := level(n, s)) is not None}
            m.log_step(s, levels=levels, samples=32 * (s + 1), **v)
            if s in evals:
                m.log_eval(s, epoch=v["epoch"], accuracy=0.5 + s / 1000, floats_sent=v["floats_sent"],
                           wall_s=v["wall_s"])
    return Path(logdir)


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def check_png(path: Path, min_bytes=5_000) -> np.ndarray:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > min_bytes, path
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    return image


def test_steps_and_eval_csv_round_trip(tmp_path):
    logdir = write_run(tmp_path / "run", tensorboard=False)
    rows = read_csv(logdir / "steps.csv")
    header = [*metrics.STEP_COLUMNS, "samples", *("level/" + n for n in LAYERS)]
    assert rows[0] == header
    assert len(rows) == 1 + STEPS
    for s, row in enumerate(rows[1:]):
        cell = dict(zip(header, row))
        expected = step_values(s)
        assert int(cell["step"]) == s and int(cell["samples"]) == 32 * (s + 1)
        for key in ("epoch", "floats_sent", "floats_dense"):
            assert int(cell[key]) == expected[key]
        for key in ("loss", "lr", "compress_s", "comm_s", "wall_s"):
            assert float(cell[key]) == expected[key]  # exactly: floats are written by repr
        for n in LAYERS:
            assert cell["level/" + n] == (level(n, s) or "")

    evals = read_csv(logdir / "eval.csv")
    assert evals[0] == list(metrics.EVAL_COLUMNS)
    assert [int(r[0]) for r in evals[1:]] == [99, 199, 299]
    assert [float(r[2]) for r in evals[1:]] == [0.5 + s / 1000 for s in (99, 199, 299)]


def test_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = write_run(tmp_path / "run")
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {"train/loss", "train/lr", "train/floats_sent", "time/compress_s", "time/comm_s", "train/samples",
                "eval/accuracy", "eval/floats_sent", *("level/" + n for n in LAYERS)}
    assert expected <= tags
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(STEPS))
    assert np.allclose([e.value for e in loss], [step_values(s)["loss"] for s in range(STEPS)])
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [99, 199, 299]
    # Levels: a few points (at changes and the ends) that all lie on the step function.
    conv1 = acc.Scalars("level/conv1.weight")
    assert [e.step for e in conv1] == [0, 49, 50, 159, 160, 199, 200, 299]
    for name in LAYERS:
        for e in acc.Scalars("level/" + name):
            assert e.value == LEVEL_CODES.get(level(name, e.step), metrics.UNKNOWN_LEVEL_CODE)
    assert acc.Scalars("level/fc.weight")[-1].step == 249  # not logged after 249


def test_tensorboard_off_or_missing(tmp_path, monkeypatch, caplog):
    write_run(tmp_path / "off", steps=3, tensorboard=False)
    assert not list((tmp_path / "off").glob("events.out.tfevents.*"))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now fails
    monkeypatch.setattr(metrics, "_warned_no_tensorboard", False)
    with caplog.at_level(logging.WARNING, logger="accordion_hvd.metrics"):
        write_run(tmp_path / "a", steps=3)
        write_run(tmp_path / "b", steps=3)
    assert len([r for r in caplog.records if "tensorboard is not importable" in r.message]) == 1
    assert len(read_csv(tmp_path / "b" / "steps.csv")) == 4
    assert not list((tmp_path / "b").glob("events.out.tfevents.*"))


def test_killed_run_leaves_valid_csvs(tmp_path):
    script = (f"from accordion_hvd.cli.metrics import MetricsLogger\nimport os, signal\n"
              f"m = MetricsLogger({str(tmp_path / 'run')!r}, layers=['a'], tensorboard=False)\n"
              "for s in range(20):\n"
              "    m.log_step(s, epoch=0, loss=1.5, lr=0.1, floats_sent=s, floats_dense=s, levels={'a': 'normal'},"
              " compress_s=0.0, comm_s=0.0, wall_s=0.0)\n"
              "m.log_eval(19, epoch=0, accuracy=0.5, floats_sent=19, wall_s=1.0)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -signal.SIGKILL
    assert len(read_csv(tmp_path / "run" / "steps.csv")) == 21
    assert read_csv(tmp_path / "run" / "eval.csv")[1] == ["19", "0", "0.5", "", "19", "1.0"]  # no perplexity


def test_plot_run_writes_pngs(tmp_path):
    logdir = write_run(tmp_path / "run", tensorboard=False)
    paths = plots.plot_run(logdir)
    assert [p.name for p in paths] == ["accuracy_vs_floats.png", "accuracy_vs_time.png", "regimes.png"]
    assert all(p.parent == logdir for p in paths)
    for p in paths:
        check_png(p)
    # The regime timeline shows each level's colour over a good share of the image.
    image = (check_png(paths[2])[..., :3] * 255).round()
    for name in ("normal", "critical", "dense"):
        colour = np.array([int(plots.LEVEL_COLOURS[name][i:i + 2], 16) for i in (1, 3, 5)])
        share = np.all(np.abs(image - colour) <= 2, axis=-1).mean()
        assert share > 0.03, (name, share)


def test_regime_matrix_downsamples_by_most_frequent_level():
    rows = [{"step": s, "level/a": "critical" if 3000 <= s < 3100 else "normal", "level/b": "dense"}
            for s in range(10_000)]
    categories, codes = plots._regime_matrix(rows, ["a", "b"], max_columns=500)
    assert categories == ["normal", "critical", "dense"]
    assert codes.shape == (2, 500)
    assert (codes[1] == 2).all()
    assert np.flatnonzero(codes[0] == 1).tolist() == list(range(150, 155))  # 20 steps a column


def test_regimes_readable_with_many_layers_and_steps(tmp_path):
    layers = [f"layer{i}.weight" for i in range(20)]
    rows = [{"step": s, **{f"level/{n}": ("critical" if (s // (500 + 50 * i)) % 2 else "normal")
                          for i, n in enumerate(layers)}} for s in range(10_000)]
    fig = plots._regimes_figure(rows, layers, "many")
    path = tmp_path / "many.png"
    fig.savefig(path)
    image = check_png(path)
    assert image.shape[0] >= 0.26 * 20 * plots.DPI  # a row of pixels per layer label at least


def test_a_diloco_run_shows_its_interval_under_the_levels(tmp_path):
    """steps.csv's sync_interval (the periodic front ends' record): a panel under the levels, on
    the same steps, each step's interval; a run without the column keeps one panel."""
    intervals = [1] * 128 + [4] * 64 + [16] * 64 + [64] * 128 + [1] * 64
    rows = [{"step": s, "level/a": "dense" if s < 100 else "normal", "sync_interval": str(k)}
            for s, k in enumerate(intervals)]
    fig = plots._regimes_figure(rows, ["a"], "diloco")
    assert len(fig.axes) == 2
    (line,) = fig.axes[1].get_lines()
    assert line.get_xdata().tolist() == list(range(len(intervals))) and line.get_ydata().tolist() == intervals
    assert [t.get_text() for t in fig.axes[1].get_yticklabels()] == ["1", "4", "16", "64"]
    fig.savefig(tmp_path / "diloco.png")
    check_png(tmp_path / "diloco.png")
    assert len(plots._regimes_figure([{k: v for k, v in r.items() if k != "sync_interval"} for r in rows], ["a"],
                                     "per step").axes) == 1


def test_compare_runs(tmp_path):
    runs = {"static low": write_run(tmp_path / "low", tensorboard=False, scale=1),
            "static high": write_run(tmp_path / "high", tensorboard=False, scale=1000)}
    paths = plots.compare_runs(runs, tmp_path / "figs")
    assert [p.name for p in paths] == ["compare_accuracy_vs_floats.png", "compare_accuracy_vs_time.png"]
    for p in paths:
        check_png(p)
    # Floats spanning decades get a log axis; times do not.
    curves = {k: (np.array([1e3, 1e6]), np.array([0.5, 0.6])) for k in "ab"}
    assert plots._accuracy_figure(curves, "x", "t").axes[0].get_xscale() == "log"
    curves = {k: (np.array([10.0, 20.0]), np.array([0.5, 0.6])) for k in "ab"}
    assert plots._accuracy_figure(curves, "x", "t").axes[0].get_xscale() == "linear"
    with pytest.raises(ValueError, match="no runs"):
        plots.compare_runs({}, tmp_path)


def test_bad_inputs(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(NotADirectoryError, match="afile exists and is not a directory"):
        MetricsLogger(afile, layers=LAYERS)
    with pytest.raises(OSError, match="cannot create logdir"):
        MetricsLogger(afile / "sub", layers=LAYERS)

    with MetricsLogger(tmp_path / "run", layers=["a"], tensorboard=False) as m:
        v = step_values(0)
        with pytest.raises(ValueError, match="undeclared layer 'nope'"):
            m.log_step(0, levels={"a": "normal", "nope": "critical"}, **v)
        m.log_step(0, levels={"a": "normal"}, **v)
        with pytest.raises(ValueError, match="extra column 'new' was not in the first row"):
            m.log_step(1, levels={}, new=1, **v)
        with pytest.raises(ValueError, match="loss must be a number"):
            m.log_step(1, levels={}, **{**v, "loss": "high"})
        with pytest.raises(ValueError, match=r"accuracy must be a fraction in \[0, 1\], got 95"):
            m.log_eval(0, epoch=0, accuracy=95, floats_sent=0, wall_s=0)
    with pytest.raises(ValueError, match="closed logger"):
        m.log_step(1, levels={}, **v)
    with pytest.raises(ValueError, match="duplicate layer names"):
        MetricsLogger(tmp_path / "dup", layers=["a", "a"])

    with pytest.raises(FileExistsError, match="steps.csv already exists"):
        MetricsLogger(tmp_path / "run", layers=["a"], tensorboard=False)
    MetricsLogger(tmp_path / "run", layers=["a"], tensorboard=False, overwrite=True).close()
    assert not (tmp_path / "run" / "steps.csv").exists()  # replaced; no step logged yet

    # plot_run: a missing CSV is named.
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "run" / "steps.csv")):
        plots.plot_run(tmp_path / "run")
    write_run(tmp_path / "run2", steps=2, tensorboard=False)
    (tmp_path / "run2" / "eval.csv").unlink()
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "run2" / "eval.csv")):
        plots.plot_run(tmp_path / "run2")


def test_read_only_logdir(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics.os, "access", lambda *args: False)  # as root, chmod would not stop us
    with pytest.raises(PermissionError, match="logdir .*ro is not writable"):
        MetricsLogger(tmp_path / "ro", layers=[])


def test_plot_run_before_first_eval(tmp_path, caplog):
    logdir = write_run(tmp_path / "run", steps=5, evals=(), tensorboard=False)
    with caplog.at_level(logging.WARNING, logger="accordion_hvd.plots"):
        paths = plots.plot_run(logdir, tmp_path / "out")
    assert [p.name for p in paths] == ["regimes.png"] and paths[0].parent == tmp_path / "out"
    assert "no evaluations yet" in caplog.text


def test_progress(monkeypatch):
    for enabled in (False, True):
        err = io.StringIO()
        monkeypatch.setattr(sys, "stderr", err)
        with progress(10, enabled, "epoch 1") as bar:
            for _ in range(10):
                bar.update()
        assert ("epoch 1" in err.getvalue()) is enabled
        assert not enabled or bar.mininterval == 30.0  # not a terminal: a log file


def test_cli(tmp_path, capsys):
    logdir = write_run(tmp_path / "run", tensorboard=False)
    written = plots.main([str(logdir), "--compare", f"a={logdir}", f"b={logdir}", "--out", str(tmp_path / "f")])
    assert [p.name for p in written] == ["accuracy_vs_floats.png", "accuracy_vs_time.png", "regimes.png",
                                         "compare_accuracy_vs_floats.png", "compare_accuracy_vs_time.png"]
    assert capsys.readouterr().out.split() == [str(p) for p in written]
    with pytest.raises(SystemExit) as exc:
        plots.main(["--compare", "nolabel"])
    assert exc.value.code == 2 and "LABEL=DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        plots.main([str(tmp_path / "missing")])
    assert exc.value.code == 1 and "steps.csv" in capsys.readouterr().err


def test_a_language_model_run_records_and_plots_perplexity(tmp_path):
    with MetricsLogger(tmp_path / "lm", layers=["w"], tensorboard=False) as m:
        for s in range(3):
            m.log_step(s, epoch=0, loss=5.0, lr=0.1, floats_sent=s, floats_dense=s, levels={"w": "normal"},
                       compress_s=0.0, comm_s=0.0, wall_s=float(s))
            m.log_eval(s, epoch=s, perplexity=300.0 / (s + 1), floats_sent=s + 1, wall_s=float(s))
        with pytest.raises(ValueError, match="perplexity must be at least 1"):
            m.log_eval(3, epoch=3, perplexity=0.5, floats_sent=4, wall_s=3.0)
        with pytest.raises(ValueError, match="either accuracy or perplexity"):
            m.log_eval(3, epoch=3, accuracy=0.5, perplexity=2.0, floats_sent=4, wall_s=3.0)
    rows = read_csv(tmp_path / "lm" / "eval.csv")
    assert rows[1] == ["0", "0", "", "300.0", "1", "0.0"]
    assert [p.name for p in plots.plot_run(tmp_path / "lm")] == ["perplexity_vs_floats.png", "perplexity_vs_time.png",
                                                                 "regimes.png"]
