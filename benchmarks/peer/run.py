"""Horovod's own optimizer tests with our compressor injected (``make peer-tests``, issue 62).

Runs the tests of Horovod v0.28.1's ``test/parallel/test_torch.py`` that build
``hvd.DistributedOptimizer`` on 2 ranks under ``horovodrun --gloo``, once per mode of
accordion_inject.py (Horovod's own compression; the same with accordion_hvd imported; then
ours: lossless and the default, each with every layer of >= 2 dims through the codec, and
lossless at the codec's own size rule, where these tests' small layers are sent whole), one
launch per test and mode so that a test that hangs or breaks Horovod's state fails alone. It
exits non-zero where a cell failed, hung or crashed; the one refusal the tests meet on purpose
(a smaller process set, refused as documented) is a cell of its own, "refused (expected)". Every launch has a timeout that kills
its process group (benchmarks/cluster/localrun.py): a hang is a failure, never a stuck job.

Horovod's file is used as Horovod publishes it, never copied into this repository: taken
from a git checkout or mirror of horovod/horovod (``--horovod-src``, or $HOROVOD_SRC; the
tag v0.28.1) or downloaded from raw.githubusercontent.com, checked against the pinned sha256
below, and placed under build/peer/ (git-ignored), with the helper module it imports
(test/utils/common.py).

    python benchmarks/peer/run.py --horovod-src /path/to/horovod [--results DIR]

Writes DIR/<mode>.log (every launch's command and output), DIR/results.json and
DIR/results.md (the table printed at the end, the failures' messages, which layers went
through the codec).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "cluster"))
from localrun import BIN, REPO, launch  # noqa: E402

TAG = "v0.28.1"
# The files taken from Horovod at TAG, with their sha256 (of the tag's blobs).
FILES = {
    "test/parallel/test_torch.py": "8af114f63fb7a87271322ad2da2c7050c3a9028570e45e8c44e9b1b4cac8db3a",
    "test/utils/common.py": "9844d1041c1e26b34657273608a51a19a94c18e0c22f9aa7971ae78189119290",
}
URL = "https://raw.githubusercontent.com/horovod/horovod/{tag}/{path}"
MODES = {  # mode: the column's title
    "horovod": "Horovod's compression",
    "imported": "Horovod's, accordion_hvd imported",
    "lossless": "ours lossless, every layer",
    "default": "ours default, every layer",
    "size-rule": "ours lossless, the codec's size rule",
}


# --- Horovod's test file ---------------------------------------------------------------------
def fetch(horovod_src: str | None, dest: Path) -> Path:
    """Horovod's files at TAG under DEST (checked); returns test_torch.py's path."""
    for path, sha in FILES.items():
        target = dest / path
        if target.exists() and hashlib.sha256(target.read_bytes()).hexdigest() == sha:
            continue
        data, origin = read_from(horovod_src, path)
        got = hashlib.sha256(data).hexdigest()
        if got != sha:
            raise SystemExit(f"{path} from {origin}: sha256 {got}, expected {sha} (Horovod {TAG}'s)")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        print(f"peer-tests: {path} from {origin} (sha256 ok)")
    return dest / "test/parallel/test_torch.py"


def read_from(horovod_src: str | None, path: str) -> tuple[bytes, str]:
    if horovod_src:
        src = Path(horovod_src)
        git = subprocess.run(["git", "-C", str(src), "show", f"{TAG}:{path}"], capture_output=True)
        if git.returncode == 0:  # a checkout or a bare mirror: the tag's blob
            return git.stdout, f"{src} (git, {TAG})"
        if (src / path).is_file():  # an unpacked source tree (its sha256 says whether it is TAG's)
            return (src / path).read_bytes(), str(src / path)
        raise SystemExit(f"{src} has no {TAG}:{path} (not a git clone of horovod/horovod with the tag, "
                         f"nor a source tree): {git.stderr.decode().strip()}")
    url = URL.format(tag=TAG, path=path)
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.read(), url
    except OSError as exc:
        raise SystemExit(f"cannot download {url} ({exc}); give a clone or mirror of horovod/horovod: "
                         f"HOROVOD_SRC=/path make peer-tests") from None


def optimizer_tests(test_file: Path) -> list[str]:
    """The tests of TorchTests whose code calls hvd.DistributedOptimizer, in file order."""
    tree = ast.parse(test_file.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TorchTests")
    return [f.name for f in cls.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")
            and any(isinstance(n, ast.Attribute) and n.attr == "DistributedOptimizer" for n in ast.walk(f))]


# --- one launch --------------------------------------------------------------------------------
def run_one(test_file: Path, test: str, mode: str, out: Path, timeout: float, keep_muon: bool) -> tuple[dict, str]:
    """One test in one mode on 2 ranks; returns (its cell, the launch's log)."""
    where = REPO / "build/peer/ranks" / mode / test  # each rank's report (results.json keeps them all)
    for old in where.glob("rank*.json"):
        old.unlink()
    cmd = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
           sys.executable, "-m", "pytest", "-p", "accordion_inject", "-p", "no:cacheprovider", "-v", "-rA",
           # a test still running 30 s before the kill prints every thread's stack: where it hangs
           "-o", f"faulthandler_timeout={max(timeout - 30, 1):g}",
           f"{test_file}::TorchTests::{test}"]
    env = {"ACCORDION_PEER_MODE": mode, "ACCORDION_PEER_RESULTS": str(where),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
           **({"ACCORDION_PEER_KEEP_MUON": "1"} if keep_muon else {})}
    started = time.monotonic()
    try:
        result = launch(cmd, timeout, env)
        rc, output = result.returncode, result.stdout
    except AssertionError as exc:  # localrun killed the process group
        rc, output = None, str(exc)
    seconds = time.monotonic() - started
    ranks = {p.stem: json.loads(p.read_text())["tests"].get(test, {}) for p in sorted(where.glob("rank*.json"))}
    cell = judge(ranks, rc, timeout)
    cell["seconds"] = round(seconds, 1)
    log = (f"\n===== {test} [{mode}]: {cell['result']}, exit {rc}, {seconds:.1f} s\n"
           f"$ {' '.join(f'{k}={v}' for k, v in env.items())} {' '.join(cmd)}\n{output}")
    return cell, log


