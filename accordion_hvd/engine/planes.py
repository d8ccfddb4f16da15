"""Which planes and exchanges carry the engine's step: the data plane and the control plane
(a front end's own, or comm/planes.py's default for the gradients' device), the codec's
exchange (from the registry: exchange/registry.py) and the uncompressed layers' round, each
built at first use, and all rebuilt when Elastic re-forms the world. A part of the engine
(engine.py) with its own state: the engine holds one and asks it for them."""

from __future__ import annotations

from typing import Any

from ..comm.channel import check_channel
from ..comm.planes import default_control_plane, default_data_plane
from ..exchange import FIRST_BUCKET_BYTES, Round1, lane, make_exchange


class Planes:
    """The engine's planes and exchanges (module doc). ``codec``, ``counters`` (the exchange
    counts into them), ``per_step`` (the policy chooses levels every step) and
    ``bucket_cap`` (bytes) are how the exchanges are built."""

    def __init__(self, codec, counters, *, per_step: bool, bucket_cap: int, channel: Any = None,
                 control: Any = None) -> None:
        self.codec, self.counters, self.per_step, self.bucket_cap = codec, counters, per_step, bucket_cap
        self.device_type = "cpu"  # of the first gradient: picks the default data plane
        if channel is not None:
            check_channel("channel", channel)
        self._channel, self._channel_given = channel, channel is not None
        self._control, self._control_given = control, control is not None
        self._exchange = None     # the codec's exchange (accordion_hvd/exchange/)
        self._dense_round = None  # the uncompressed layers' round

    @property
    def channel(self):
        """The data plane: the one given, else comm/planes.py's default for the device."""
        if self._channel is None:
            self._channel = default_data_plane(self.device_type)
        return self._channel

    @property
    def channel_if_made(self):
        """The data plane if one was given or made, else None (never makes one: a state saved
        before ``hvd.init()`` knows no world yet)."""
        return self._channel

    @property
    def control(self):
        if self._control is None:
            self._control = default_control_plane(self.channel)
        return self._control

    @property
    def exchange(self):
        """The codec's exchange on the data plane (built at the first compressed layer)."""
        if self._exchange is None:
            self._exchange = make_exchange(self.codec, self.channel, first_cap=min(FIRST_BUCKET_BYTES, self.bucket_cap),
                                           cap=self.bucket_cap, counters=self.counters, per_step=self.per_step)
        return self._exchange

    @property
    def exchange_if_made(self):
        """The codec's exchange if a compressed layer has been through it, else None."""
        return self._exchange

    @property
    def dense_round(self) -> Round1:
        """The uncompressed layers' round: one averaging allreduce per bucket, on the data
        plane's "dense" lane (its buckets fill at other times than the compressed layers')."""
        if self._dense_round is None:
            self._dense_round = Round1(lane(self.channel, "dense"), "allreduce", "acc.D",
                                       first_cap=min(FIRST_BUCKET_BYTES, self.bucket_cap), cap=self.bucket_cap,
                                       layers="uncompressed")
        return self._dense_round

    def use(self, channel, control=None) -> None:
        """A front end's own planes (the DDP hook's process groups), before the first step;
        without ``control``, the one that goes with ``channel`` (comm/planes.py)."""
        if self._exchange is not None or self._dense_round is not None:  # (a loaded state is fine)
            raise ValueError("AccordionCompressor: bind it before its first step (it has exchanged gradients already)")
        check_channel("channel", channel)
        self._channel, self._channel_given = channel, True
        self._control, self._control_given = control, control is not None

    def note_step(self, step: int) -> None:
        """Tell the data plane where this rank is (for a failure's diagnosis), if it keeps that."""
        if self._channel is not None:
            self._channel.note_step(step)

    def abort(self) -> None:
        """Drop the rounds of a step in flight (their collectives will never complete)."""
        if self._exchange is not None:
            self._exchange.abort()
        if self._dense_round is not None:
            self._dense_round.begin_step()

    def world_changed(self) -> None:
        """The world was re-formed (Elastic): forget collectives in flight, rebuild the planes
        that were not given for the new ranks."""
        self._exchange = self._dense_round = None  # layouts are agreed again by the new world
        if not self._control_given:
            self._control = None
        if not self._channel_given and self._channel is not None:  # ours is a group of the old world's ranks
            self._channel.close()
            self._channel = None
        if self._channel is not None:
            self._channel.forget_handles()
