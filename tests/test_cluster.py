"""The emulated multi-node cluster (benchmarks/cluster): real horovodrun across network
namespaces, the stand-in ssh, link shaping, refusals, and clean teardown.

Needs root and working `ip netns`; skipped otherwise (many CI sandboxes forbid namespaces).
Uses its own name prefix, so a benchmark cluster that is up at the same time is untouched.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CLUSTER_DIR = REPO / "benchmarks" / "cluster"
CLUSTER_SH = CLUSTER_DIR / "cluster.sh"
PREFIX = "acctest-"

sys.path.insert(0, str(CLUSTER_DIR))  # cluster.py imports its sibling localrun.py
_spec = importlib.util.spec_from_file_location("acc_cluster", CLUSTER_DIR / "cluster.py")
acc_cluster = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(acc_cluster)
Cluster = acc_cluster.Cluster
run_with_timeout = acc_cluster.run_with_timeout


def _why_no_namespaces() -> str | None:
    """None if this process can create network namespaces, else the reason it cannot."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"'{tool}' not installed"
    probe = f"{PREFIX}probe{os.getpid()}"
    try:
        added = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
        if added.returncode != 0:
            return f"'ip netns add' does not work here: {added.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"'ip netns add' does not work here: {exc}"
    finally:
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True, timeout=10)
    return None


_SKIP_REASON = _why_no_namespaces()
pytestmark = pytest.mark.skipif(_SKIP_REASON is not None, reason=f"emulated cluster: {_SKIP_REASON}")

ENV = {**os.environ, "ACC_CLUSTER_PREFIX": PREFIX}


def cluster_sh(*args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_with_timeout([str(CLUSTER_SH), *args], timeout=timeout, env=env or ENV)


def root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10).stdout
    return {line.split(":")[1].strip() for line in out.splitlines() if ":" in line}


