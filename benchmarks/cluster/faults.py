"""Network faults injected into a running job on the emulated cluster, for tests and benchmarks.

    from cluster import Cluster
    from faults import Fault, run_with_fault

    with Cluster(2, rate="1gbit") as c:
        run = run_with_fault(c, ["-m", "accordion_hvd.train", ...], Fault("cut", "node2", hold=60),
                             ready=lambda: steps_csv.exists(), timeout=600)
        print(run.after_fault, run.rank_errors())

A fault starts when ``ready()`` first returns True (training has reached the point to hurt)
and is undone ``hold`` seconds later, or when the job ends, whichever comes first: the link
comes back up, the frozen worker is continued, the rate restored. Kinds:

* ``cut``: the node's switch port goes down (``cluster.sh link NODE down``): frames both ways
  are dropped silently, as with a pulled cable; nothing tells the processes;
* ``freeze``: the node's worker gets SIGSTOP (a process that hangs without dying: swapped
  out, stuck in a driver, paused by a debugger), SIGCONT at the end;
* ``slow``: the node's link rate drops to ``rate`` both ways (``cluster.sh rate``).
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

KINDS = ("cut", "freeze", "slow")
# Horovod prefixes each worker line with its rank: "[1]<stderr>:" (Gloo), "[1,1]<stderr>:" (MPI).
_RANK_LINE = re.compile(r"^\[(?:\d+,)?(\d+)\]<std(?:err|out)>:(.*)$")
_ERROR_LINE = re.compile(r"^([\w.]*(?:Error|Timeout|Exception|Interrupt)): (.*)$")


@dataclass(frozen=True)
class Fault:
    kind: str
    node: str = "node2"
    hold: float = 60.0     # seconds the fault lasts
    rate: str = "10mbit"   # for "slow"
    # undone as soon as every other node's worker has ended (a frozen worker, once the ranks
    # that were to notice it have stopped: the job cannot end while it is stopped)
    until_others_end: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Fault kind must be one of {KINDS}, got {self.kind!r}")


@dataclass
class FaultRun:
    returncode: int | None  # None: the job ran past its timeout (killed)
    fault_at: float | None  # seconds after launch; None: the job ended before it was ready
    undone_at: float | None
    ended_at: float
    stdout: str
    stderr: str
    log: list[str] = field(default_factory=list)
    progress: tuple[int | None, int | None] = (None, None)  # progress() when the fault began and ended
    stopped: dict[str, float] = field(default_factory=dict)  # node -> seconds after the fault its worker ended

    @property
    def after_fault(self) -> float | None:
        """Seconds from the fault to the end of the job."""
        return None if self.fault_at is None else self.ended_at - self.fault_at

    def rank_lines(self) -> dict[int, list[str]]:
        lines: dict[int, list[str]] = {}
        for line in (self.stdout + "\n" + self.stderr).splitlines():
            m = _RANK_LINE.match(line)
            if m:
                lines.setdefault(int(m.group(1)), []).append(m.group(2))
        return lines

    def rank_errors(self) -> dict[int, str]:
        """The last exception each rank printed ("TypeName: message")."""
        errors = {}
        for rank, lines in self.rank_lines().items():
            found = [line for line in lines if _ERROR_LINE.match(line)]
            if found:
                errors[rank] = found[-1]
        return errors


def rows_in(csv_path) -> int:
    """Data rows written to a CSV file so far (a training log's steps done); 0 if none yet."""
    try:
        with open(csv_path) as f:
            return max(0, sum(1 for _ in f) - 1)
    except OSError:
        return 0


def worker_pid(cluster, node: str, marker: str) -> int:
    """The Python process in NODE whose command line contains ``marker`` (not horovodrun, not
    the shell that may have started it); the newest if there are several."""
    found = worker_pids(cluster, node, marker)
    if not found:
        raise RuntimeError(f"no Python process with {marker!r} in its command line in {cluster.prefix}{node}")
    return max(found)


def worker_pids(cluster, node: str, marker: str) -> list[int]:
    ns = f"{cluster.prefix}{node}"
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10).stdout.split()
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if argv and os.path.basename(argv[0]).startswith("python") and marker in " ".join(argv) \
                and not any("horovodrun" in a for a in argv):
            found.append(int(pid))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


