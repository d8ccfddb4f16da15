"""What a training run records (rank 0 only): CSV files, TensorBoard scalars, a progress bar.

The CSV files are the record of a run: ``accordion_hvd.cli.plots`` draws the figures of the
results section from them alone, and they are flushed row by row so that a killed run
still leaves valid files. TensorBoard is a live view on top and optional.

    with MetricsLogger("runs/accordion", layers=names) as metrics:
        metrics.log_step(step, epoch=e, loss=loss.item(), lr=lr, floats_sent=..., ...)
        metrics.log_eval(step, epoch=e, accuracy=acc, floats_sent=..., wall_s=...)

Nothing here imports Horovod: the training CLI calls it on rank 0 only.
"""

from __future__ import annotations

import csv
import logging
import os
import sys
from pathlib import Path

from tqdm import tqdm

log = logging.getLogger("accordion_hvd.metrics")

STEPS_CSV = "steps.csv"
EVAL_CSV = "eval.csv"
LEVEL_PREFIX = "level/"
STEP_COLUMNS = ("step", "epoch", "loss", "lr", "floats_sent", "floats_dense", "compress_s", "comm_s", "wall_s")
EVAL_COLUMNS = ("step", "epoch", "accuracy", "perplexity", "floats_sent", "wall_s")

# A layer's level as a TensorBoard scalar. The codes grow with the floats a layer sends
# (aggressive normal < gentle critical < uncompressed dense), so a higher curve means
# more traffic; any other level string is drawn as -1.
LEVEL_CODES = {"normal": 0, "critical": 1, "dense": 2}
UNKNOWN_LEVEL_CODE = -1

_warned_no_tensorboard = False


def _summary_writer(logdir: Path):
    """A SummaryWriter, or None (warned about once per process) if tensorboard is missing."""
    global _warned_no_tensorboard
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        if not _warned_no_tensorboard:
            log.warning("tensorboard is not importable (%s): recording CSV files only", exc)
            _warned_no_tensorboard = True
        return None
    # flush_secs: the CSVs are the flushed-per-row record; TensorBoard is a live view.
    return SummaryWriter(log_dir=str(logdir), max_queue=1000, flush_secs=10)


def _number(name: str, value, kind=float):
    """``kind(value)`` (accepts 0-d tensors and numpy scalars) or a ValueError naming the field."""
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"MetricsLogger: {name} must be a number, got {value!r}") from None