def leftovers() -> list[str]:
    """Everything with our prefix that teardown should have removed."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    found = [f"netns {line.split()[0]}" for line in names.splitlines() if line.startswith(PREFIX)]
    found += [str(p) for p in Path("/etc/netns").glob(f"{PREFIX}*")] if Path("/etc/netns").is_dir() else []
    found += [str(p) for p in Path("/run").glob(f"{PREFIX}*")]
    found += [str(p) for p in Path("/run/netns").glob(f"{PREFIX}*")] if Path("/run/netns").is_dir() else []
    return found


def pids_in(node: str) -> list[int]:
    result = subprocess.run(["ip", "netns", "pids", f"{PREFIX}{node}"], capture_output=True, text=True,
                            timeout=10)
    return [int(p) for p in result.stdout.split()]


def running_in(node: str, cmdline: bytes) -> bool:
    """Whether a process with exactly this command line (NUL-separated) is in the node."""
    for pid in pids_in(node):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes() == cmdline:
                return True
        except OSError:  # it ended meanwhile
            continue
    return False


@pytest.fixture(autouse=True)
def always_torn_down():
    """Whatever a test does, leave no namespace behind for the next one (or the machine)."""
    links_before = root_links()
    yield links_before
    cluster_sh("down")
    assert leftovers() == []
    assert root_links() == links_before


TINY_WORKER = textwrap.dedent("""
    import socket
    import torch
    import horovod.torch as hvd
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    print(f"rank={hvd.rank()} size={hvd.size()} host={socket.gethostname()} sum={total:g}", flush=True)
""")


def check_tiny_worker_output(result: subprocess.CompletedProcess, n: int) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # Matched anywhere, not per line: mpirun's tagged output can interleave two ranks' lines
    # ("...sum=3[1,1]<stdout>:rank=1 ...") when they print at the same moment.
    reports = re.findall(r"rank=(\d+) size=(\d+) host=(\S+?) sum=(\d+)", output)
    ranks = sorted(int(rank) for rank, _, _, _ in reports)
    assert ranks == list(range(n)), output
    assert all(int(size) == n and int(total) == n * (n + 1) // 2
               for _, size, _, total in reports), output
    assert {host for _, _, host, _ in reports} == {f"node{k}" for k in range(1, n + 1)}, output


@pytest.mark.horovod
@pytest.mark.parametrize("nodes", [2, 4])
def test_gloo_across_nodes_then_nothing_left(nodes, tmp_path, always_torn_down):
    worker = tmp_path / "tiny.py"
    worker.write_text(TINY_WORKER)
    with Cluster(nodes, prefix=PREFIX) as cluster:
        result = cluster.horovodrun([str(worker)], backend="gloo", timeout=90)
    check_tiny_worker_output(result, nodes)
    # Down already ran (context exit): nothing of ours may remain, root namespace unchanged.
    assert leftovers() == []
    assert root_links() == always_torn_down


@pytest.mark.horovod
def test_mpi_across_nodes(tmp_path):
    """mpirun starts its ORTE daemon on node2 through the stand-in ssh; ranks talk over hvd0."""
    worker = tmp_path / "tiny.py"
    worker.write_text(TINY_WORKER)
    with Cluster(2, prefix=PREFIX) as cluster:
        result = cluster.horovodrun([str(worker)], backend="mpi", timeout=90)
    check_tiny_worker_output(result, 2)


@pytest.mark.horovod
def test_elastic_job_survives_a_dead_node():
    """A worker on node2 is killed mid-run: Elastic drops node2 and finishes on node1 alone."""
    with Cluster(2, prefix=PREFIX) as cluster:
        assert cluster.hosts_file.read_text() == "node1:1\nnode2:1\n"
        result = cluster.horovodrun(
            [str(CLUSTER_DIR / "elastic_demo.py"), "--steps", "12", "--die-on", "node2",
             "--die-at", "4", "--step-seconds", "0.1"],
            backend="gloo", elastic=True, timeout=90)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "node2: killed (SIGKILL) at step 4" in output, output
    assert "done: 12 steps, final size 1" in output, output


@pytest.mark.horovod
def test_compressor_state_survives_a_dead_worker_and_a_joining_one(tmp_path):
    """AccordionCompressor under Horovod Elastic (benchmarks/elastic_train.py): node2's worker
    is killed mid-backward (compressed exchanges in flight), the survivor restores the last
    commit and goes on alone; node3 then joins and gets the shared state by sync. Every rank
    ends with the same parameters, levels, Q and counters, and the model has learned."""
    died = tmp_path / "died"
    with Cluster(3, prefix=PREFIX) as cluster:
        cluster.set_hosts(["node1:1", "node2:1"])

        def add_node3():
            deadline = time.monotonic() + 120
            while not died.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            cluster.set_hosts(["node1:1", "node2:1", "node3:1"])

        threading.Thread(target=add_node3, daemon=True).start()
        result = cluster.horovodrun(
            [str(REPO / "benchmarks" / "elastic_train.py"), "--epochs", "6", "--lr-milestones", "4",
             "--die-on", "node2", "--die-at", "30", "--died-file", str(died), "--step-seconds", "0.05"],
            np=2, backend="gloo", elastic=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "node2: worker killed (SIGKILL) in the backward pass of step 30" in output, output
    # The world restarts at size 1 and then 2 again, or straight at 2 when node3 is already
    # listed by the time Horovod re-forms it.
    final = re.search(r"final test accuracy: ([0-9.]+); world sizes \[2, (1, )?2\]; steps \d+; ranks agree: True",
                      output)
    assert final and float(final.group(1)) > 0.85, output


def test_stand_in_ssh():
    """Options before and after the host (as horovodrun sends them), a fresh login
    environment on the remote node, and ssh's exit status 255 for an unknown host."""
    with Cluster(2, prefix=PREFIX) as cluster:
        ok = cluster.exec(
            ["ssh", "-o", "PasswordAuthentication=no", "-o", "StrictHostKeyChecking=no", "node2",
             "-p", "22", "-o", "ConnectTimeout=5", "-qT",
             'echo "$(hostname) ${LEAK_CHECK:-not-leaked}"; cat /etc/hostname; exit 7'],
            env={"LEAK_CHECK": "leaked"}, timeout=30)
        assert ok.returncode == 7, ok
        assert ok.stdout.splitlines() == ["node2 not-leaked", "node2"], ok
        by_address = cluster.exec(["ssh", "root@198.18.0.2", "hostname"], timeout=30)
        assert by_address.stdout.strip() == "node2", by_address
        unknown = cluster.exec(["ssh", "node9", "true"], timeout=30)
        assert unknown.returncode == 255, unknown
        assert "node9" in unknown.stderr, unknown


def test_links_are_shaped():
    """A TCP stream node1 -> node2 runs at about the configured rate (tbf counts headers
    too, so goodput is ~95% of it; allow for a loaded machine below that)."""
    rate_mbit, megabytes = 20, 2.5   # about 1 s of transfer
    server = textwrap.dedent("""
        import socket, time
        s = socket.create_server(("0.0.0.0", 5201))
        conn, _ = s.accept()
        received, start = 0, None
        while chunk := conn.recv(1 << 16):
            start = start or time.perf_counter()
            received += len(chunk)
        print(received * 8 / (time.perf_counter() - start) / 1e6)
    """)
    client = textwrap.dedent(f"""
        import socket, time
        for _ in range(100):
            try:
                conn = socket.create_connection(("node2", 5201), timeout=10)
                break
            except ConnectionRefusedError:
                time.sleep(0.05)
        conn.sendall(b"x" * int({megabytes} * 1e6))
        conn.close()
    """)
    with Cluster(2, rate=f"{rate_mbit}mbit", prefix=PREFIX) as cluster:
        receiver = subprocess.Popen(
            [str(CLUSTER_SH), "exec", "node2", "--", sys.executable, "-c", server],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cluster.job_env(),
            start_new_session=True)
        try:
            sent = cluster.exec([sys.executable, "-c", client], timeout=30)
            assert sent.returncode == 0, sent
            out, err = receiver.communicate(timeout=30)
        finally:
            if receiver.poll() is None:
                os.killpg(receiver.pid, signal.SIGKILL)
                receiver.communicate()
    assert receiver.returncode == 0, err
    measured = float(out)
    assert 0.6 * rate_mbit < measured < 1.02 * rate_mbit, f"{measured:.1f} Mbit/s on a {rate_mbit} Mbit/s link"


