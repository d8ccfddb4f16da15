"""The codec protocol: what the engine and the policies ask of every codec.

A codec is the math of one compression family with error feedback, per layer, with explicit
state: it never communicates. Two contracts meet in it:

* **the engine's** (this module): the levels it has, which layers it takes, each layer's
  state (made, re-levelled, counted, saved, restored) and its settings. The compressor, the
  controller and the policies use nothing else, so nothing above the codecs names a
  concrete codec;
* **its exchange's**: the phases of a step (encode, the rounds, decode, settle), private
  between a codec and the exchange registered for it (accordion_hvd/exchange/registry.py).

A network-aware policy also asks the optional ``NETWORK`` methods (what a level costs in
math, and the error it would make); a codec without them works with every other policy.
"""

from __future__ import annotations

import torch

from ..levels import Level
# The engine checks a layer's error feedback dtype with residual_dtype, and keeps and sends flat
# buffers whole as any codec keeps and sends a layer whole (engine/whole.py):
from ._common import flush_whole, residual_dtype, settle_sent, wire_dtype  # noqa: F401

REQUIRED = ("levels", "adaptive", "measures_gain", "compressible", "init_state", "set_level", "floats_sent",
            "wire", "state_to_dict", "state_from_dict", "config")
NETWORK = ("kernel_work", "level_errors")


class Codec:
    """The engine's side of a codec (module doc). Subclass it, or provide the same names.

    ``levels``: the levels a window policy may choose among (``levels.NORMAL``, ``CRITICAL``,
    ``DENSE``...). ``adaptive``: whether the normal and critical levels differ.
    ``measures_gain``: whether the codec can measure, every step, the gain of any level (a
    per-step policy such as GraVAC needs it).

    A layer's state (``init_state``'s return) may hold anything its exchange needs; the engine
    reads four attributes of it: ``name``, ``shape`` (the gradient's), ``level`` (its current level) and
    ``residual`` (the error feedback tensor, in ``residual_dtype`` of the gradient's dtype, on
    the gradient's device).
    """

    levels: tuple[Level, ...] = ()
    adaptive: bool = False
    measures_gain: bool = False
    # The link gate's threshold for this codec (policies/link_gate.py ``pays``): how much
    # shorter than a 16-bit dense step its compressed step must be to be kept, i.e. how many
    # more steps than dense it may need to reach a quality. None: the gate's own default.
    gate_pays: float | None = None

    def compressible(self, shape: torch.Size) -> bool:
        """Whether a gradient of this shape is compressed (else it is sent as it is)."""
        raise NotImplementedError

    # Passed straight as Horovod's ``compression=``, a codec would fail at the first backward
    # with "object has no attribute 'compress'": Horovod calls these, on every rank, before
    # any collective of the step, and they say what to pass instead.
    @classmethod
    def compress(cls, *_args, **_kwargs):
        raise TypeError(f"{cls.__name__} is a codec, not a Horovod compressor: pass "
                        f"compression=acc.AccordionCompressor(acc.{cls.__name__}(...)) to hvd.DistributedOptimizer")

    decompress = compress

    def init_state(self, name: str, grad: torch.Tensor, level: Level):
        """A layer's state at its first gradient (error feedback zero, at ``level``)."""
        raise NotImplementedError

    def set_level(self, state, level: Level) -> None:
        """Move a layer to ``level`` from its next step (called between steps)."""
        raise NotImplementedError

    def floats_sent(self, state) -> int:
        """What a layer at its current level puts on the wire per step, in elements."""
        raise NotImplementedError

    def wire(self, shape: torch.Size, level: Level, itemsize: int = 4) -> tuple[tuple[str, int], ...]:
        """The collectives one layer of ``shape`` costs at ``level``, as (kind, bytes per
        rank): "allreduce" or "allgather" in its bucket, or "dense" (sent whole by the front
        end). ``itemsize``: bytes of the layer's error feedback entries. ``stats()`` counts
        bytes on the wire with it, and a network-aware policy prices a level with it."""
        raise NotImplementedError

    # Optional: ``bytes_sent(state)``, the bytes a layer put on the wire in the step just
    # encoded, for a codec whose payload's size is not a function of the layer's level alone
    # (Quantize's sparse chunks); without it, ``stats()`` counts ``wire``'s.

    def state_to_dict(self, state) -> dict:
        """A layer's state as plain values and tensors (copies)."""
        raise NotImplementedError

    def state_from_dict(self, name: str, d: dict):
        """The state ``state_to_dict`` gave; raises ValueError when it does not fit this codec."""
        raise NotImplementedError

    def config(self) -> dict:
        """The settings every rank and every checkpoint must share, with the codec's name."""
        raise NotImplementedError


class WireBytes:
    """Bytes a compressed layer put on the wire in the step just encoded (``stats()``): the
    codec's optional ``bytes_sent`` where it has one, else ``wire`` at the layer's level,
    worked out once per layer and level: not every step."""

    def __init__(self, codec) -> None:
        self.codec = codec
        self.measured = getattr(codec, "bytes_sent", None)  # optional in the protocol (Codec, above)
        self._cache: dict[tuple[str, str], int] = {}

    def __call__(self, layer) -> int:
        if self.measured is not None:
            return self.measured(layer)
        key = (layer.name, str(layer.level))
        if key not in self._cache:
            wire = self.codec.wire(layer.shape, layer.level, layer.residual.element_size())
            self._cache[key] = sum(nbytes for _, nbytes in wire)
        return self._cache[key]


def check_codec(codec) -> None:
    """Refuse, at construction, an object that does not implement the engine's protocol,
    naming what it lacks."""
    missing = [name for name in REQUIRED if not hasattr(codec, name)]
    if not missing:
        missing = [name for name in REQUIRED if _unimplemented(codec, name)]
    if missing:
        raise TypeError(f"codec must be acc.PowerSGD(...), acc.TopK(...), acc.Quantize(...) or another implementation of the codec "
                        f"protocol (accordion_hvd/codecs/base.py): {type(codec).__name__} lacks {', '.join(missing)}")


def _unimplemented(codec, name: str) -> bool:
    """A method left at ``Codec``'s NotImplementedError stub."""
    attr = getattr(type(codec), name, None)
    return attr is not None and getattr(Codec, name, None) is attr and callable(attr)