class MetricsLogger:
    """Appends one CSV row per training step and per evaluation, mirrored to TensorBoard.

    Files in ``logdir``: ``steps.csv`` (columns ``STEP_COLUMNS``, then the ``**extra`` keys
    of the first ``log_step`` call, then ``level/<layer>`` for each declared layer; the
    header is fixed by that first row) and ``eval.csv`` (``EVAL_COLUMNS``). ``floats_sent``
    and ``floats_dense`` are cumulative counts for this rank, as in
    ``AccordionCompressor.stats()``; ``wall_s`` is seconds since training started;
    an evaluation has either ``accuracy`` (a fraction in [0, 1]: classification) or
    ``perplexity`` (at least 1: language modelling), the other cell empty.

    A logdir that already holds a run is refused (FileExistsError) unless
    ``overwrite=True``, which replaces its CSVs and TensorBoard event files: a logdir is
    one run, so that its figures never mix two runs.
    """

    def __init__(self, logdir, *, layers: list[str], tensorboard: bool = True, overwrite: bool = False) -> None:
        self.logdir = Path(logdir)
        self.layers = list(layers)
        if not all(isinstance(name, str) and name for name in self.layers):
            raise ValueError(f"MetricsLogger: layers must be non-empty strings, got {self.layers!r}")
        if len(set(self.layers)) != len(self.layers):
            dups = sorted({n for n in self.layers if self.layers.count(n) > 1})
            raise ValueError(f"MetricsLogger: duplicate layer names {dups}")
        self._make_logdir(overwrite)
        self._steps_file = self._steps_csv = None
        self._columns: list[str] | None = None  # steps.csv header, fixed by the first row
        self._eval_file = open(self.logdir / EVAL_CSV, "w", newline="", encoding="utf-8")
        self._eval_csv = csv.writer(self._eval_file)
        self._write(self._eval_file, self._eval_csv, EVAL_COLUMNS)
        self._tb = _summary_writer(self.logdir) if tensorboard else None
        self._tb_shown: dict[str, list[int]] = {}
        self.closed = False

    def _make_logdir(self, overwrite: bool) -> None:
        path = self.logdir
        if path.exists() and not path.is_dir():
            raise NotADirectoryError(f"MetricsLogger: logdir {path} exists and is not a directory")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # e.g. a parent is a file, or read-only
            raise OSError(exc.errno, f"MetricsLogger: cannot create logdir {path}: {exc.strerror}") from exc
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(f"MetricsLogger: logdir {path} is not writable")
        old = [p for p in (path / STEPS_CSV, path / EVAL_CSV) if p.exists()]
        if old and not overwrite:
            raise FileExistsError(f"MetricsLogger: {old[0]} already exists: choose a new logdir "
                                  "or pass overwrite=True to replace that run")
        if overwrite:
            for stale in old + sorted(path.glob("events.out.tfevents.*")):
                log.info("replacing %s", stale)
                stale.unlink()

    @staticmethod
    def _write(file, writer, row) -> None:
        writer.writerow(row)
        file.flush()  # a killed run keeps every row written so far

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("MetricsLogger: logging to a closed logger")

    def log_step(self, step: int, *, epoch: int, loss: float, lr: float, floats_sent: int, floats_dense: int,
                 levels: dict[str, str], compress_s: float, comm_s: float, wall_s: float, **extra) -> None:
        """One training step. ``levels`` maps declared layers to any level string
        (normal/critical/dense...); a declared layer left out gets an empty cell."""
        self._check_open()
        unknown = [name for name in levels if name not in self.layers]
        if unknown:
            raise ValueError(f"MetricsLogger: level given for undeclared layer {unknown[0]!r} "
                             f"(declared: {self.layers})")
        values = {
            "step": _number("step", step, int), "epoch": _number("epoch", epoch, int),
            "loss": _number("loss", loss), "lr": _number("lr", lr),
            "floats_sent": _number("floats_sent", floats_sent, int),
            "floats_dense": _number("floats_dense", floats_dense, int),
            "compress_s": _number("compress_s", compress_s), "comm_s": _number("comm_s", comm_s),
            "wall_s": _number("wall_s", wall_s),
        }
        if self._columns is None:
            bad = [k for k in extra if k.startswith(LEVEL_PREFIX)]
            if bad:
                raise ValueError(f"MetricsLogger: extra column {bad[0]!r} clashes with the level columns")
            self._columns = [*STEP_COLUMNS, *extra, *(LEVEL_PREFIX + n for n in self.layers)]
            self._steps_file = open(self.logdir / STEPS_CSV, "w", newline="", encoding="utf-8")
            self._steps_csv = csv.writer(self._steps_file)
            self._write(self._steps_file, self._steps_csv, self._columns)
        new = [k for k in extra if k not in self._columns]
        if new:
            raise ValueError(f"MetricsLogger: extra column {new[0]!r} was not in the first row; "
                             f"steps.csv columns are {self._columns}")
        values.update(extra)
        values.update({LEVEL_PREFIX + n: str(level) for n, level in levels.items()})
        self._write(self._steps_file, self._steps_csv, [values.get(c, "") for c in self._columns])

        if self._tb is not None:
            s = values["step"]
            for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/floats_sent", "floats_sent"),
                             ("time/compress_s", "compress_s"), ("time/comm_s", "comm_s")):
                self._tb.add_scalar(tag, values[key], s)
            for key, value in extra.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"train/{key}", value, s)
            self._tb_levels(s, levels)

    def _tb_levels(self, step: int, levels: dict[str, str]) -> None:
        """Level scalars only where a layer's level changes (old value at its previous
        logged step, new value at this one) and at close: TensorBoard draws the same step
        function from a few points instead of one point per layer per step, which cost as
        much as the rest of ``log_step``."""
        for name, level in levels.items():
            code = LEVEL_CODES.get(str(level), UNKNOWN_LEVEL_CODE)
            shown = self._tb_shown.get(name)  # [code, step written, step last logged]
            if shown is None or shown[0] != code:
                if shown is not None and shown[1] != shown[2]:
                    self._tb.add_scalar(LEVEL_PREFIX + name, shown[0], shown[2])
                self._tb.add_scalar(LEVEL_PREFIX + name, code, step)
                shown = self._tb_shown[name] = [code, step, step]
            shown[2] = step

    def log_eval(self, step: int, *, epoch: int, floats_sent: int, wall_s: float, accuracy: float | None = None,
                 perplexity: float | None = None) -> None:
        """One evaluation: the accuracy (a fraction in [0, 1]) or the perplexity (>= 1)."""
        self._check_open()
        if (accuracy is None) == (perplexity is None):
            raise ValueError("MetricsLogger: give log_eval either accuracy or perplexity")
        if accuracy is not None:
            accuracy = _number("accuracy", accuracy)
            if not 0.0 <= accuracy <= 1.0:  # also refuses NaN
                raise ValueError(f"MetricsLogger: accuracy must be a fraction in [0, 1], got {accuracy!r}")
        else:
            perplexity = _number("perplexity", perplexity)
            if not perplexity >= 1.0:  # also refuses NaN (inf: a diverged run, recorded as such)
                raise ValueError(f"MetricsLogger: perplexity must be at least 1, got {perplexity!r}")
        row = (_number("step", step, int), _number("epoch", epoch, int), "" if accuracy is None else accuracy,
               "" if perplexity is None else perplexity, _number("floats_sent", floats_sent, int),
               _number("wall_s", wall_s))
        self._write(self._eval_file, self._eval_csv, row)
        if self._tb is not None:
            name, value = ("eval/accuracy", accuracy) if accuracy is not None else ("eval/perplexity", perplexity)
            self._tb.add_scalar(name, value, row[0])
            self._tb.add_scalar("eval/floats_sent", row[4], row[0])
            self._tb.flush()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for file in (self._steps_file, self._eval_file):
            if file is not None:
                file.close()
        if self._tb is not None:
            for name, (code, written, last) in self._tb_shown.items():
                if written != last:  # end each level line at its layer's last logged step
                    self._tb.add_scalar(LEVEL_PREFIX + name, code, last)
            self._tb.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(total: int, enabled: bool, desc: str):
    """A tqdm bar for rank 0; ``enabled=False`` (other ranks) prints nothing.

    It also draws when stderr is not a terminal, so that CI logs show progress, but then
    at most every 30 s, each redraw a whole line of its own: a launcher that prefixes every
    line of a rank's output (horovodrun's ``[0]<stderr>:``) would otherwise glue the next log
    line onto a bar left without its newline.
    """
    interactive = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
    return tqdm(total=total, desc=desc, disable=not enabled, file=sys.stderr if interactive else _WholeLines(sys.stderr),
                mininterval=0.1 if interactive else 30.0, dynamic_ncols=interactive)


class _WholeLines:
    """A stream for tqdm where each redraw (``\r`` + bar) is written as one whole line."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").rstrip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()
