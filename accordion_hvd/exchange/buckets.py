"""A step's first round of collectives, by buckets, as gradients arrive.

Horovod calls ``compress`` for each parameter as backward produces its gradient. Sending
each layer's round-1 payload on its own (PowerSGD's P, TopK's values and indices) costs one
collective per layer; waiting for the end of backward leaves the network idle while backward
runs. As DDP does, layers are grouped into **buckets** in the order their gradients become
ready, and a bucket's collective starts as soon as all its layers are encoded: one collective
per bucket, overlapping with the rest of backward. A codec's later rounds follow the same
buckets (PowerSGD's Q: exchange/powersgd.py).

The layout is agreed by all ranks, because ranks pair collectives by name (Horovod) or by
order (Gloo) and hooks fire in a different order on different ranks:

* at the end of the first step every rank allgathers its compressed layers (names, shapes)
  and the order in which they became ready; if the sets differ, **every rank** raises the
  same ``ValueError`` naming the layers that differ; otherwise rank 0's order is the order
  of the buckets (cut like DDP's: the first at 1 MiB of gradient, the others at 25 MiB, and
  the last 1 MiB of layers in a bucket of their own: ``plan_buckets``);
* a bucket is launched only when it is complete **and** every bucket before it has been
  launched, so every rank issues the same collectives in the same order whatever its hook
  order; a layer whose gradient comes late (Horovod fills in missing gradients in
  ``synchronize``) delays its bucket, never the pairing;
* a step whose layers differ from the agreed ones (a caller of ``compress_named`` that
  compresses a subset, a layer that first gets a gradient later) agrees again at the end
  of that step, if none of its buckets was sent yet; otherwise the rank that sees it raises
  an error naming the layer, and the other ranks' waits time out naming the bucket's
  collective and its layers. (Under Horovod's optimizer the set never changes: it
  zero-fills missing gradients.)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..comm.channel import Channel

FIRST_BUCKET_BYTES = 1 << 20   # DDP's defaults: a small first bucket starts the network early,
BUCKET_BYTES = 25 << 20        # then 25 MiB of gradient per bucket


def plan_buckets(order: list[str], nbytes: dict[str, int], first_cap: int = FIRST_BUCKET_BYTES,
                 cap: int = BUCKET_BYTES) -> list[tuple[str, ...]]:
    """Consecutive runs of ``order``, each closed once it holds ``cap`` bytes of gradient
    (``first_cap`` for the first), and the last layers, up to ``first_cap`` bytes of them, in
    a bucket of their own.

    Why a small last bucket too: what a step waits for after backward is the exchange of the
    last bucket (PowerSGD: its P round, then its Q round; TopK: its allgather), and that
    bucket's layers were ready over the last stretch of backward, which a 25 MiB bucket makes
    long (ResNet-18: its layer2 and layer3, 14 layers and 0.2 MB of rank-4 Q, sent after
    backward). Cut at its last ``first_cap`` bytes, the larger part goes out while the last
    layers' gradients are still being computed (the early layers of a CNN: few bytes, much
    compute), and what is left after backward is small: DDP's small first bucket, mirrored."""
    buckets, current, size = [], [], 0
    for name in order:
        current.append(name)
        size += nbytes[name]
        if size >= (first_cap if not buckets else cap):
            buckets.append(tuple(current))
            current, size = [], 0
    if current:
        buckets.append(tuple(current))
    if len(buckets) > 1:
        last, tail, size = buckets[-1], 0, 0
        while tail < len(last) and size + nbytes[last[-1 - tail]] <= first_cap:
            size += nbytes[last[-1 - tail]]
            tail += 1
        if 0 < tail < len(last):
            buckets[-1:] = [last[:-tail], last[-tail:]]
    return buckets