def _one_line_refusal(result: subprocess.CompletedProcess, fragment: str) -> None:
    assert result.returncode != 0, result
    assert result.stdout == "", result
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and fragment in lines[0], result.stderr


def _path_without(tool: str, tmp_path: Path) -> str:
    """PATH with TOOL removed but everything else still found: directories that hold TOOL
    are replaced by a directory of links to all their other programs."""
    shadow = tmp_path / f"no-{tool}"
    shadow.mkdir()
    dirs = []
    for d in os.environ["PATH"].split(os.pathsep):
        if d and (Path(d) / tool).exists():
            for prog in Path(d).iterdir():
                if prog.name != tool and not (shadow / prog.name).exists():
                    (shadow / prog.name).symlink_to(prog)
        elif d:
            dirs.append(d)
    assert shutil.which(tool, path=os.pathsep.join([str(shadow), *dirs])) is None
    return os.pathsep.join([str(shadow), *dirs])


@pytest.mark.parametrize("tool", ["ip", "tc"])
def test_refuses_without_tool(tool, tmp_path):
    result = cluster_sh("up", "2", env={**ENV, "PATH": _path_without(tool, tmp_path)})
    _one_line_refusal(result, f"'{tool}' not found")


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv to drop root")
def test_refuses_when_not_root():
    result = run_with_timeout(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                               str(CLUSTER_SH), "up", "2"], timeout=30, env=ENV)
    _one_line_refusal(result, "must run as root")


@pytest.mark.parametrize("args,fragment", [
    (["up", "2", "--rate", "100"], "bad --rate '100'"),
    (["up", "0"], "node count must be 1..250"),
    (["exec", "node1", "true"], "no node 'node1'"),
])
def test_refuses_bad_arguments(args, fragment):
    _one_line_refusal(cluster_sh(*args), fragment)


def test_delay_is_emulated_or_refused():
    """--delay needs netem; kernels without it (like the development VM) must say so
    rather than run without the delay."""
    result = cluster_sh("up", "2", "--rate", "100mbit", "--delay", "2ms")
    if result.returncode != 0:
        _one_line_refusal(result, "netem")
        assert leftovers() == []
        return
    qdiscs = subprocess.run(["tc", "-n", f"{PREFIX}node1", "qdisc", "show", "dev", "hvd0"],
                            capture_output=True, text=True, timeout=10).stdout
    assert "netem" in qdiscs and "delay 2ms" in qdiscs and "tbf" in qdiscs, qdiscs


def test_python_handle_tears_down_on_sigterm():
    """A benchmark stopped with SIGTERM (kill, a job timeout) inside `with Cluster(...)`
    leaves the block through its teardown, as after an exception."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(CLUSTER_DIR)!r})
        from cluster import Cluster
        with Cluster(2, prefix={PREFIX!r}):
            print("up", flush=True)
            time.sleep(60)
        """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert proc.stdout.readline().strip() == "up"
        assert leftovers() != []
        proc.terminate()
        proc.wait(timeout=90)
        left = leftovers()  # before the clean-up below
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        cluster_sh("down")
    assert proc.returncode == 128 + signal.SIGTERM
    assert left == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_interrupted_run_leaves_nothing(sig, tmp_path):
    """TERM/INT: `run` tears down itself. KILL (a crash): namespaces and the job survive,
    and the next `up` stops the job and removes them."""
    # Output goes to a file, not a pipe: after a KILL the orphaned job still holds the
    # pipe open and reading it to EOF would wait for the job.
    log = tmp_path / "run.log"
    with log.open("w") as log_file:
        # SIGINT at its default disposition: a test runner started in the background (nohup,
        # `cmd &`) has it ignored, children inherit that, and bash cannot trap a signal that
        # was ignored when it started.
        run = subprocess.Popen([str(CLUSTER_SH), "run", "2", "--timeout", "60", "--", "sleep", "45"],
                               stdout=log_file, stderr=subprocess.STDOUT, env=ENV, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # Wait for the job itself: while `up` configures node1 its own commands run in there too.
        deadline = time.monotonic() + 20
        while not (Path(f"/run/netns/{PREFIX}node1").exists() and running_in("node1", b"sleep\x0045\x00")):
            assert run.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        job = pids_in("node1")
        run.send_signal(sig)
        run.wait(timeout=30)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    if sig == signal.SIGKILL:
        assert leftovers() != [] and pids_in("node1") == job   # the crash left the cluster up
        assert cluster_sh("up", "2").returncode == 0
        assert pids_in("node1") == []                        # the orphaned job was stopped
        assert cluster_sh("down").returncode == 0
    else:
        assert run.returncode == 128 + sig, log.read_text()
    assert leftovers() == []
    for pid in job:
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
