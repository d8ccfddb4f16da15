"""A pytest plugin that runs Horovod's own optimizer tests with our compressor in them.

Horovod's ``test/parallel/test_torch.py`` (v0.28.1) is run as Horovod publishes it; this
plugin, loaded with ``-p accordion_inject`` (``benchmarks/peer`` on ``PYTHONPATH``: run.py
does both), changes three things around it and nothing in it:

* ``hvd.DistributedOptimizer`` is wrapped: where a test passes Horovod's ``Compression.none``
  (every test of the file does, by leaving ``compression=`` out), the optimizer gets a new
  ``AccordionCompressor`` of the mode below, one per optimizer (one compressor serves one
  model). The compressor is given nothing else (a user's ``compression=`` change).
* ``torch.optim.Muon`` (new in torch 2.13; it accepts 2-D parameters only) is left out of
  ``torch.optim.Optimizer.__subclasses__()``, which three tests walk to build every optimizer
  of torch with the same model, biases included: with it they fail under plain Horovod too
  (run.py --keep-muon shows it). ACCORDION_PEER_KEEP_MUON=1 keeps it.
* ``mock`` (the PyPI backport that Horovod's test/utils/common.py imports, not installed
  here) is ``unittest.mock`` when missing: the same API, used only by helpers these tests
  never call.

ACCORDION_PEER_MODE picks the compressor:
  horovod      Horovod's own compression, untouched (the reference column)
  imported     the same, in a process that imported accordion_hvd after horovod.torch (as a
               script using both does) and never makes a compressor: what importing changes
  lossless     AccordionCompressor(TopK(ratio=1.0, min_compression_rate=0.5)): lossless,
               with the size rule lowered so that every layer of >= 2 dims goes through the
               codec (numel >= 0.5 * 2 * numel always holds). A layer keeping half its entries
               or more is sent whole, so at ratio 1.0 the codec's step is its dense route
               (error feedback, NaN check, flushed into Horovod's allreduce: TopK.sends_dense),
               never the top-k selection. A 1-D tensor (a bias) is never compressed by TopK,
               whatever the settings (``len(shape) >= 2`` in TopK.compressible).
  default      the library default's codec and policy (8-bit sparse chunks under the link
               gate), lossy, with the size rule lowered to every layer (``min_numel=1``: the
               default sends a layer of fewer than 1024 entries whole, and these tests' layers
               are smaller)
  size-rule    AccordionCompressor(TopK(ratio=1.0)): lossless at the codec's own size rule
               (TopK compresses a layer with >= 2 dims and numel >= min_compression_rate * 2k;
               at ratio 1.0, k = numel, so with the default rate 2 no layer qualifies and
               every gradient is averaged uncompressed on our own data plane)

ACCORDION_PEER_RESULTS (a directory): each rank writes ``rank<R>.json`` with each test's
outcome and, for our modes, each optimizer's layers (shape, and the level our compressor's
``stats()`` reports: "dense" for a layer it never compressed).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import unittest.mock
from pathlib import Path

import pytest
import torch

MODES = ("horovod", "imported", "lossless", "default", "size-rule")
MODE = os.environ.get("ACCORDION_PEER_MODE", "horovod")
if MODE not in MODES:
    raise ValueError(f"ACCORDION_PEER_MODE must be one of {MODES}, got {MODE!r}")

try:
    import mock  # noqa: F401
except ImportError:
    sys.modules["mock"] = unittest.mock


def make_compressor():
    """A new compressor of this run's mode."""
    import accordion_hvd as acc
    if MODE == "size-rule":
        return acc.AccordionCompressor(acc.TopK(ratio=1.0))
    if MODE == "default":
        return acc.AccordionCompressor(acc.Quantize(8, skip_energy=0.05, min_numel=1), policy="link-gate")
    return acc.AccordionCompressor(acc.TopK(ratio=1.0, min_compression_rate=0.5))  # lossless, every layer