def agree_layout(channel: Channel, shapes: dict[str, tuple[int, ...]], order: list[str],
                 prefix: str = "acc", layers: str = "compressed") -> list[str]:
    """Every rank's layers in a round must be the same; returns rank 0's ready order.

    Two allgathers (a length, then every rank's layer list), named after the round
    (``prefix``): done once, not per step. ``layers`` says what the round carries
    ("compressed" or "uncompressed"), for the error message."""
    mine = json.dumps({"layers": sorted([n, list(s)] for n, s in shapes.items()), "order": order}).encode()
    lengths = channel.wait(channel.allgather_async(torch.tensor([len(mine)], dtype=torch.int64),
                                                   name=f"{prefix}.layout.size"))
    width = int(lengths.max())
    buffer = torch.zeros(width, dtype=torch.uint8)
    buffer[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    rows = channel.wait(channel.allgather_async(buffer, name=f"{prefix}.layout.{width}")).view(-1, width)
    layouts = [json.loads(bytes(row[:int(n)].tolist())) for row, n in zip(rows, lengths.tolist())]
    sets = [{n: tuple(s) for n, s in layout["layers"]} for layout in layouts]
    if any(s != sets[0] for s in sets):
        raise ValueError(_layout_mismatch_message(sets, layers))
    return layouts[0]["order"]


def _layout_mismatch_message(sets: list[dict], layers: str) -> str:
    missing = "not compressed" if layers == "compressed" else f"no {layers} layer of that name"
    names = sorted({n for s in sets for n in s})
    problems = []
    for n in names:
        seen = [s.get(n) for s in sets]
        if len(set(seen)) > 1:
            by_value: dict[str, list[int]] = {}
            for rank, shape in enumerate(seen):
                by_value.setdefault(missing if shape is None else f"shape {list(shape)}", []).append(rank)
            problems.append(f"{n!r}: " + " vs ".join(f"{v} on rank{'s' if len(r) > 1 else ''} "
                                                       f"{', '.join(map(str, r))}" for v, r in by_value.items()))
        if len(problems) == 5:
            problems.append("...")
            break
    what = "compress different layers" if layers == "compressed" else f"have different {layers} layers"
    return (f"AccordionCompressor: ranks {what} (every rank must build the same model "
            "and compute a gradient for the same parameters): " + "; ".join(problems) + ".")


DEFERRED = object()
"""A round-1 payload to be made when its bucket launches: ``Round1(encode=...)`` then encodes
the bucket's deferred layers in one call (a whole-bucket kernel) and returns their packed
payload: TopK's bytes, PowerSGD's P matrices."""


@dataclass
class _Bucket:
    names: tuple[str, ...]
    handle: Any = None
    sending: list[str] = field(default_factory=list)  # this step: the layers with a payload
    sizes: list[int] = field(default_factory=list)    # per layer sent: tensors (allreduce) or bytes (allgather)
    shapes: list | None = None  # a packed allreduce (every layer deferred): each layer's one tensor's shape
    packed: torch.Tensor | None = None  # its averaged flat payload, once taken


class Round1:
    """Round 1 of every step, by buckets (see module doc).

    ``kind`` "allreduce": each layer's payload is a list of tensors, averaged over ranks;
    the result of a layer is the list of averages. ``kind`` "allgather": each payload is a
    1-D uint8 tensor of the same length on every rank; the result is a (world size, length)
    uint8 view, one row per rank. A payload may be ``DEFERRED``: when its bucket launches,
    ``encode(names)`` makes the payloads of the bucket's deferred layers at once (one kernel
    call per bucket) and returns the packed payload and each layer's part of it: for an
    allgather ``(bytes, bytes per layer)`` (TopK), for an allreduce ``(flat tensor, shape per
    layer)``, each layer's payload then being the one tensor of that shape (PowerSGD's P). A
    bucket whose layers are all deferred sends the packed payload as it is, and its average
    stays available whole (``packed``).
    """

    def __init__(self, channel: Channel, kind: str, prefix: str, first_cap: int = FIRST_BUCKET_BYTES,
                 cap: int = BUCKET_BYTES, layers: str = "compressed", encode=None) -> None:
        if kind not in ("allreduce", "allgather"):
            raise ValueError(f"kind must be 'allreduce' or 'allgather', got {kind!r}")
        self.channel, self.kind, self.prefix, self.layers = channel, kind, prefix, layers
        self.encode = encode
        self.first_cap, self.cap = first_cap, cap
        self.buckets: list[_Bucket] | None = None  # the agreed layout, after the first step
        self._bucket_of: dict[str, int] = {}
        self.begin_step()

    def begin_step(self) -> None:
        self._payloads: dict[str, Any] = {}
        self._order: list[str] = []       # this step's ready order (the first step's is proposed)
        self._shapes: dict[str, tuple] = {}
        self._nbytes: dict[str, int] = {}
        self._launched = 0                # buckets launched this step, in layout order
        if self.buckets is not None:
            for b in self.buckets:
                b.handle, b.packed = None, None

    def ready(self, name: str, payload: Any, grad: torch.Tensor) -> None:
        """Layer ``name``'s payload for this step (``None``: the layer sends nothing in round 1
        this step, e.g. at a dense level); launches every bucket that is now complete, in order."""
        if self.buckets is not None and name not in self._bucket_of:
            if self._launched:
                raise ValueError(f"AccordionCompressor: layer {name!r} is not one of the {len(self._bucket_of)} "
                                 f"{self.layers} layers the ranks agreed on, and this step's first buckets are sent "
                                 f"already; every step must have the same {self.layers} layers")
            self.buckets = None  # nothing sent yet this step: agree on the layers again at its end
        self._payloads[name] = payload
        self._order.append(name)
        self._shapes[name] = tuple(grad.shape)
        self._nbytes[name] = grad.numel() * grad.element_size()
        if self.buckets is not None:
            self._launch_complete()

    def _launch_complete(self) -> None:
        while self._launched < len(self.buckets):
            bucket = self.buckets[self._launched]
            if not all(n in self._payloads for n in bucket.names):
                return
            self._launch(self._launched, bucket)
            self._launched += 1

    def _launch(self, index: int, bucket: _Bucket) -> None:
        sending = [n for n in bucket.names if self._payloads[n] is not None]
        bucket.sending = sending
        if not sending:  # every layer of the bucket is at a dense level this step (same on all ranks)
            bucket.handle = None
            return
        name = f"{self.prefix}.b{index}.{len(sending)}"
        payloads = [self._payloads[n] for n in sending]
        bucket.shapes, bucket.packed = None, None
        if self.kind == "allreduce":
            deferred = [n for n, p in zip(sending, payloads) if p is DEFERRED]
            if deferred and len(deferred) == len(sending):  # the usual case: send the packed payload as made
                made, bucket.shapes = self.encode(sending)
                bucket.sizes = [1] * len(sending)
                bucket.handle = self.channel.allreduce_mean_async([made], name=name)
                return
            if deferred:  # some layers encode one by one (float64, DENSE): slot the others in
                made, shapes = self.encode(deferred)
                parts = torch.split(made, [math.prod(s) for s in shapes])
                made_by_name = {n: [t.view(s)] for n, t, s in zip(deferred, parts, shapes)}
                payloads = [made_by_name[n] if p is DEFERRED else p for n, p in zip(sending, payloads)]
            bucket.sizes = [len(p) for p in payloads]
            bucket.handle = self.channel.allreduce_mean_async([t for p in payloads for t in p], name=name)
        else:
            deferred = [n for n, p in zip(sending, payloads) if p is DEFERRED]
            if deferred and len(deferred) == len(sending):  # the usual case: the encoder packs the bucket
                packed, bucket.sizes = self.encode(sending)
            else:
                if deferred:  # some layers encode one by one (TopK's float64 ones): slot the others in
                    made, sizes = self.encode(deferred)
                    parts = dict(zip(deferred, torch.split(made, sizes)))
                    payloads = [parts[n] if p is DEFERRED else p for n, p in zip(sending, payloads)]
                bucket.sizes = [p.numel() for p in payloads]
                packed = torch.cat(payloads) if len(payloads) > 1 else payloads[0]
            bucket.handle = self.channel.allgather_async(packed, name=name)

    def launch_rest(self) -> None:
        """Issue every bucket of the step not issued yet (in the first step, after agreeing on
        the layout)."""
        missing = self.buckets is not None and any(n not in self._payloads for n in self._bucket_of)
        if missing and not self._launched:
            self.buckets = None  # a subset of the layers, nothing sent yet: agree on this set
        if self.buckets is None:
            order = agree_layout(self.channel, self._shapes, self._order, self.prefix, self.layers)
            self.buckets = [_Bucket(names) for names in plan_buckets(order, self._nbytes, self.first_cap, self.cap)]
            self._bucket_of = {n: i for i, b in enumerate(self.buckets) for n in b.names}
        missing = sorted(n for n in self._bucket_of if n not in self._payloads)
        if missing:
            raise RuntimeError(f"AccordionCompressor: no gradient for {', '.join(map(repr, missing[:3]))} in this "
                               f"step on rank {self.channel.rank}, after some of the step's buckets were sent; every "
                               f"rank must have the {self.layers} layers agreed on (the other ranks will time out waiting)")
        self._launch_complete()

    @property
    def all_issued(self) -> bool:
        """Whether every bucket of the step's agreed layout is issued: a collective issued
        now on this channel comes after all of them on every rank."""
        return self.buckets is not None and self._launched == len(self.buckets)

    @property
    def launched(self) -> int:
        """How many buckets this step has issued (they are issued in layout order)."""
        return self._launched

    def arrived(self, index: int) -> bool:
        """Whether issued bucket ``index``'s result can be taken without waiting."""
        handle = self.buckets[index].handle
        return handle is None or arrived(self.channel, handle)

    def take(self, index: int) -> dict[str, Any]:
        """Wait for issued bucket ``index``; each of its sending layers' result, in bucket order."""
        bucket = self.buckets[index]
        out: dict[str, Any] = {}
        if bucket.handle is None:
            return out
        try:
            result = self.channel.wait(bucket.handle)
        except TimeoutError as exc:
            layers = ", ".join(bucket.names[:4]) + (" ..." if len(bucket.names) > 4 else "")
            raise type(exc)(f"{exc} (bucket {index} holds layers {layers})") from exc  # keeps CollectiveTimeout
        bucket.handle = None
        if bucket.shapes is not None:  # packed: each layer's P is a view of the averaged flat payload
            bucket.packed = result[0]
            parts = torch.split(bucket.packed, [math.prod(s) for s in bucket.shapes])
            for n, t, shape in zip(bucket.sending, parts, bucket.shapes):
                out[n] = [t.view(shape)]
        elif self.kind == "allreduce":
            offset = 0
            for n, count in zip(bucket.sending, bucket.sizes):
                out[n] = result[offset:offset + count]
                offset += count
        else:
            rows = result.view(self.channel.size, -1)
            offset = 0
            for n, width in zip(bucket.sending, bucket.sizes):
                out[n] = rows[:, offset:offset + width]
                offset += width
        return out

    def results(self) -> dict[str, Any]:
        """The whole round in one call: ``launch_rest()``, wait for every bucket, and start
        the next step; returns each sending layer's result."""
        self.launch_rest()
        out: dict[str, Any] = {}
        for index in range(len(self.buckets)):
            out.update(self.take(index))
        self.begin_step()
        return out

    def packed(self, index: int) -> torch.Tensor | None:
        """Taken bucket ``index``'s averaged payload as one flat tensor, if it was sent packed
        (every layer deferred): one check of the whole bucket instead of one per layer."""
        return self.buckets[index].packed

    @property
    def complete(self) -> bool:
        """Whether every layer of the agreed layout has reported this step (all buckets issued)."""
        return self.buckets is not None and len(self._payloads) == len(self._bucket_of)

    @property
    def active(self) -> bool:
        """Whether this step has reported layers that ``results`` has not consumed yet."""
        return bool(self._order)


def arrived(channel: Channel, handle: Any) -> bool:
    """Whether a collective has completed (never waits). A channel that cannot tell (the
    simulated one, whose collectives happen in ``wait``) reports False: callers then wait in
    their fixed order."""
    return bool(channel.test(handle))


def lane(channel: Channel, name: str) -> Channel:
    """A channel whose collectives pair independently of ``channel``'s: ranks may then
    interleave issues on the two in a different order (PowerSGD starts a bucket's Q round
    when its P is back, which is a matter of timing). Channels that pair collectives by name
    (Horovod's, the simulated one) are their own lanes (``Channel.lane``'s default)."""
    return channel.lane(name)


def bytes_of(*tensors: torch.Tensor) -> torch.Tensor:
    """Tensors' raw bytes, concatenated (TopK's values and indices in one payload)."""
    return torch.cat([t.reshape(-1).contiguous().view(torch.uint8) for t in tensors])


def split_bytes(row: torch.Tensor, dtype: torch.dtype, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``bytes_of(values, int32 indices)`` for a (ranks, bytes) block: every rank's
    values, then every rank's indices, each flattened in rank order."""
    width = count * torch.empty(0, dtype=dtype).element_size()
    values = row[:, :width].contiguous().view(dtype).reshape(-1)
    indices = row[:, width:width + 4 * count].contiguous().view(torch.int32).reshape(-1)
    return values, indices
