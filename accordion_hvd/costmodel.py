"""A model of one training step's time: compute, codec kernels and alpha-beta collectives.

Pure Python, no torch: it answers "how long would a step take with these layers at these
levels on this network?", for a policy that picks levels by predicted step time (issue
"a policy that never loses") and for predicting scale-out beyond the machines we have.

**Collectives** (``collective_s``) follow the alpha-beta model: a message costs ``alpha``
seconds of latency plus ``beta`` seconds per byte. Over ``p`` ranks a ring allreduce of
``n`` bytes sends ``2 (p - 1)`` messages of ``n / p`` bytes each way (Gloo's and NCCL's
large-message algorithm); an allgather of ``n`` bytes from each rank, ``p - 1`` messages of
``n`` bytes. Both are linear in (alpha, beta), so each observed collective gives one row
of a least-squares problem; ``LinkFit`` keeps its sufficient statistics (five sums and a count), which
ranks can sum over the control plane so that every rank fits the same link.

**A step** (``step_s``) is simulated with two resources, as the exchange runs it
(accordion_hvd/exchange/): the main thread (forward, backward, the codec's kernels, the
compressor's hooks) and the network (one collective at a time, in issue order). Backward
makes each bucket's gradients ready at a known point; the hook that completes a bucket
encodes it and issues its first round; a bucket's later rounds (PowerSGD's Q) are prepared
and issued by the first hook that finds the round before them finished, or by the last hook
(which waits for them, bucket by bucket); then each bucket's last round is waited for, in
order, and decoded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ALGORITHMS = ("allreduce", "allgather")
_TIMER_RESOLUTION_S = 1e-6  # a timing's floor in the fit's weights (a zero timing is allowed)


def _finite_non_negative(value: float, what: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return float(value)


def _world(world: int) -> int:
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    return world


def coefficients(kind: str, nbytes: float, world: int) -> tuple[float, float]:
    """(messages, bytes on the critical path) of one collective: its time is
    ``messages * alpha + bytes * beta``. ``nbytes``: the allreduce's buffer, or what each
    rank contributes to an allgather."""
    nbytes, p = _finite_non_negative(nbytes, "nbytes"), _world(world)
    if kind == "allreduce":  # ring: reduce-scatter then allgather, each p - 1 steps of n / p
        return 2.0 * (p - 1), 2.0 * (p - 1) / p * nbytes
    if kind == "allgather":  # ring: p - 1 steps of n
        return float(p - 1), (p - 1) * nbytes
    raise ValueError(f"kind must be one of {ALGORITHMS}, got {kind!r}")


@dataclass(frozen=True)
class Link:
    """A network as the alpha-beta model sees it: ``alpha`` seconds per message, ``beta``
    seconds per byte (1 / bandwidth)."""
    alpha: float
    beta: float

    def __post_init__(self):
        _finite_non_negative(self.alpha, "Link.alpha")
        _finite_non_negative(self.beta, "Link.beta")

    @classmethod
    def from_rate(cls, bits_per_s: float, latency_s: float = 0.0) -> "Link":
        if not isinstance(bits_per_s, (int, float)) or not math.isfinite(bits_per_s) or bits_per_s <= 0:
            raise ValueError(f"bits_per_s must be a finite number > 0, got {bits_per_s!r}")
        return cls(alpha=latency_s, beta=8.0 / bits_per_s)

    def collective_s(self, kind: str, nbytes: float, world: int) -> float:
        messages, path_bytes = coefficients(kind, nbytes, world)
        return messages * self.alpha + path_bytes * self.beta


class LinkFit:
    """Weighted least-squares alpha and beta from observed collectives.

    ``observe`` adds one collective (its kind, size, world and measured seconds), weighted
    so that the fit minimizes the relative error of the predicted times; a timing
    that is negative, not finite, or of an empty world is refused with the reason, and
    changes nothing. ``stats`` are the five sums of the normal equations and the count: add several
    ranks' (or windows') stats element-wise and ``from_stats`` fits the sum, so that ranks
    that allreduce their stats hold the same link. ``link`` is None until the observations
    determine one: at least two sizes (one size cannot separate latency from bandwidth),
    and a positive beta (a measured bandwidth of zero or infinity is not a link).
    """

    def __init__(self):
        self.aa = self.ab = self.bb = self.at = self.bt = 0.0  # sums of a*a, a*b, b*b, a*t, b*t
        self.count = 0

    def observe(self, kind: str, nbytes: float, world: int, seconds: float) -> str | None:
        """Add one collective; returns None, or why it was refused."""
        try:
            a, b = coefficients(kind, nbytes, world)
            t = _finite_non_negative(seconds, "seconds")
        except ValueError as e:
            return str(e)
        if a == 0.0 and b == 0.0:
            return "a collective over one rank moves nothing"
        # Relative error is what is minimized: timings' noise grows with their size, and a
        # plain fit would let the large messages decide the latency too.
        w = 1.0 / (t + _TIMER_RESOLUTION_S) ** 2
        self.aa += w * a * a
        self.ab += w * a * b
        self.bb += w * b * b
        self.at += w * a * t
        self.bt += w * b * t
        self.count += 1
        return None

    def stats(self) -> list[float]:
        return [self.aa, self.ab, self.bb, self.at, self.bt, float(self.count)]

    @classmethod
    def from_stats(cls, stats) -> "LinkFit":
        values = [float(v) for v in stats]
        if len(values) != 6 or not all(math.isfinite(v) for v in values):
            raise ValueError(f"LinkFit stats must be 6 finite numbers, got {stats!r}")
        fit = cls()
        fit.aa, fit.ab, fit.bb, fit.at, fit.bt, count = values
        fit.count = int(count)
        return fit

    def link(self) -> Link | None:
        det = self.aa * self.bb - self.ab * self.ab
        if self.count < 2 or det <= 1e-12 * self.aa * self.bb:
            return None
        alpha = (self.bb * self.at - self.ab * self.bt) / det
        beta = (self.aa * self.bt - self.ab * self.at) / det
        if alpha < 0:  # latency below what the data resolves: fit bandwidth alone
            alpha, beta = 0.0, self.bt / self.bb
        if not (math.isfinite(beta) and beta > 0):
            return None
        return Link(alpha=alpha, beta=beta)


@dataclass
class Round:
    """One collective of a bucket: ``prepare_s`` of main-thread work before it can be issued
    (encoding for the first round; PowerSGD's orthogonalization and Q for the second)."""
    kind: str
    nbytes: float
    prepare_s: float = 0.0

    def __post_init__(self):
        coefficients(self.kind, self.nbytes, 1)  # validates kind and size
        _finite_non_negative(self.prepare_s, "Round.prepare_s")


@dataclass
class Bucket:
    """A bucket of layers: ``ready_s`` seconds into backward its last gradient is ready; its
    ``rounds`` in order; ``finish_s`` of decoding once its last round is back."""
    ready_s: float
    rounds: list[Round] = field(default_factory=list)
    finish_s: float = 0.0

    def __post_init__(self):
        _finite_non_negative(self.ready_s, "Bucket.ready_s")
        _finite_non_negative(self.finish_s, "Bucket.finish_s")


def step_s(forward_s: float, backward_s: float, buckets: list[Bucket], link: Link, world: int,
           optimizer_s: float = 0.0) -> float:
    """Predicted seconds of one step (see module doc). Buckets are given in ready order."""
    forward_s = _finite_non_negative(forward_s, "forward_s")
    backward_s = _finite_non_negative(backward_s, "backward_s")
    optimizer_s = _finite_non_negative(optimizer_s, "optimizer_s")
    world = _world(world)
    if any(b.ready_s > backward_s for b in buckets):
        raise ValueError("a bucket's ready_s is after the end of backward_s")
    if any(later.ready_s < earlier.ready_s for earlier, later in zip(buckets, buckets[1:])):
        raise ValueError("buckets must be given in ready order (ready_s not decreasing)")
    network_free = 0.0
    next_round = [0] * len(buckets)       # index of each bucket's next round to issue
    round_end = [math.nan] * len(buckets)  # when each bucket's last issued round is back

    def issue(i: int, now: float) -> float:
        """Prepare and issue bucket i's next round on the main thread at ``now``."""
        nonlocal network_free
        r = buckets[i].rounds[next_round[i]]
        now += r.prepare_s
        start = max(now, network_free)
        network_free = round_end[i] = start + link.collective_s(r.kind, r.nbytes, world)
        next_round[i] += 1
        return now

    def poll(now: float, upto: int) -> float:
        """What a hook does: issue the next round of every bucket whose round is back."""
        for j in range(upto):
            while 0 < next_round[j] < len(buckets[j].rounds) and round_end[j] <= now:
                now = issue(j, now)
        return now

    now, done_backward = forward_s, 0.0
    for i, bucket in enumerate(buckets):
        now += bucket.ready_s - done_backward
        done_backward = bucket.ready_s
        now = poll(now, i)
        if bucket.rounds:
            now = issue(i, now)
    now += backward_s - done_backward
    for i, bucket in enumerate(buckets):  # the last hook: each bucket's remaining rounds issued in turn
        while next_round[i] < len(bucket.rounds):
            now = issue(i, max(now, round_end[i]))
    for i, bucket in enumerate(buckets):  # the first decompress: each bucket waited for and decoded
        if bucket.rounds:
            now = max(now, round_end[i])
        now += bucket.finish_s
    return now + optimizer_s
