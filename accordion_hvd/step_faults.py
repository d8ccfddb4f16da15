"""Non-finite gradients, tracked on the device: a step never waits for the host to decide.

A rank whose gradient is not finite sends NaN in its place, so the fault shows in the
exchanged data on every rank; the exchanges fold what they see into 0-d bool flags, and the
step is settled with them (results zeroed, error feedback kept) by masked tensor ops. Only
when somebody asks (``step_skipped``, ``skipped_steps``), or at a later step once the device
has finished with the flag, does the host read it: on a GPU that is a copy into pinned
memory and an event, not a synchronization inside the step.

``StepFaults`` keeps the current step's flags, the count of skipped steps, and the steps
whose outcome the host has not read yet (to log them, to fail the run on an error flag such
as TopK indices outside their layer, and to check the invariant that a rank's own
non-finite gradient always skips the step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .flags import either

log = logging.getLogger("accordion_hvd")


@dataclass
class _Settled:
    """A settled step whose outcome the host has not read yet."""
    step: int                      # 1-based
    outcome: torch.Tensor          # int8 0-d, on the host once ``ready``: bits 1 skipped, 2 local fault
                                   # not seen, 4 an error flag set
    ready: torch.cuda.Event | None  # None: already on the host
    local: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # this rank's (layer, finite flag)
    errors: list[tuple[torch.Tensor, str]] = field(default_factory=list)  # (flag, message): raise if set


class StepFaults:
    """The step's fault flags, the skipped-step count and the unread outcomes."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self._count: torch.Tensor | int = 0  # skipped steps; a device tensor once a step has settled
        self._last: _Settled | None = None
        self._unread: list[_Settled] = []
        self._begin()

    def _begin(self) -> None:
        self.bad: torch.Tensor | None = None        # some rank's gradient was not finite
        self._local: list[tuple[str, torch.Tensor]] = []  # this rank's layers and finite flags
        self._errors: list[tuple[torch.Tensor, str]] = []

    # --- during a step ----------------------------------------------------------------------
    def local(self, name: str, finite: torch.Tensor) -> None:
        """This rank's gradient of ``name`` and its finite flag."""
        self._local.append((name, finite))

    def local_bad(self) -> torch.Tensor | None:
        """Whether any of this rank's gradients so far this step was not finite (0-d bool on
        their device; None before the first): for a front end that shares the verdict with
        ranks whose data never meets this rank's (hsdp.py)."""
        if not self._local:
            return None
        return ~torch.stack([finite for _, finite in self._local]).all()

    def seen(self, bad: torch.Tensor | None) -> None:
        """A fault flag from the exchanged data (the same on every rank)."""
        self.bad = either(self.bad, bad)

    def error(self, flag: torch.Tensor, message: str) -> None:
        """A flag that, once the host reads it set, ends the run with ``message`` (a
        RuntimeError, on every rank: it comes from the exchanged data)."""
        self._errors.append((flag, message))

    # --- at the end of a step ---------------------------------------------------------------
    def settle(self, step: int, device: torch.device) -> torch.Tensor:
        """Close step ``step`` (1-based): returns its "skipped" flag (0-d bool on ``device``),
        counts it, and queues its outcome for the host to read later (``poll``, once the step
        is settled)."""
        skipped = self.bad if self.bad is not None else torch.zeros((), dtype=torch.bool, device=device)
        self._count = self._count + skipped.long()
        outcome = skipped.to(torch.int8)
        if self._local:  # a fault of this rank not seen: cannot happen, the NaN sent in its place reaches every rank
            local_bad = ~torch.stack([finite for _, finite in self._local]).all()
            outcome = outcome + 2 * (local_bad & ~skipped).to(torch.int8)
        for flag, _ in self._errors:
            outcome = outcome | 4 * flag.to(torch.int8)
        ready = None
        if outcome.device.type == "cuda":
            host = torch.empty((), dtype=torch.int8, pin_memory=True)
            host.copy_(outcome, non_blocking=True)
            ready, outcome = torch.cuda.Event(), host
            ready.record()
        self._last = _Settled(step, outcome, ready, self._local, self._errors)  # flags read only if set
        self._unread.append(self._last)
        self._begin()
        return skipped

    def poll(self, wait: bool) -> None:
        """Read the outcomes the device has finished with (all of them if ``wait``), log each
        skipped step, and raise (RuntimeError) if an error flag was set or if a rank's own
        fault did not skip its step."""
        while self._unread:
            entry = self._unread[0]
            if entry.ready is not None and not entry.ready.query():  # query() never waits
                if not wait:
                    return
                entry.ready.synchronize()
            entry.ready = None
            self._unread.pop(0)
            code = int(entry.outcome)  # on the host by now (pinned memory, copied before the event)
            flags = torch.stack([finite for _, finite in entry.local]).tolist() if code and entry.local else []
            bad = [n for (n, _), finite in zip(entry.local, flags) if not finite]
            if bad:
                log.warning("rank %d: non-finite gradient in %s at step %d", self.rank,
                            ", ".join(bad[:3]) + (" ..." if len(bad) > 3 else ""), entry.step)
            if code & 4:
                raise RuntimeError(next(message for flag, message in entry.errors if bool(flag)) + f" (step {entry.step})")
            if code & 2:
                raise RuntimeError("AccordionCompressor: a non-finite gradient was not seen in the exchange")
            if code & 1:
                log.warning("step %d skipped on every rank: a gradient was not finite on some rank; gradients set "
                            "to zero, error feedback kept", entry.step)

    # --- what the host reads ----------------------------------------------------------------
    @property
    def last_skipped(self) -> bool:
        """Whether the last settled step was skipped (waits for the device)."""
        if self._last is None:
            return False
        self.poll(wait=True)
        return bool(int(self._last.outcome) & 1)

    @property
    def count(self) -> int:
        """Steps skipped so far (waits for the device)."""
        self.poll(wait=True)
        return int(self._count)

    def load(self, skipped: int) -> None:
        """The skipped-step count of a loaded state."""
        self._count = int(skipped)

    def forget(self) -> None:
        """Drop the step in flight (an aborted step: its collectives never completed)."""
        self._begin()