# The one refusal these tests meet on purpose: a process set smaller than the world, which the
# compressor refuses as documented (its data plane reduces over all of Horovod's ranks).
EXPECTED = "cannot honour process_set="


def judge(ranks: dict[str, dict], rc: int | None, timeout: float) -> dict:
    """A cell from each rank's report and the launch's exit status."""
    outcomes = {r: t.get("outcome") for r, t in ranks.items()}
    messages = {r: t["message"] for r, t in ranks.items() if t.get("message")}
    cell = {"ranks": ranks, "exit": rc}
    if rc is None:
        cell["result"] = "HANG"
        messages["launch"] = f"killed after {timeout:g} s; ranks that reported: {outcomes or 'none'}"
    elif len(outcomes) < 2:
        cell["result"] = "CRASH"
        messages["launch"] = f"exit {rc}; only {sorted(outcomes) or 'no rank'} reported"
    elif all(o == "passed" for o in outcomes.values()):
        cell["result"] = "passed" if rc == 0 else "FAILED"
        if rc != 0:
            messages["launch"] = f"every rank passed but the launch exited with {rc}"
    elif all(o == "skipped" for o in outcomes.values()):
        cell["result"] = "skipped"
    elif messages and all(EXPECTED in m for r, m in messages.items() if r != "launch"):
        cell["result"] = "refused (expected)"  # a documented refusal (docs/api.md), on every rank
    else:
        cell["result"] = "FAILED"
    cell["messages"] = messages
    return cell


def coverage(cell: dict) -> str:
    """Which layers rank 0's compressors sent through the codec: 'codec a/b 2-D+, c/d 1-D',
    of the layers whose gradient reached them (the others are counted apart: no backward, no
    gradient, or a sparse one, which Horovod reduces without calling the compressor)."""
    layers = [layer for opt in cell["ranks"].get("rank0", {}).get("optimizers", []) for layer in opt["layers"].values()]
    seen = [layer for layer in layers if layer["level"] != "no gradient"]
    parts = []
    for label, of_dims in (("2-D+", lambda s: len(s) >= 2), ("1-D", lambda s: len(s) < 2)):
        some = [layer for layer in seen if of_dims(layer["shape"])]
        if some:
            parts.append(f"{sum(layer['level'] != 'dense' for layer in some)}/{len(some)} {label}")
    text = "codec " + ", ".join(parts) if parts else ""
    if len(seen) < len(layers):
        text += f"{'; ' if text else ''}{len(layers) - len(seen)} never reached it"
    return text


