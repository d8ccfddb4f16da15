"""Worker run by tests/test_exchange_horovod.py under horovodrun, on every rank.

Our Gloo data plane (accordion_hvd/comm/gloo.py) built over Horovod's world: a grouped
allreduce averages and keeps each tensor's shape, an allgather concatenates in rank order,
and a collective that only rank 0 issues ends in the channel's TimeoutError naming it (no
hang), within the timeout plus a few seconds; one whose peer has left, on any lane, Horovod's
error kind naming the collective and that rank. Every collective is timed, and the link fitted
to the timings (accordion_hvd/comm/link.py) has a positive bandwidth and is the same, bit
for bit, on every rank; a second measurement with nothing new in between finds no window.
"""

import time

import horovod.torch as hvd
import torch

from accordion_hvd.comm.control import control_plane
from accordion_hvd.comm.gloo import GlooChannel
from accordion_hvd.comm.link import measure_link
from worker_util import checker, say

hvd.init()
rank, size = hvd.rank(), hvd.size()
check = checker(rank)
channel = GlooChannel(timeout=3)
lasting = GlooChannel(timeout=60)  # for a peer that leaves: its error, not a timeout
check(channel.rank == rank and channel.size == size, "the group's ranks are not Horovod's")
a, b = channel.wait(channel.allreduce_mean_async([torch.full((2, 3), float(rank)), torch.full((4,), 2.0 * rank)],
                                                 name="mean"))
mean = sum(range(size)) / size
check(a.shape == (2, 3) and b.shape == (4,), f"shapes {a.shape}, {b.shape}")
check(torch.equal(a, torch.full((2, 3), mean)) and torch.equal(b, torch.full((4,), 2 * mean)), f"{a}, {b}")
gathered = channel.wait(channel.allgather_async(torch.tensor([rank, 10 * rank], dtype=torch.int32), name="gather"))
check(gathered.tolist() == [v for r in range(size) for v in (r, 10 * r)], f"gathered {gathered.tolist()}")
check(channel.issued == 2, f"issued {channel.issued}")

# The link, from collectives of several sizes on two lanes.
for floats in (256, 16384, 262144, 1048576):
    for lane in (channel, channel.lane("q")):
        channel.wait(lane.allreduce_mean_async([torch.ones(floats)], name=f"size.{floats}"))
time.sleep(0.2)  # the last completion's callback may still be stamping on the group's thread
timed = channel.timings()
check(len(timed) == 10 and all(t.done is not None and t.done >= t.issued for t in timed),
      f"timings {[(t.lane, t.seq, t.name, t.done) for t in timed]}")
control = control_plane()
measured = measure_link(channel, control)
check(measured.link is not None and measured.link.beta > 0 and measured.collectives == 10,
      f"measured {measured}")
everyone = hvd.allgather_object((measured.link.alpha, measured.link.beta), name="link.check")
check(all(v == everyone[0] for v in everyone), f"the ranks hold different links: {everyone}")
again = measure_link(channel, control)
check(again.link is None and again.collectives == 0 and "no collective" in again.reason, f"again {again}")
since = time.monotonic()
if rank == 0:
    start = time.monotonic()
    try:
        channel.wait(channel.allreduce_mean_async([torch.ones(4)], name="acc.lonely"))
        check(False, "a collective no other rank issued completed")
    except TimeoutError as exc:
        elapsed = time.monotonic() - start
        check("collective 'acc.lonely' did not complete within 3 s on rank 0" in str(exc), str(exc))
        check(elapsed < 15, f"took {elapsed:.1f} s")
    # Rank 1 leaves (below) while rank 0 waits on a lane: Horovod's error kind, naming the
    # collective and, from the heartbeat, the rank that has gone (what Elastic recovers from).
    try:
        lasting.wait(lasting.lane("q").allreduce_mean_async([torch.ones(4)], name="acc.left"))
        check(False, "a collective whose peer left completed")
    except Exception as exc:
        check(type(exc).__name__ == "HorovodInternalError" and "'acc.left'" in str(exc)
              and "rank 1 (" in str(exc), f"{type(exc).__name__}: {exc}")
    say(f"rank {rank}: OK gloo channel")
else:
    # A lane whose collective fails as it is issued (a tensor Gloo refuses): Horovod's error
    # kind, as on the channel itself (each lane is a view of the channel: it must hold all it needs).
    try:
        channel.lane("q").allreduce_mean_async([torch.ones(4, device="meta")], name="acc.refused")
        check(False, "a collective on the meta device was issued")
    except Exception as exc:
        check(type(exc).__name__ == "HorovodInternalError" and "'acc.refused'" in str(exc),
              f"{type(exc).__name__}: {exc}")
    say(f"rank {rank}: OK gloo channel")
    time.sleep(max(0.0, since + 6 - time.monotonic()))  # rank 1 outlives rank 0's timeout, then leaves
