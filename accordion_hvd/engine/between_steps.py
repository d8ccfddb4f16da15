"""What the step engine does between optimizer steps: the settings every rank must share,
the levels (a user's, the controller's at a window's end), and the link measured for the
network probe. A part of ``StepEngine`` (engine.py), in its own file to be read on its own: it
uses the engine's state (``codec``, ``controller``, ``layers``, the planes, the counters) and
calls nothing above the engine."""

from __future__ import annotations

import logging

from ..comm.link import LinkMeasurement, describe, measure_link
from ..levels import Level, check_level
from . import settings, state

log = logging.getLogger("accordion_hvd.engine")


class BetweenSteps:
    """``StepEngine``'s calls between steps (module doc)."""

    def config(self) -> dict:
        """The settings that must be equal on every rank (plain JSON values)."""
        return {**self.codec.config(), "eta": self.eta, **self.controller.config(),
                "bucket_cap_mb": self.bucket_cap / 2**20}  # every rank must cut the same buckets

    def agree_settings(self) -> None:
        """Once (again after ``world_changed``): every rank's settings and the front end's
        compared, one blocking allgather (engine/settings.py)."""
        if self.settings_agreed:
            return
        state.check_loaded_owner(self)
        settings.agree(self.channel, {**self.config(), **self.front_end})
        self.settings_agreed = True

    def between_steps(self, what: str) -> None:
        if self.in_flight:
            raise RuntimeError(f"AccordionCompressor: {what} must be called between optimizer steps "
                               f"(layers still in flight: {sorted(self.in_flight)[:3]})")

    def set_level(self, name: str, level: Level) -> None:
        check_level("level", level)
        if name not in self.layers:
            raise KeyError(f"AccordionCompressor: no compressed layer named {name!r} (known: {sorted(self.layers)})")
        self.between_steps("set_level")
        self.codec.set_level(self.layers[name], level)
        self.controller.levels[name] = level

    def epoch_end(self) -> None:
        self.between_steps("epoch_end")
        self._probe_window(epoch_end=True)
        self.apply_levels(self.controller.epoch_end(self.control, sorted(self.layers)))

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
        return self.channel.rank == 0 if self.speaks_for_job is None else self.speaks_for_job

    def measure_link(self) -> LinkMeasurement:
        self.between_steps("measure_link")
        measured = measure_link(self.channel, self.control)
        if measured.link is None:
            log.info("rank %d: no link measured at step %d: %s", self.channel.rank, self.counters.steps,
                     measured.reason)
        else:
            log.info("rank %d: link at step %d: %s (%d collectives)", self.channel.rank, self.counters.steps,
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
        buckets = self._exchange.round1.buckets if self._exchange is not None else None
        self.probe.window(link, [b.names for b in buckets or []])
