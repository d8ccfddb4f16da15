"""Which rank is unreachable: heartbeats through the data plane's rendezvous store.

When a collective fails or times out, the error a user gets from Gloo or Horovod says that a
receive timed out, not why. On a cluster the usual reasons are a cut or congested link and a
frozen worker (stopped, swapping, stuck in a driver), and the first thing to know is which
machine. Each rank of our Gloo channel (comm/gloo.py) runs a ``Heartbeat``: a daemon thread
that increments its counter in the channel's ``TCPStore`` (held by rank 0) every second, on a
connection of its own. ``diagnose()``, called only once something has failed, reads every
counter twice a few periods apart: a rank whose counter did not move is not responding (its
link is down or its process frozen); if rank 0's store itself does not answer, rank 0 is the
one this rank cannot reach. A few seconds, paid only on the way out.

A rank that has **exited** is not a frozen one, and the usual reason in a healthy cluster is
that ranks ran different numbers of steps: the rank with fewer steps finished and left while
the others wait for it in a collective. So at interpreter exit each rank leaves an exit
record in the store: the optimizer steps it completed (``step``, kept up to date by the
channel's ``note_step``) and the exception that ended it, if any. ``diagnose`` names an
exited rank as such ("rank 1 (host) has exited after 3 optimizer steps, while rank 0 waits
in its step 4"). Rank 0 holds the store, so its exit takes the store with it; a store that
refuses the connection at once (rather than not answering) means rank 0's process is gone,
and the diagnosis says so.

The cost in a healthy run is one small store message per rank per second. Every thread that
makes store calls (the beating threads, also of heartbeats closed when Horovod Elastic
re-formed the world, and ``diagnose``'s readers) is stopped and joined at interpreter exit
(``atexit``, at most ``STORE_TIMEOUT_S`` in all): a daemon thread still inside a store call
when Python finalizes is ended by a forced unwind through C++ frames, which aborts the
process ("terminate called without an active exception"). A call blocked on a link cut
during the run returns with an error once rank 0's store closes at its exit; the join gives
it that time.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import socket
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

log = logging.getLogger("accordion_hvd.comm")

PERIOD_S = 1.0       # seconds between a rank's heartbeats
STORE_TIMEOUT_S = 5  # how long one store message may take before the store counts as unreachable
_current: "Heartbeat | None" = None  # the live channel's heartbeat, for waits outside the channel
_running: "dict[Heartbeat, None]" = {}  # every heartbeat not closed yet, oldest first (for the exit)
_store_threads: "set[threading.Thread]" = set()  # every thread that may be inside a store call, for the exit


class Heartbeat:
    """Rank ``rank`` of ``size`` beating on the store at ``host:port`` (see module doc).

    The constructor is collective: every rank publishes its hostname and reads the others'.
    Two store connections, one per thread that uses one: a store call on a cut link blocks
    in ``recv`` until TCP gives up (many minutes; the store's own timeout does not bound it),
    so the beating thread may block forever, and ``diagnose`` reads from a helper thread it
    waits for at most ``STORE_TIMEOUT_S``.
    """

    def __init__(self, host: str, port: int, rank: int, size: int, period: float = PERIOD_S,
                 setup_timeout: float = 300.0) -> None:
        global _current
        self.rank, self.size, self.period = rank, size, period
        setup = datetime.timedelta(seconds=min(setup_timeout, 7 * 24 * 3600.0))
        self._beat_store = dist.TCPStore(host, port, size, is_master=False, timeout=setup)
        self._read_store = dist.TCPStore(host, port, size, is_master=False, timeout=setup)
        self._read_store.set(f"acc.host.{rank}", socket.gethostname())
        self.hosts = [self._read_store.get(f"acc.host.{r}").decode() for r in range(size)]  # waits for every rank
        for store in (self._beat_store, self._read_store):  # from now on a store that is slow counts as gone
            store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
        self._store_lost: str | None = None  # set once the store stopped answering: never read again
        self.step = 0  # optimizer steps this rank has completed (note_step), in its exit record
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"accordion-heartbeat-{rank}", daemon=True)
        _track(self._thread)
        _current = self
        _running[self] = None

    def _beat(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._beat_store.add(f"acc.alive.{self.rank}", 1)
            except Exception:  # noqa: BLE001 - the connection is broken for good; diagnose() says so
                return

    def announce_exit(self) -> None:
        """At interpreter exit: leave this rank's last step and the exception that ended the
        process (if one did) in the store, for a rank that is still waiting for this one. At
        most ``STORE_TIMEOUT_S`` (the store call runs on a helper thread, as in ``diagnose``)."""
        if self._store_lost is not None:
            return
        error = getattr(sys, "last_value", None)  # set by the interpreter for an uncaught exception
        record = json.dumps({"step": self.step, "error": None if error is None else
                             f"{type(error).__name__}: {str(error)[:200]}"})

        def write() -> None:
            try:
                self._read_store.set(f"acc.exit.{self.rank}", record)
            except Exception:  # noqa: BLE001 - the store is gone (rank 0 left first): nobody to tell
                pass

        writer = threading.Thread(target=write, name="accordion-liveness-exit", daemon=True)
        _track(writer)
        writer.join(STORE_TIMEOUT_S)

    def note_step(self, step: int) -> None:
        """The optimizer steps this rank has completed, published with its heartbeats."""
        self.step = step

    def close(self, wait: float = 0.0) -> None:
        """Stop beating; ``wait``: seconds to wait for the beating thread to end."""
        global _current
        self._stop.set()
        _running.pop(self, None)
        if _current is self:  # the newest heartbeat still beating is the live one again
            _current = next(reversed(_running), None)
        if wait:
            self._thread.join(wait)

    def _read(self, what) -> Any:
        """``what(store)`` on the read connection from a helper thread, or None if the store
        did not answer in time or refused (then it is never read again, see module doc)."""
        if self._store_lost is not None:
            return None
        found: list = []
        failed: list[Exception] = []

        def read() -> None:
            try:
                found.append(what(self._read_store))
            except Exception as exc:  # noqa: BLE001 - the store is unreachable or gone
                failed.append(exc)

        reader = threading.Thread(target=read, name="accordion-liveness-read", daemon=True)
        _track(reader)
        reader.join(STORE_TIMEOUT_S)
        if found:
            return found[0]
        where = f"unreachable from rank {self.rank}: rank 0 ({self.hosts[0]}), which holds the channel's store,"
        if failed:  # refused or reset at once: the process that held the store is gone
            self._store_lost = (f"{where} has exited (its store closed the connection): it finished its steps or "
                                f"stopped on an error (see its log); every rank must run the same number of "
                                f"optimizer steps")
        else:  # the reader may still be blocked on the connection
            self._store_lost = (f"{where} did not answer within {STORE_TIMEOUT_S} s (its link is down or its process "
                                f"frozen)")
        return None

    def _counters(self) -> list[int] | None:
        """Every rank's heartbeat count, or None if the store did not answer in time."""
        return self._read(lambda store: [store.add(f"acc.alive.{r}", 0) for r in range(self.size)])

    def _exits(self, ranks: list[int]) -> dict[int, dict] | None:
        """The exit records of those of ``ranks`` that have exited (see ``announce_exit``)."""
        def read(store) -> dict[int, dict]:
            return {r: json.loads(store.get(f"acc.exit.{r}")) for r in ranks if store.check([f"acc.exit.{r}"])}
        return self._read(read)

    def diagnose(self) -> str:
        """One sentence: which ranks have exited or are not responding, as seen from this rank."""
        before = self._counters()
        if before is not None:
            time.sleep(2.5 * self.period)
            after = self._counters()
        if before is None or after is None:
            return self._store_lost or ""
        silent = [r for r in range(self.size) if r != self.rank and after[r] == before[r]]
        if not silent:
            return f"every rank's heartbeat still arrives (seen from rank {self.rank}): a link is slow, not cut"
        exits = self._exits(silent) or {}
        parts = []
        for r, record in sorted(exits.items()):
            how = "has exited" if record.get("error") is None else f"exited on an error ({record['error']})"
            parts.append(f"rank {r} ({self.hosts[r]}) {how} after {record.get('step')} optimizer steps, while rank "
                         f"{self.rank} waits in its step {self.step + 1}")
        if exits and all(record.get("error") is None for record in exits.values()):
            parts[-1] += ": ranks ran different numbers of steps; every rank must run the same number of optimizer steps"
        frozen = [r for r in silent if r not in exits]
        if frozen:
            who = ", ".join(f"rank {r} ({self.hosts[r]})" for r in frozen)
            parts.append(f"not responding (seen from rank {self.rank}): {who}: no heartbeat for "
                         f"{2.5 * self.period:g} s (its link is down or its process frozen)")
        return "; ".join(parts)


def _track(thread: threading.Thread) -> None:
    """Start a thread that makes store calls, remembered for the exit (finished ones forgotten)."""
    for done in [t for t in _store_threads if not t.is_alive()]:
        _store_threads.discard(done)
    _store_threads.add(thread)
    thread.start()


@atexit.register
def _stop_at_exit() -> None:
    for heartbeat in list(_running):
        heartbeat.close()
        heartbeat.announce_exit()
    deadline = time.monotonic() + STORE_TIMEOUT_S
    for thread in list(_store_threads):
        thread.join(max(0.0, deadline - time.monotonic()))


def diagnose() -> str:
    """The live channel's diagnosis, or "" when there is none (no Gloo channel yet)."""
    heartbeat = _current
    if heartbeat is None:
        return ""
    try:
        return heartbeat.diagnose()
    except Exception as exc:  # noqa: BLE001 - a diagnosis must never hide the error it explains
        log.debug("liveness diagnosis failed: %s", exc)
        return ""
