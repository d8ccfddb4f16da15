"""The learning rates a policy reacts to (Accordion: a decrease starts a critical regime):
read from the optimizer a front end found or was given, or reported by the user; gathered
from every rank once per step, on the data plane, in flight with the step's exchange."""

from __future__ import annotations

import weakref

import torch

from ..levels import positive_number


class LearningRates:
    def __init__(self) -> None:
        self.reported: list[float] | None = None  # report(): overrides the optimizer's
        self._optimizer = None                    # weakref: the compressor keeps no model alive
        self._gather = None                       # this step's gather, in flight
        self._issued = False                      # this step's gather was issued (or was not needed)

    def watch(self, optimizer) -> None:
        self._optimizer = weakref.ref(optimizer)

    @property
    def watching(self) -> bool:
        return self._optimizer is not None

    def report(self, lr) -> None:
        values = [lr] if not isinstance(lr, (list, tuple)) else list(lr)
        for v in values:
            positive_number("lr", v)
        self.reported = [float(v) for v in values]

    def load(self, reported: list[float] | None) -> None:
        """The reported rates of a loaded state (None: none was reported)."""
        self.reported = None if reported is None else [float(v) for v in reported]

    def current(self) -> list[float] | None:
        if self.reported is not None:
            return self.reported
        optimizer = self._optimizer() if self._optimizer is not None else None
        return None if optimizer is None else [float(g["lr"]) for g in optimizer.param_groups]

    def gather(self, channel) -> None:
        """Once per step, after the step's last first-round bucket is issued (so every rank
        issues its collectives in the same order): start gathering every rank's rates, for
        the controller's per-step check, which then costs no round trip of its own."""
        if self._issued:
            return
        self._issued = True
        lrs = self.current()
        if lrs is not None:
            self._gather = channel.allgather_async(torch.tensor(lrs, dtype=torch.float64), name=f"acc.lrs.{len(lrs)}")

    def take(self):
        """This step's gather in flight (None if none was issued); the next step starts."""
        handle, self._gather, self._issued = self._gather, None, False
        return handle
