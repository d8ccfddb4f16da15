"""What the step engine does between optimizer steps: the levels (a user's, the controller's
at a window's end) and the link measured for the network probe. A part of the engine
(engine.py) with its own state (the last link measured, who logs for the job, the level
announcer); it is handed the engine's other parts at construction and calls nothing above
the engine."""

from __future__ import annotations

import logging

from ..comm.link import LinkMeasurement, describe, measure_link
from ..levels import Level, check_level
from .announce import LevelAnnouncer

log = logging.getLogger("accordion_hvd.engine")


class BetweenSteps:
    """The engine's calls between steps (module doc). ``layers`` (name -> codec state) and
    ``in_flight`` (this step's layers not finished yet) are the engine's own objects, read
    here, changed in place there; ``planes`` the engine's ``Planes``; ``probe`` a
    network-aware policy's ``NetworkProbe`` or None."""

    def __init__(self, *, codec, policy, controller, counters, layers: dict, in_flight: set, planes, probe) -> None:
        self.codec, self.policy, self.controller, self.counters = codec, policy, controller, counters
        self.layers, self.in_flight, self.planes, self.probe = layers, in_flight, planes, probe
        self.link: LinkMeasurement | None = None  # the last measure_link() that found a link
        self.speaks_for_job: bool | None = None   # a front end's choice of the rank that logs (HSDP: global rank 0)
        self.announcer = LevelAnnouncer()

    def check(self, what: str) -> None:
        """Raise unless no layer is in flight: ``what`` must be called between steps."""
        if self.in_flight:
            raise RuntimeError(f"AccordionCompressor: {what} must be called between optimizer steps "
                               f"(layers still in flight: {sorted(self.in_flight)[:3]})")

    def set_level(self, name: str, level: Level) -> None:
        check_level("level", level)
        if name not in self.layers:
            raise KeyError(f"AccordionCompressor: no compressed layer named {name!r} (known: {sorted(self.layers)})")
        self.check("set_level")
        self.codec.set_level(self.layers[name], level)
        self.controller.levels[name] = level

    def epoch_end(self) -> None:
        self.check("epoch_end")
        self._probe_window(epoch_end=True)
        self.apply_levels(self.controller.epoch_end(self.planes.control, sorted(self.layers)))

    def step_ended(self, lrs, gathered) -> None:
        """After ``end_step``: a window that ends here is closed (the probe's link first) and
        the controller's levels for the next step applied, alike on every rank. ``lrs`` and
        ``gathered``: this rank's learning rates and every rank's, for the controller."""
        self._probe_window()
        self.apply_levels(self.controller.end_step(self.planes.control, sorted(self.layers), lrs, gathered=gathered))

    def apply_levels(self, changed: dict[str, Level] | None) -> None:
        applied: dict[str, list[str]] = {}
        for name, level in (changed or {}).items():
            if name in self.layers:
                self.codec.set_level(self.layers[name], level)
                applied.setdefault(str(level), []).append(name)
        if self.speaks:  # every rank switches alike: one line for the job
            self.announcer.levels(self.counters.steps, applied, self.controller)
            self.announcer.verdict(self.counters.steps, self.policy.verdict())

    @property
    def speaks(self) -> bool:
        """Whether this rank logs for the job: the front end's choice (``speaks_for_job``),
        else rank 0 of the data plane."""
        return self.planes.channel.rank == 0 if self.speaks_for_job is None else self.speaks_for_job

    def measure_link(self) -> LinkMeasurement:
        self.check("measure_link")
        channel = self.planes.channel
        measured = measure_link(channel, self.planes.control)
        if measured.link is None:
            log.info("rank %d: no link measured at step %d: %s", channel.rank, self.counters.steps, measured.reason)
        else:
            log.info("rank %d: link at step %d: %s (%d collectives)", channel.rank, self.counters.steps,
                     describe(measured.link), measured.collectives)
            self.link = measured
        return measured

    def _probe_window(self, epoch_end: bool = False) -> None:
        """Before a window closes, what the network probe's report needs from the engine: this
        window's link (else the last one measured; every rank holds the same) and the
        exchange's agreed buckets."""
        if not self.controller.window_ends(epoch_end):
            return
        measured = self.measure_link()
        link = measured.link if measured.link is not None else (self.link.link if self.link is not None else None)
        exchange = self.planes.exchange_if_made
        buckets = exchange.round1.buckets if exchange is not None else None
        self.probe.window(link, [b.names for b in buckets or []])