def run_with_fault(cluster, args: Sequence[str], fault: Fault, *, ready: Callable[[], bool], timeout: float,
                   marker: str | None = None, progress: Callable[[], int] | None = None,
                   **horovodrun) -> FaultRun:
    """``cluster.horovodrun(args, **horovodrun)`` with ``fault`` injected once ``ready()``.
    ``marker``: what identifies the worker's command line (for "freeze"; default args[0]).
    ``progress()`` (e.g. steps done) is noted when the fault begins and when it is undone."""
    marker = marker or args[0]
    started = time.monotonic()
    stamps: dict[str, float] = {}
    marks: dict[str, int] = {}
    log: list[str] = []
    job_done = threading.Event()

    def inject() -> None:
        while not ready():
            if job_done.wait(0.1):
                return
        stamps["fault"] = time.monotonic() - started
        if progress is not None:
            marks["fault"] = progress()
        pid = None
        if fault.kind == "cut":
            cluster.link(fault.node, "down")
        elif fault.kind == "freeze":
            pid = worker_pid(cluster, fault.node, marker)
            os.kill(pid, signal.SIGSTOP)
        else:
            cluster.set_rate(fault.node, fault.rate)
        log.append(f"{stamps['fault']:.1f} s: {fault.kind} {fault.node}" + (f" (pid {pid})" if pid else ""))
        others = [node for node in cluster.hostnames if node != fault.node]
        deadline = time.monotonic() + fault.hold
        while not job_done.wait(min(0.2, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline or fault.until_others_end and all(n in stopped for n in others):
                break
        if fault.kind == "cut":
            cluster.link(fault.node, "up")
        elif fault.kind == "freeze":
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        else:
            cluster.set_rate(fault.node, cluster.rate)
        stamps["undone"] = time.monotonic() - started
        if progress is not None:
            marks["undone"] = progress()
        log.append(f"{stamps['undone']:.1f} s: {fault.kind} undone")

    stopped: dict[str, float] = {}

    def watch() -> None:
        """Once the fault is on, note when each node's worker process ends."""
        while "fault" not in stamps:
            if job_done.wait(0.1):
                return
        workers = {node: pids for node in cluster.hostnames if (pids := worker_pids(cluster, node, marker))}
        give_up = math.inf  # a few seconds after the job: a worker still there is not ours to wait for
        while time.monotonic() < give_up:
            for node, pids in workers.items():
                if node not in stopped and not any(_alive(p) for p in pids):
                    stopped[node] = time.monotonic() - started - stamps["fault"]
            if len(stopped) == len(workers):
                return
            if job_done.is_set() and give_up == math.inf:
                give_up = time.monotonic() + 5
            time.sleep(0.2)

    injector = threading.Thread(target=inject, name="fault-injector", daemon=True)
    watcher = threading.Thread(target=watch, name="fault-watcher", daemon=True)
    injector.start()
    watcher.start()
    try:
        result = cluster.horovodrun(list(args), timeout=timeout, **horovodrun)
        returncode, stdout, stderr = result.returncode, result.stdout, result.stderr
    except TimeoutError as exc:
        returncode, stdout, stderr = None, "", str(exc)
    ended = time.monotonic() - started
    job_done.set()
    injector.join(timeout=60)  # undo the fault before the cluster goes down
    watcher.join(timeout=10)
    return FaultRun(returncode, stamps.get("fault"), stamps.get("undone"), ended, stdout, stderr, log,
                    (marks.get("fault"), marks.get("undone")), dict(stopped))
