"""The network as the exchange's own collectives measured it, the same on every rank.

The data plane times every collective it runs (comm/process_group.py: from issue to the
moment its worker thread completes it). ``measure_link`` turns the collectives completed
since the last call into an alpha-beta ``Link`` (accordion_hvd/costmodel.py) that every rank
holds bit for bit, at the cost of two small control-plane reductions and no extra traffic
on the data plane:

1. The ranks agree on the window: per lane, the range of collectives every rank has
   completed (two floats per lane). A collective's callback may still be running on one
   rank when another has stamped it; it counts in the next window.
2. A collective's duration is the **minimum over ranks** of its issue-to-completion time
   (one float per collective, plus its size, checked equal on every rank). A collective
   completes on every rank at about the same moment, once the last rank has issued it: the
   rank that issued it last waited for the transfer only, the others for that rank's
   backward too. Clocks of different machines are never compared.
3. A weighted least-squares fit of alpha (per message) and beta (per byte) to those
   durations, with each collective's algorithm (ring allreduce, ring allgather) and the
   world size (``costmodel.LinkFit``): the same numbers on every rank give the same link.

Collectives in flight on two lanes at once share the link, so their durations overstate
it; the fit minimizes relative error, and the PowerSGD exchange's P and Q rounds rarely
overlap for long (a bucket's Q round starts after its P round is back). A window that does
not determine a link (no collective in it, a single message size, a bandwidth of zero or
infinity) gives None and says why.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from ..costmodel import Link, LinkFit

log = logging.getLogger("accordion_hvd.comm")
_NONE = 2.0 ** 53  # "no collective on this lane" in the window agreement (an exact float64)


@dataclass(frozen=True)
class LinkMeasurement:
    """What one window measured: the fitted ``link`` (None when the window did not determine
    one, then ``reason`` says why), from ``collectives`` timed collectives; ``refused``
    of them had a timing the fit does not accept."""
    link: Link | None
    collectives: int
    refused: int = 0
    reason: str | None = None


def measure_link(channel, control, name: str = "acc.link") -> LinkMeasurement:
    """A collective of the control plane: every rank calls it at the same point (between
    steps), with its data plane ``channel`` and ``control`` plane (see module doc)."""
    if not hasattr(channel, "timings"):
        return LinkMeasurement(None, 0, reason=f"the data plane ({type(channel).__name__}) does not time "
                                               f"its collectives")
    lanes = channel.lane_names
    by_lane: dict[str, dict[int, object]] = {lane: {} for lane in lanes}
    for t in channel.timings():
        by_lane.setdefault(t.lane, {})[t.seq] = t
    first, last = [], []
    for lane in lanes:  # this rank's completed range per lane: from its oldest kept one to the last done in a row
        seqs = sorted(by_lane[lane])
        lo = seqs[0] if seqs else _NONE
        hi = lo - 1
        while hi + 1 in by_lane[lane] and by_lane[lane][hi + 1].done is not None:
            hi += 1
        first.append(float(lo))
        last.append(float(hi if seqs else 0))
    agreed = control.allreduce(first + [-h for h in last], name=f"{name}.window.{len(lanes)}", op="max")
    ranges = {lane: (int(agreed[i]), int(-agreed[len(lanes) + i])) for i, lane in enumerate(lanes)}
    window = [by_lane[lane][seq] for lane in lanes for seq in range(ranges[lane][0], ranges[lane][1] + 1)]
    channel.forget_timings({lane: hi for lane, (lo, hi) in ranges.items() if hi >= lo})
    if not window:
        return LinkMeasurement(None, 0, reason="no collective completed on every rank since the last measurement")
    local = [t.done - t.issued for t in window] + [float(t.nbytes) for t in window] + [-float(t.nbytes) for t in window]
    reduced = control.allreduce(local, name=f"{name}.durations.{len(window)}", op="min")
    n = len(window)
    seconds, low, high = reduced[:n], reduced[n:2 * n], -reduced[2 * n:]
    if any(lo != hi for lo, hi in zip(low, high)):
        # Ranks pair collectives by their order on a lane, so sizes always match: this is a bug.
        return LinkMeasurement(None, n, reason="the ranks' collectives differ in size in this window")
    fit = LinkFit()
    refused = 0
    for t, s, nbytes in zip(window, seconds, low):
        why = fit.observe(t.kind, nbytes, channel.size, float(s))
        refused += why is not None
    link = fit.link()
    if link is None:
        sizes = len({(t.kind, int(b)) for t, b in zip(window, low)})
        reason = (f"{n} collectives of {sizes} size{'s' if sizes != 1 else ''} do not determine a latency and a "
                  f"positive bandwidth" + (f" ({refused} timings refused)" if refused else ""))
        return LinkMeasurement(None, n, refused, reason)
    return LinkMeasurement(link, n, refused)


def describe(link: Link) -> str:
    """``link`` for a log line: latency per message and bandwidth."""
    rate = 8.0 / link.beta if link.beta > 0 else math.inf
    return f"{link.alpha * 1e6:.0f} us per message, {rate / 1e6:.1f} Mbit/s"