# --- the whole run -----------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--horovod-src", default=os.environ.get("HOROVOD_SRC") or None,
                        help="a git clone or mirror of horovod/horovod (default $HOROVOD_SRC; else download)")
    parser.add_argument("--results", type=Path, default=REPO / "build/peer/results")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--tests", nargs="+", help="only these tests (default: every one that builds the optimizer)")
    parser.add_argument("--timeout", type=float, default=180, help="seconds per launch before it counts as a hang")
    parser.add_argument("--keep-muon", action="store_true", help="leave torch.optim.Muon in the tests' optimizers")
    args = parser.parse_args()

    test_file = fetch(args.horovod_src, REPO / "build/peer" / f"horovod-{TAG}")
    tests = optimizer_tests(test_file)
    if args.tests:
        unknown = set(args.tests) - set(tests)
        if unknown:
            raise SystemExit(f"not tests that build DistributedOptimizer: {sorted(unknown)}; they are {tests}")
        tests = [t for t in tests if t in args.tests]
    print(f"peer-tests: {len(tests)} tests build hvd.DistributedOptimizer: {' '.join(tests)}")
    out = args.results
    out.mkdir(parents=True, exist_ok=True)
    header = describe(args)
    table: dict[str, dict[str, dict]] = {t: {} for t in tests}
    for mode in args.modes:
        log_path = out / f"{mode}.log"
        log_path.write_text(header)
        for test in tests:
            cell, log = run_one(test_file, test, mode, out, args.timeout, args.keep_muon)
            table[test][mode] = cell
            with log_path.open("a") as f:
                f.write(log)
            print(f"  {mode:12} {test:40} {cell['result']:8} {cell['seconds']:6.1f} s", flush=True)
    (out / "results.json").write_text(json.dumps({"header": header, "tests": table}, indent=1))
    md = markdown(table, args.modes, header)
    (out / "results.md").write_text(md)
    print("\n" + md)
    failed = [f"{test} [{mode}]" for test, cells in table.items() for mode, cell in cells.items()
              if cell["result"] not in ("passed", "skipped", "refused (expected)")]
    if failed:
        raise SystemExit(f"peer-tests: {len(failed)} failed: {', '.join(failed)}")


def describe(args) -> str:
    git = lambda *a: subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
    versions = subprocess.run([sys.executable, "-c", "import torch, horovod; print(torch.__version__, horovod.__version__)"],
                              capture_output=True, text=True).stdout.split()
    dirty = git("status", "--short", "--", "accordion_hvd").replace("\n", "; ")
    return (f"# peer-tests: Horovod {TAG} test/parallel/test_torch.py, 2 ranks, horovodrun --gloo\n"
            f"# {datetime.datetime.now().isoformat(timespec='seconds')}, accordion_hvd at {git('rev-parse', '--short', 'HEAD')}"
            f"{' with uncommitted changes in the checkout: ' + dirty if dirty else ''}\n"
            f"# torch {versions[0] if versions else '?'}, horovod {versions[1] if len(versions) > 1 else '?'}; "
            f"timeout {args.timeout:g} s per launch; torch.optim.Muon {'kept' if args.keep_muon else 'left out'}\n")


def markdown(table: dict[str, dict[str, dict]], modes: list[str], header: str) -> str:
    lines = [header.replace("# ", "").replace("\n", "  \n"), "",
             "| test | " + " | ".join(MODES[m] for m in modes) + " |", "|---|" + "---|" * len(modes)]
    notes = []
    for test, cells in table.items():
        row = []
        for mode in modes:
            cell = cells[mode]
            text = cell["result"]
            if cell["result"] not in ("passed", "skipped"):  # (an expected refusal's message too)
                notes.append(f"* `{test}` [{mode}] {cell['result']}: " +
                             "; ".join(f"{r}: {m}" for r, m in sorted(cell["messages"].items())))
            elif cell["result"] == "skipped":
                text += f" ({next(iter(cell['messages'].values()), '')})"
            if mode not in ("horovod", "imported") and coverage(cell):
                text += f", {coverage(cell)}"
            row.append(text)
        lines.append(f"| `{test}` | " + " | ".join(row) + " |")
    lines += ["", "\"codec a/b 2-D+\": of the b parameters with 2 or more dims whose gradient reached rank 0's "
              "compressors (summed over the test's optimizers), a went through the codec (the level `stats()` "
              "reports is not \"dense\"); the others were averaged uncompressed on our data plane. 1-D likewise. "
              "\"n never reached it\": parameters of the optimizer whose gradient never came to our compressor "
              "(no backward in the test, no gradient, or a sparse one, which Horovod reduces itself).", ""]
    if notes:
        lines += ["Failures (each rank's message; `launch`: what the launcher saw):", "", *notes, ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
