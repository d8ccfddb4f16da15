"""comm/liveness.py in one process: two ranks' heartbeats on a real TCPStore, one of which stops
beating (a frozen worker, a cut link) or loses the store (rank 0 gone). The same diagnosis is
checked across emulated nodes, with real faults, in tests/test_network_faults.py."""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from accordion_hvd.comm import liveness
from accordion_hvd.comm.channel import CollectiveTimeout, HorovodInternalError, collective_timeout_error


def store():
    return dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=datetime.timedelta(seconds=10),
                         wait_for_workers=False)


def pair(master, period=0.2):
    """Rank 0's and rank 1's heartbeats (the constructor is collective: build them together)."""
    import threading
    beats = {}

    def make(rank):
        beats[rank] = liveness.Heartbeat("127.0.0.1", master.port, rank, 2, period=period)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return beats[0], beats[1]


def test_a_rank_that_stops_beating_is_named():
    master = store()
    rank0, rank1 = pair(master)
    try:
        time.sleep(0.5)
        assert "still arrives" in rank0.diagnose()  # both beat: a slow link, not a dead one
        rank1.close()  # rank 1 stops beating, as a frozen process or a cut link would
        time.sleep(0.3)
        why = rank0.diagnose()
        assert why.startswith("not responding (seen from rank 0): rank 1 ("), why
        assert rank0.hosts == rank1.hosts and len(rank0.hosts) == 2
    finally:
        rank0.close()
        rank1.close()


def test_a_rank_that_exited_is_named_as_exited_with_its_steps_not_as_frozen():
    """Ranks that ran different numbers of steps: the one that finished first exited normally."""
    master = store()
    rank0, rank1 = pair(master)
    try:
        rank0.step, rank1.step = 3, 3
        rank1.close()
        rank1.announce_exit()  # what its interpreter exit does
        time.sleep(0.3)
        why = rank0.diagnose()
        assert why.startswith("rank 1 (") and "has exited after 3 optimizer steps, while rank 0 waits in its step 4" \
            in why and "ranks ran different numbers of steps" in why, why
        assert "frozen" not in why
    finally:
        rank0.close()
        rank1.close()


def test_rank_0_gone_with_its_store_is_named_as_exited():
    master = store()
    rank0, rank1 = pair(master)
    rank0.close()
    del master  # rank 0's process, which holds the store, exited: the connection is refused at once
    why = rank1.diagnose()
    assert why.startswith("unreachable from rank 1: rank 0 (") and "has exited" in why, why
    rank1.close()


def test_a_lost_store_names_rank_0_within_the_store_timeout():
    master = store()
    rank0, rank1 = pair(master)
    rank0.close()
    del master  # rank 0's process (which holds the store) is gone
    started = time.monotonic()
    why = rank1.diagnose()
    assert time.monotonic() - started < liveness.STORE_TIMEOUT_S + 3
    assert why.startswith("unreachable from rank 1: rank 0 ("), why
    assert rank1.diagnose() == why  # the broken connection is never used again
    rank1.close()


def test_the_timeout_error_carries_the_diagnosis_and_is_horovods_kind():
    master = store()
    rank0, rank1 = pair(master)
    try:
        rank1.close()
        time.sleep(0.3)
        liveness._current = rank0  # the live channel's heartbeat, as comm/gloo.py leaves it
        error = collective_timeout_error("acc.P.b0.4", 0, 2, 20.0)
        assert isinstance(error, CollectiveTimeout) and isinstance(error, TimeoutError)
        assert isinstance(error, HorovodInternalError)  # Horovod Elastic restores on it
        assert "collective 'acc.P.b0.4' did not complete within 20 s on rank 0" in str(error)
        assert "not responding (seen from rank 0): rank 1 (" in str(error)
    finally:
        rank0.close()
        rank1.close()
    assert liveness.diagnose() == ""  # no live heartbeat: nothing to add


def test_closing_the_live_heartbeat_makes_the_one_before_it_live_again():
    """A channel built after another (a check, a re-formed world) and then closed or dropped
    leaves the earlier one's heartbeat as the one waits outside a channel diagnose with
    (GlooChannel closes its heartbeat when it is collected)."""
    first_master, second_master = store(), store()
    first = pair(first_master)
    second = pair(second_master)
    try:  # (a pair's two heartbeats are made on two threads: either may be the newer)
        assert liveness._current in second
        for heartbeat in second:
            heartbeat.close()
        live = liveness._current
        assert live in first
        live.close()
        assert liveness._current in first and liveness._current is not live
        liveness._current.close()
        assert liveness._current is None
    finally:
        for heartbeat in (*first, *second):
            heartbeat.close()
