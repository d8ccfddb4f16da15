"""Faults on the emulated cluster's wire (benchmarks/cluster/faults.py): a slowed link, a cut
link, a frozen worker, under plain horovodrun and under Horovod Elastic.

What a user relies on: a slow link slows training and nothing else; a link that stays down, or
a worker that stops answering, ends every rank within the collective timeout (plus Horovod's
own, plus a few seconds) with an error naming the collective and the rank that is gone, never a
hang; under Elastic the job goes on from its last commit, with nothing of that commit lost.
The measured version, with more runs, is `benchmarks/reliability.py --only network`.

Needs root and network namespaces (skipped otherwise, like tests/test_cluster.py).
"""

from __future__ import annotations

import re
import sys

import pytest

from test_cluster import PREFIX, REPO, Cluster, _SKIP_REASON, always_torn_down  # noqa: F401 (autouse fixture)

sys.path.insert(0, str(REPO / "benchmarks" / "cluster"))
from faults import Fault, rows_in, run_with_fault  # noqa: E402

pytestmark = [pytest.mark.skipif(_SKIP_REASON is not None, reason=f"emulated cluster: {_SKIP_REASON}"),
              pytest.mark.horovod]

TIMEOUT = 15  # ACCORDION_COLLECTIVE_TIMEOUT here; Horovod's own Gloo timeout stays at its 30 s
BOUND = 30 + 12  # the larger timeout, the diagnosis (2.5-5 s) and the exit
CLI = ["-m", "accordion_hvd.train", "--no-progress", "--codec", "powersgd", "--rank", "1", "--critical-rank", "4"]


def cli_with_fault(tmp_path, fault: Fault, epochs: int):
    steps = tmp_path / "steps.csv"
    with Cluster(2, rate="1gbit", prefix=PREFIX) as cluster:
        return run_with_fault(cluster, [*CLI, "--epochs", str(epochs), "--logdir", str(tmp_path)], fault,
                              ready=lambda: rows_in(steps) >= 30, progress=lambda: rows_in(steps),
                              timeout=240, marker="accordion_hvd.train",
                              env={"ACCORDION_COLLECTIVE_TIMEOUT": str(TIMEOUT)})


def test_a_slowed_link_slows_training_and_nothing_else(tmp_path):
    """node2's link at 1/100 of its rate for 15 s: no timeout, no error, and steps go on after."""
    run = cli_with_fault(tmp_path, Fault("slow", "node2", hold=15, rate="10mbit"), epochs=80)
    output = run.stdout + run.stderr
    assert run.fault_at is not None and run.undone_at is not None, output
    assert run.returncode == 0, output
    assert run.rank_errors() == {}, output
    during, after = run.progress
    assert rows_in(tmp_path / "steps.csv") > after > during, (run.progress, output[-3000:])


def test_a_cut_link_stops_every_rank_naming_the_one_it_lost(tmp_path):
    """node2's switch port down for 60 s (silently dropped frames, as with a pulled cable):
    both ranks stop well before the link returns, each blaming the other by rank and host."""
    run = cli_with_fault(tmp_path, Fault("cut", "node2", hold=60), epochs=400)
    output = run.stdout + run.stderr
    assert run.returncode not in (0, None), output
    assert run.after_fault is not None and run.after_fault <= BOUND, (run.after_fault, output[-3000:])
    errors = run.rank_errors()
    assert set(errors) == {0, 1}, output[-3000:]
    assert all("collective" in e for e in errors.values()), errors
    assert re.search(r"not responding \(seen from rank 0\): rank 1 \(node2\)", errors[0]), errors[0]
    assert re.search(r"unreachable from rank 1: rank 0 \(node1\)", errors[1]), errors[1]


def test_a_frozen_worker_is_named_by_the_others(tmp_path):
    """node2's worker stopped (SIGSTOP): rank 0 stops within the bound, naming rank 1. The
    worker is let go once rank 0 has ended (else the job waits for it), at BOUND + 5 s at most."""
    run = cli_with_fault(tmp_path, Fault("freeze", "node2", hold=BOUND + 5, until_others_end=True), epochs=400)
    output = run.stdout + run.stderr
    assert run.returncode not in (0, None), output
    errors = run.rank_errors()
    assert 0 in errors and "collective" in errors[0], output[-3000:]
    assert re.search(r"not responding \(seen from rank 0\): rank 1 \(node2\)", errors[0]), errors[0]


@pytest.mark.parametrize("kind", ["cut", "freeze"])
def test_elastic_resumes_from_the_last_commit_with_nothing_lost(kind, tmp_path):
    """Under Horovod Elastic the ranks restore their last commit and the world is re-formed
    (without node2 while it is away; it comes back after the blacklist cooldown). Every recovered rank's parameters,
    momentum, error feedback, warm-start Q, levels, controller and policy state, counters and
    step equal its digest of the last commit, and every rank ends with the same state."""
    mark = tmp_path / "mark"
    with Cluster(2, rate="1gbit", prefix=PREFIX) as cluster:
        cluster.set_hosts(["node1:1", "node2:1"])
        run = run_with_fault(
            cluster, [str(REPO / "benchmarks" / "elastic_train.py"), "--epochs", "8", "--lr-milestones", "6",
                      "--step-seconds", "0.03", "--mark-at", "40", "--mark-file", str(mark), "--pid-dir", str(tmp_path)],
            Fault(kind, "node2", hold=35), ready=mark.exists, timeout=420, marker="elastic_train.py",
            np=2, elastic=True, env={"ACCORDION_COLLECTIVE_TIMEOUT": str(TIMEOUT)},
            extra=["--blacklist-cooldown-range", "5", "10"])
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    final = re.search(r"final test accuracy: ([0-9.]+); world sizes (\[.*?\]); steps \d+; ranks agree: True; "
                      r"recoveries checked: (\d+); pieces compared: (\d+); state mismatches: 0", output)
    assert final, output[-4000:]
    assert int(final.group(3)) >= 1 and int(final.group(4)) >= 15, final.group(0)
    # The world was re-formed: at size 1 while node2 was away ([2, 1, 2]), or, when node2's
    # worker reached the rendezvous as soon as its link was back, at size 2 again ([2, 2]).
    assert re.fullmatch(r"\[2(, [12])+\]", final.group(2)), final.group(0)
    assert float(final.group(1)) > 0.85, final.group(0)
