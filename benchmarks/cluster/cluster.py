"""Python handle on the emulated cluster (cluster.sh), for benchmarks and tests.

    from cluster import Cluster        # with benchmarks/cluster on sys.path

    with Cluster(2, rate="100mbit") as c:
        result = c.horovodrun(["train.py"], timeout=600)
        print(result.stdout)

Entering brings the nodes up (removing leftovers of an earlier run with the same prefix);
leaving tears them down, also after an exception or a SIGTERM (which, inside the block and
in the main thread, raises SystemExit(143) so that the block is left the ordinary way).
Every command runs with a timeout, in its own process group, which is killed on expiry.
Needs root, like cluster.sh.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Mapping, Sequence

from localrun import MPI_ARGS  # benchmarks/cluster is on sys.path wherever cluster.py is imported

CLUSTER_DIR = Path(__file__).resolve().parent
CLUSTER_SH = CLUSTER_DIR / "cluster.sh"
DISCOVER_HOSTS = CLUSTER_DIR / "discover_hosts.sh"
REPO = CLUSTER_DIR.parent.parent
IFACE = "hvd0"



def run_with_timeout(cmd: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
                     cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Run CMD, stdout and stderr captured separately; on timeout kill its process group.

    Raises TimeoutError (with the output so far) rather than hanging.
    """
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(env) if env is not None else None, cwd=cwd,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            # A process outside the group (a worker another node's launcher left behind when
            # its parent died) still holds the pipes open: give up on the rest of the output.
            for pipe in (proc.stdout, proc.stderr):
                pipe.close()
            proc.wait()
            out, err = "(output lost: the pipes stayed open after the kill)", ""
        raise TimeoutError(f"timed out after {timeout} s: {' '.join(map(str, cmd))}\n"
                           f"--- stdout\n{out}\n--- stderr\n{err}") from None
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


