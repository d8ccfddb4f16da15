"""Horovod's own compressions (none, fp16) with the face of ``AccordionCompressor``, so that
the training loop treats every method alike: ``stats()``, ``seconds``, ``step_skipped``,
``epoch_end()``, ``state_dict()``/``load_state_dict()``."""

from __future__ import annotations

import horovod.torch as hvd
import torch

from ..compressor import HorovodCompressor

_STATE_FORMAT = "accordion_hvd.cli.Uncompressed/1"


class Uncompressed(HorovodCompressor):
    """Every gradient goes whole through Horovod's allreduce (fp16 halves the bytes, not the
    floats). Counts the floats it passes, as ours does; never skips a step (a non-finite
    gradient is in Horovod's average, as without compression).

    Args:
        kind: "none" or "fp16" (``hvd.Compression.none`` / ``.fp16``).
    """

    def __init__(self, kind: str) -> None:
        choices = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}
        if kind not in choices:
            raise ValueError(f"kind must be one of {sorted(choices)}, got {kind!r}")
        self.kind, self._horovod = kind, choices[kind]
        self.seconds = {"compress": 0.0, "comm": 0.0}
        self.step_skipped = False
        self._floats = 0

    def __repr__(self) -> str:
        return f"Horovod {self.kind}"

    def compress(self, tensor: torch.Tensor):
        self._floats += tensor.numel()
        return self._horovod.compress(tensor)

    def decompress(self, tensor: torch.Tensor, ctx):
        return self._horovod.decompress(tensor, ctx)

    def stats(self) -> dict:
        return {"floats_sent": self._floats, "floats_dense": self._floats, "layers": {}}

    def epoch_end(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {"format": _STATE_FORMAT, "kind": self.kind, "floats": self._floats}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT or state.get("kind") != self.kind:
            found = state.get("kind", state.get("format")) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"the checkpoint's compression is {found!r}, this run's is Horovod {self.kind!r}")
        self._floats = int(state["floats"])