_optimizers: list = []  # (Horovod's optimizer, our compressor) built in the current test


def _wrap_distributed_optimizer() -> None:
    # Imported as a user's script does, horovod.torch first: accordion_hvd then puts its own
    # check around hvd.DistributedOptimizer (refusals at construction, on every rank:
    # horovod/patches.py), and ours goes around that one, so that the check sees the
    # compressor we pass. functools.wraps copies its marker, so that the compressors made
    # later do not wrap again.
    import horovod.torch as hvd
    import accordion_hvd  # noqa: F401

    original = hvd.DistributedOptimizer
    signature = inspect.signature(original)

    @functools.wraps(original)
    def DistributedOptimizer(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        compression = bound.arguments.get("compression", hvd.Compression.none)
        if compression is not hvd.Compression.none:  # a test's own choice: left as it is
            return original(*args, **kwargs)
        compressor = make_compressor()
        bound.arguments["compression"] = compressor
        optimizer = original(*bound.args, **bound.kwargs)
        _optimizers.append((optimizer, compressor))
        return optimizer

    hvd.DistributedOptimizer = DistributedOptimizer  # the tests look it up at each call


def _without_muon() -> None:
    muon = getattr(torch.optim, "Muon", None)
    if muon is None or os.environ.get("ACCORDION_PEER_KEEP_MUON") == "1":
        return

    def subclasses(cls):
        return [c for c in type.__subclasses__(cls) if c is not muon]

    torch.optim.Optimizer.__subclasses__ = classmethod(subclasses)


def pytest_configure(config) -> None:
    _without_muon()
    if MODE == "imported":
        import horovod.torch  # noqa: F401
        import accordion_hvd  # noqa: F401
    elif MODE != "horovod":
        _wrap_distributed_optimizer()


# --- what each rank reports --------------------------------------------------------------------
_results: dict[str, dict] = {}


def _layers() -> list[dict]:
    """For each optimizer our wrapper built in this test: its layers' shapes and levels."""
    out = []
    for optimizer, compressor in _optimizers:
        try:
            levels = {n: v["level"] for n, v in compressor.stats()["layers"].items()}
        except Exception as exc:  # noqa: BLE001 - a report, never a second failure
            levels = {"?": f"stats() raised {type(exc).__name__}: {exc}"}
        names = getattr(optimizer, "_parameter_names", {})
        out.append({"layers": {name: {"shape": list(p.shape), "level": levels.get(name, "no gradient")}
                               for p, name in sorted(names.items(), key=lambda item: item[1])},
                    **({"error": levels["?"]} if "?" in levels else {})})
    return out


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _optimizers.clear()
    yield
    _results.setdefault(item.name, {})["optimizers"] = _layers()  # before tearDown shuts Horovod down


def pytest_runtest_logreport(report) -> None:
    entry = _results.setdefault(report.nodeid.rpartition("::")[2], {})
    if report.failed:
        entry["outcome"] = "failed"
        entry.setdefault("message", f"{report.when}: {_last_line(report.longreprtext)}")
    elif report.skipped and entry.get("outcome") != "failed":
        entry["outcome"] = "skipped"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        entry["message"] = reason.removeprefix("Skipped: ")
    elif report.when == "call" and entry.get("outcome") is None:
        entry["outcome"] = "passed"


def _last_line(text: str) -> str:
    """The error's own line (pytest's 'E   ...' lines; the last one names the exception)."""
    errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    return (errors[-1] if errors else text.strip().splitlines()[-1] if text.strip() else "")[:400]


def pytest_sessionfinish(session) -> None:
    where = os.environ.get("ACCORDION_PEER_RESULTS")
    if where:
        rank = os.environ.get("HOROVOD_RANK", "0")
        Path(where).mkdir(parents=True, exist_ok=True)
        (Path(where) / f"rank{rank}.json").write_text(json.dumps({"mode": MODE, "tests": _results}, indent=1))