class Cluster:
    """N emulated nodes node1..nodeN; commands run on node1 (the head) unless told otherwise."""

    def __init__(self, nodes: int = 2, *, rate: str = "1gbit", delay: str = "0",
                 prefix: str = "acc-", python: str = sys.executable):
        self.nodes = nodes
        self.rate = rate
        self.delay = delay
        self.prefix = prefix
        self.python = python

    # -- lifecycle

    @property
    def env(self) -> dict[str, str]:
        """Environment for cluster.sh: ours plus the prefix."""
        return {**os.environ, "ACC_CLUSTER_PREFIX": self.prefix}

    def _cluster_sh(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        return run_with_timeout([str(CLUSTER_SH), *args], timeout=timeout, env=self.env)

    def up(self, timeout: float = 120) -> None:
        result = self._cluster_sh("up", str(self.nodes), "--rate", self.rate, "--delay", self.delay,
                                  timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"cluster.sh up failed ({result.returncode}): {result.stderr.strip()}")

    def down(self, timeout: float = 120) -> None:
        result = self._cluster_sh("down", timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"cluster.sh down failed ({result.returncode}): {result.stderr.strip()}")

    def __enter__(self) -> "Cluster":
        # Python's default SIGTERM ends the process without leaving `with` blocks: the
        # namespaces would outlive a benchmark that was killed or timed out.
        self._sigterm_before = None
        if threading.current_thread() is threading.main_thread():
            self._sigterm_before = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            self.up()
        except BaseException:
            self._restore_sigterm()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        try:
            self.down()
        finally:
            self._restore_sigterm()

    def _restore_sigterm(self) -> None:
        if self._sigterm_before is not None:
            signal.signal(signal.SIGTERM, self._sigterm_before)
            self._sigterm_before = None

    # -- faults on the running cluster

    def link(self, node: str, state: str, timeout: float = 30) -> None:
        """Cut NODE's link (``state='down'``: its switch port goes down, frames are dropped
        silently both ways) or restore it (``'up'``)."""
        result = self._cluster_sh("link", node, state, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"cluster.sh link {node} {state} failed: {result.stderr.strip()}")

    def set_rate(self, node: str, rate: str, timeout: float = 30) -> None:
        """Change NODE's link rate both ways (e.g. '10mbit'); ``set_rate(node, cluster.rate)``
        restores it."""
        result = self._cluster_sh("rate", node, rate, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"cluster.sh rate {node} {rate} failed: {result.stderr.strip()}")

    # -- running things

    @property
    def hostnames(self) -> list[str]:
        return [f"node{k}" for k in range(1, self.nodes + 1)]

    @property
    def hosts_file(self) -> Path:
        """What discover_hosts.sh prints to Horovod Elastic; rewrite it to add/remove hosts."""
        return Path(f"/run/{self.prefix}cluster/hosts")

    def set_hosts(self, hosts: Sequence[str]) -> None:
        """Replace the Elastic host list atomically, e.g. set_hosts(["node1:1"])."""
        tmp = self.hosts_file.with_suffix(".tmp")
        tmp.write_text("".join(f"{h}\n" for h in hosts))
        tmp.replace(self.hosts_file)

    def job_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for a Horovod job: repo importable, one OpenMP thread, unbuffered, and
        this Python's bin/ (horovodrun, python) first on PATH."""
        env = {**self.env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        env["PATH"] = f"{Path(self.python).parent}{os.pathsep}{env.get('PATH', '')}"
        return {**env, **(extra or {})}

    def exec(self, argv: Sequence[str], *, node: str = "node1", timeout: float,
             env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = REPO
             ) -> subprocess.CompletedProcess:
        """Run ARGV inside NODE (cwd and environment kept, stand-in ssh on PATH)."""
        return run_with_timeout([str(CLUSTER_SH), "exec", node, "--", *argv], timeout=timeout,
                                env=self.job_env(env), cwd=cwd)

    def exec_everywhere(self, argv_of: Callable[[int], Sequence[str]], *, timeout: float,
                        env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = REPO
                        ) -> dict[int, subprocess.CompletedProcess]:
        """Run ``argv_of(k)`` inside node k+1, on every node at once; the results by k."""
        results: dict[int, subprocess.CompletedProcess] = {}

        def launch(k: int) -> None:
            results[k] = self.exec(argv_of(k), node=f"node{k + 1}", timeout=timeout, env=env, cwd=cwd)

        threads = [threading.Thread(target=launch, args=(k,)) for k in range(self.nodes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    def torchrun(self, args: Sequence[str], *, timeout: float, port: int = 29533, per_node: int = 1,
                 env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = REPO
                 ) -> dict[int, subprocess.CompletedProcess]:
        """``torchrun ARGS...`` on every node, ``per_node`` processes each, static rendezvous at
        node1, Gloo on the cluster's interface; the results by node index."""
        torchrun = str(Path(self.python).parent / "torchrun")
        return self.exec_everywhere(lambda k: [torchrun, "--nnodes", str(self.nodes), "--nproc_per_node", str(per_node),
                                               "--node_rank", str(k), "--master_addr", "node1",
                                               "--master_port", str(port), *args],
                                    timeout=timeout, env={"GLOO_SOCKET_IFNAME": IFACE, **(env or {})}, cwd=cwd)

    def horovodrun(self, args: Sequence[str], *, np: int | None = None, backend: str = "gloo",
                   hosts: str | None = None, elastic: bool = False, timeout: float,
                   env: Mapping[str, str] | None = None, extra: Sequence[str] = (),
                   cwd: str | os.PathLike | None = REPO) -> subprocess.CompletedProcess:
        """``horovodrun`` on node1 across the nodes: ``python ARGS...`` with NP ranks.

        Default hosts: one slot per node. ``elastic=True`` uses discover_hosts.sh with
        ``--min-np 1 --max-np NP`` instead of -H (Gloo only, as in Horovod).
        """
        if backend not in ("gloo", "mpi"):
            raise ValueError(f"backend must be 'gloo' or 'mpi', got {backend!r}")
        np = np or self.nodes
        cmd = ["horovodrun", "-np", str(np), f"--{backend}", "--network-interfaces", IFACE]
        if elastic:
            cmd += ["--min-np", "1", "--max-np", str(np), "--host-discovery-script", str(DISCOVER_HOSTS)]
        else:
            cmd += ["-H", hosts or ",".join(f"{h}:1" for h in self.hostnames)]
        if backend == "mpi":
            cmd.append(f"--mpi-args={MPI_ARGS}")
        cmd += [*extra, self.python, *args]
        return self.exec(cmd, timeout=timeout, env=env, cwd=cwd)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)
