"""The link measured from the data plane's own timings (accordion_hvd/comm/link.py): the
agreement on a window, the minimum over ranks, the fit, and the windows that determine no
link. On the simulated world, with timed channels whose timings the test writes; the real
Gloo channel's timings are checked here on one rank and under horovodrun by
tests/workers/gloo_channel_check.py."""

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from accordion_hvd.comm import SimulatedWorld
from accordion_hvd.comm.control import SimulatedControlPlane
from accordion_hvd.comm.link import measure_link
from accordion_hvd.comm.process_group import ProcessGroupChannel, Timing
from accordion_hvd.costmodel import Link

TRUE = Link(alpha=200e-6, beta=8 / 100e6)  # 200 us per message, 100 Mbit/s


class TimedChannel:
    """The timing part of a data plane: what measure_link reads."""

    def __init__(self, size: int, timings: list[Timing]) -> None:
        self.size, self._timings = size, list(timings)
        self.lane_names = ["main", "q"]

    def timings(self):
        return list(self._timings)

    def forget_timings(self, through):
        self._timings = [t for t in self._timings if t.seq > through.get(t.lane, 0)]


def collectives(size, delays, done=None):
    """Timings of a fixed sequence of collectives on two lanes, as rank-local records: each
    takes the true link's time plus this rank's ``delays[i]`` (waiting for a slower rank)."""
    plan = [("main", "allreduce", 4096), ("main", "allreduce", 1 << 20), ("q", "allreduce", 65536),
            ("main", "allgather", 8192), ("q", "allreduce", 1 << 22), ("main", "allreduce", 1 << 16)]
    out, seq = [], {"main": 0, "q": 0}
    for i, (lane, kind, nbytes) in enumerate(plan):
        seq[lane] += 1
        issued = 10.0 * i
        finished = issued + TRUE.collective_s(kind, nbytes, size) + delays[i]
        out.append(Timing(lane, seq[lane], f"c{i}", kind, nbytes, issued,
                          finished if done is None or done[i] else None))
    return out


def run(world_size, timings_of, calls=1):
    world = SimulatedWorld(world_size, timeout=10)

    def rank_fn(rank, _):
        channel, control = TimedChannel(world_size, timings_of(rank)), SimulatedControlPlane(world, rank)
        return [measure_link(channel, control) for _ in range(calls)], channel

    return world.run(rank_fn)


def test_the_minimum_over_ranks_recovers_the_link_on_every_rank():
    # Rank 1 waits for rank 0 on some collectives, rank 0 for rank 1 on others: only the
    # minimum over ranks is the transfer, and the fit to it is the true link.
    waits = {0: [0, 0.3, 0, 0.05, 0, 0], 1: [0.2, 0, 0.1, 0, 0, 0.4]}
    results = run(2, lambda rank: collectives(2, waits[rank]))
    links = [measured[0].link for measured, _ in results]
    assert links[0] == links[1]  # bit for bit
    assert links[0].alpha == pytest.approx(TRUE.alpha, rel=1e-6)
    assert links[0].beta == pytest.approx(TRUE.beta, rel=1e-6)
    assert results[0][0][0].collectives == 6 and results[0][0][0].refused == 0


def test_a_collective_not_yet_stamped_on_one_rank_waits_for_the_next_window():
    # Rank 1's callback has not stamped main's last collective yet: main's window ends
    # before it on every rank, and it stays for the next measurement.
    done = [True, True, True, True, True, False]
    results = run(3, lambda rank: collectives(3, [0] * 6, done if rank == 1 else None), calls=1)
    for measured, channel in results:
        assert measured[0].collectives == 5
        assert [t.name for t in channel.timings()] == ["c5"]


def test_windows_that_determine_no_link_say_why():
    empty = run(2, lambda rank: [])
    assert all(m[0].link is None and "no collective" in m[0].reason for m, _ in empty)
    one_size = run(2, lambda rank: [Timing("main", i + 1, "c", "allreduce", 4096, 0.0, 0.01) for i in range(4)])
    assert all(m[0].link is None and "1 size" in m[0].reason for m, _ in one_size)
    # Nothing measured twice: the second call of a window finds nothing new.
    twice = run(2, lambda rank: collectives(2, [0] * 6), calls=2)
    assert all(m[0].link is not None and m[1].link is None and m[1].collectives == 0 for m, _ in twice)


def test_bad_timings_are_refused_and_counted_never_raised():
    # A clock that went backwards (done before issued) on every rank: that timing is refused.
    def timings(rank):
        out = collectives(2, [0] * 6)
        out[2].done = out[2].issued - 1.0
        return out

    measured = run(2, timings)[0][0][0]
    assert measured.refused == 1 and measured.collectives == 6
    assert measured.link is not None


def test_a_data_plane_without_timings_has_no_link():
    world = SimulatedWorld(2)
    results = world.run(lambda rank, channel: measure_link(channel, SimulatedControlPlane(world, rank)))
    assert all(r.link is None and "does not time" in r.reason for r in results)


def test_the_gloo_channel_times_its_collectives_on_every_lane():
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=10)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    store = dist.HashStore()
    group = lambda prefix: dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), 0, 1, options)  # noqa: E731
    channel = ProcessGroupChannel(group("main"), 0, 1, 10.0, lanes={"q": group("q")})
    assert channel.lane_names == ["main", "q"]
    channel.wait(channel.allreduce_mean_async([torch.ones(1000)], name="a"))
    channel.wait(channel.lane("q").allreduce_mean_async([torch.ones(10)], name="b"))
    channel.wait(channel.allgather_async(torch.ones(3, dtype=torch.int32), name="c"))
    deadline = time.monotonic() + 5
    while any(t.done is None for t in channel.timings()) and time.monotonic() < deadline:
        time.sleep(0.01)
    got = [(t.lane, t.seq, t.name, t.kind, t.nbytes) for t in channel.timings()]
    assert got == [("main", 1, "a", "allreduce", 4000), ("q", 1, "b", "allreduce", 40),
                   ("main", 2, "c", "allgather", 12)]
    assert all(t.done >= t.issued for t in channel.timings())
    channel.forget_timings({"main": 1})
    assert [t.name for t in channel.timings()] == ["b", "c"]


def test_the_compressor_keeps_its_last_link_and_says_why_a_window_has_none():
    import accordion_hvd as acc

    def worker(rank, channel):
        comp = acc.AccordionCompressor(acc.PowerSGD(rank=1), channel=channel)
        out, ctx = comp.compress_named("w", torch.randn(8, 8))
        comp.decompress(out, ctx)
        return comp.measure_link(), comp.stats()["link"]

    for measured, reported in SimulatedWorld(2).run(worker):
        assert measured.link is None and "does not time" in measured.reason
        assert reported is None
