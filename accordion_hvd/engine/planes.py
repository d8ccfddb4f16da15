"""Which planes and exchanges carry the engine's step: the data plane and the control plane
(a front end's own, or comm/planes.py's default for the gradients' device), the codec's
exchange (from the registry: exchange/registry.py) and the uncompressed layers' round, each
built at first use, and all rebuilt when Elastic re-forms the world. A part of ``StepEngine``
(engine.py), in its own file to be read on its own."""

from __future__ import annotations

from ..comm.planes import default_control_plane, default_data_plane
from ..exchange import FIRST_BUCKET_BYTES, Round1, lane, make_exchange


class Planes:
    """``StepEngine``'s planes and exchanges (module doc)."""

    @property
    def channel(self):
        """The data plane: the one given, else comm/planes.py's default for the device."""
        if self._channel is None:
            self._channel = default_data_plane(self.device_type)
        return self._channel

    @property
    def control(self):
        if self._control is None:
            self._control = default_control_plane(self.channel)
        return self._control

    def use_planes(self, channel, control=None) -> None:
        """A front end's own planes (the DDP hook's process groups), before the first step;
        without ``control``, the one that goes with ``channel`` (comm/planes.py)."""
        if self.in_flight or self._exchange is not None or self._dense_round is not None:  # (a loaded state is fine)
            raise ValueError("AccordionCompressor: bind it before its first step (it has exchanged gradients already)")
        self._channel, self._channel_given = channel, True
        self._control, self._control_given = control, control is not None
        self._exchange = self._dense_round = None

    @property
    def exchange(self):
        """The codec's exchange on the data plane (built at the first compressed layer)."""
        if self._exchange is None:
            self._exchange = make_exchange(self.codec, self.channel, first_cap=min(FIRST_BUCKET_BYTES, self.bucket_cap),
                                           cap=self.bucket_cap, counters=self.counters, per_step=self.policy.per_step)
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

    def world_changed(self) -> None:
        """The world was re-formed (Elastic): forget collectives in flight, rebuild the planes
        that were not given for the new ranks, agree on the settings again."""
        self.settings_agreed = False
        self._exchange = self._dense_round = None  # layouts are agreed again by the new world
        if not self._control_given:
            self._control = None
        if not self._channel_given:  # ours is a group of the old world's ranks
            close = getattr(self._channel, "close", None)
            if close is not None:
                close()
            self._channel = None
        forget = getattr(self._channel, "forget_handles", None)
        if forget is not None:
            forget()
