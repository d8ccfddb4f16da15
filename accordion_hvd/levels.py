"""Compression levels as values, and the argument checks every layer of the project shares.

A level says how hard one layer is compressed in one step. Policies choose levels, the
controller hands them on, codecs turn them into their own knob (PowerSGD's rank, TopK's k):

* ``NORMAL``: the codec's aggressive setting (PowerSGD ``rank``, TopK ``ratio``);
* ``CRITICAL``: its gentle one, for critical learning regimes (``critical_rank``,
  ``critical_ratio``);
* ``Level.factor(f)``: send about ``1/f`` of the layer (GraVAC's compression factors; TopK
  keeps ``ceil(numel / f)`` entries);
* ``DENSE``: the layer goes uncompressed this step;
* ``DENSE16``: uncompressed, in 16 bits: float16 through Horovod's allreduce (half of
  float32's bytes), the rounding error kept in the layer's error feedback for later steps.

A level is an immutable value: compare it with ``==``, use it as a key. ``str(level)`` is its
name in logs, CSV columns and ``stats()`` ("normal", "critical", "10x", "dense", "dense16");
``to_state()`` / ``Level.from_state()`` carry it through checkpoints as plain values.

This module imports nothing from the project: codecs, policies, the controller and the
engine all depend on it, and on nothing of each other's for it.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

_KINDS = ("normal", "critical", "factor", "dense", "dense16")


@dataclass(frozen=True)
class Level:
    kind: str
    compression_factor: float | None = None  # only for kind "factor"

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Level kind must be one of {_KINDS}, got {self.kind!r}")
        if (self.kind == "factor") != (self.compression_factor is not None):
            raise ValueError("Level: a compression factor goes with kind 'factor' and only with it "
                             f"(got kind {self.kind!r}, compression_factor {self.compression_factor!r})")

    @classmethod
    def factor(cls, compression_factor: float) -> "Level":
        """Send about 1/``compression_factor`` of the layer (at least 1)."""
        value = float(positive_number("compression_factor", compression_factor))
        if value < 1:
            raise ValueError(f"compression_factor must be >= 1, got {compression_factor!r}")
        return cls("factor", value)

    def __str__(self) -> str:
        return f"{self.compression_factor:g}x" if self.kind == "factor" else self.kind

    def __repr__(self) -> str:
        return f"Level.factor({self.compression_factor:g})" if self.kind == "factor" else self.kind.upper()

    def to_state(self) -> list:
        """Plain values for a checkpoint (``torch.load(weights_only=True)`` reads them)."""
        return [self.kind, self.compression_factor]

    @classmethod
    def from_state(cls, state) -> "Level":
        if not isinstance(state, (list, tuple)) or len(state) != 2:
            raise ValueError(f"a level in a checkpoint is [kind, compression_factor], got {state!r}")
        kind, factor = state
        return cls.factor(factor) if kind == "factor" else cls(str(kind))


NORMAL = Level("normal")
CRITICAL = Level("critical")
DENSE = Level("dense")
DENSE16 = Level("dense16")
UNCOMPRESSED = (DENSE, DENSE16)  # the levels that send a layer whole


def check_level(name: str, level, allowed: tuple[Level, ...] | None = None) -> Level:
    """``level`` must be a Level (one of ``allowed``, when given); returns it."""
    if not isinstance(level, Level):
        raise TypeError(f"{name} must be an accordion_hvd.levels.Level (NORMAL, CRITICAL, DENSE, DENSE16 or "
                        f"Level.factor(f)), got {type(level).__name__} {level!r}")
    if allowed is not None and level not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {level!r}")
    return level


def positive_number(name: str, value, *, integer: bool = False, upper: float | None = None):
    """``value`` must be a positive number (an int if ``integer``; at most ``upper``)."""
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{name} must be {'an int' if integer else 'a number'}, got {type(value).__name__}")
    if not value > 0 or (upper is not None and value > upper) or value != value:
        bound = f"in (0, {upper}]" if upper is not None else "positive"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return value


__all__ = ["CRITICAL", "DENSE", "DENSE16", "Level", "NORMAL", "UNCOMPRESSED", "check_level", "positive_number"]
