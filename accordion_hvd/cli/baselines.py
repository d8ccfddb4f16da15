"""The uncompressed baselines (none, fp16, bf16) with the face of ``AccordionCompressor``, so that
the training loop treats every method alike: ``stats()``, ``seconds``, ``step_skipped``,
``epoch_end()``, ``state_dict()``/``load_state_dict()``. Under Horovod they are Horovod's
own ``Compression.none``/``fp16``; under DDP, DDP's default allreduce or its
``fp16_compress_hook``; under FSDP (HSDP), FSDP's own all-reduce across nodes, in float32 or
(bf16, FSDP only) ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``."""

from __future__ import annotations

import torch

from ..horovod.compressor import HorovodCompressor

_STATE_FORMAT = "accordion_hvd.cli.Uncompressed/1"


class Uncompressed(HorovodCompressor):
    """Every gradient goes whole through the front end's allreduce (fp16 halves the bytes,
    not the floats). Counts the floats it passes, as ours does; never skips a step (a
    non-finite gradient is in the average, as without compression).

    Args:
        kind: "none", "fp16" (Horovod and DDP) or "bf16" (FSDP).
    """

    def __init__(self, kind: str) -> None:
        if kind not in ("none", "fp16", "bf16"):
            raise ValueError(f"kind must be 'none', 'fp16' or 'bf16', got {kind!r}")
        self.kind = kind
        self.seconds = {"compress": 0.0, "comm": 0.0}
        self.step_skipped = False
        self._floats = 0
        self._dense = 0  # what a dense step each time would have sent (the periodic front ends send less)
        self._bytes = 0  # on the wire: 2 a float in fp16 and bf16, else the tensor's own (float32: 4)
        self._dense_bytes = 0  # the dense floats' own bytes

    def __repr__(self) -> str:
        return f"uncompressed ({self.kind})"

    @property
    def name(self) -> str:
        return self.kind

    def count(self, floats: int, dense: int | None = None, element_bytes: int = 4) -> None:
        """Floats a front end without a per-gradient call (FSDP, the periodic ones) sent this
        step; ``dense``: what a dense step would have sent (default: as many); ``element_bytes``:
        a float's size before this kind's conversion (the CLI's models: float32)."""
        self._floats += floats
        self._dense += floats if dense is None else dense
        self._dense_bytes += (floats if dense is None else dense) * element_bytes
        self._bytes += floats * (2 if self.kind in ("fp16", "bf16") else element_bytes)

    @property
    def _horovod(self):
        import horovod.torch as hvd

        return hvd.Compression.fp16 if self.kind == "fp16" else hvd.Compression.none

    def compress(self, tensor: torch.Tensor):  # Horovod's DistributedOptimizer calls these two
        self.count(tensor.numel(), element_bytes=tensor.element_size())
        return self._horovod.compress(tensor)

    def decompress(self, tensor: torch.Tensor, ctx):
        return self._horovod.decompress(tensor, ctx)

    def ddp_hook(self):
        """The DDP comm hook: DDP's default allreduce or its fp16_compress_hook, counted."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        inner = default_hooks.fp16_compress_hook if self.kind == "fp16" else default_hooks.allreduce_hook

        def hook(state, bucket):
            self.count(bucket.buffer().numel(), element_bytes=bucket.buffer().element_size())
            return inner(state, bucket)
        return hook

    def stats(self) -> dict:
        return {"floats_sent": self._floats, "floats_dense": self._dense, "bytes_sent": self._bytes,
                "bytes_dense": self._dense_bytes, "layers": {}}

    def epoch_end(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {"format": _STATE_FORMAT, "kind": self.kind, "floats": self._floats, "dense": self._dense,
                "bytes": self._bytes, "dense_bytes": self._dense_bytes}

    def load_state_dict(self, state: dict, error_feedback: bool = True) -> None:  # none to keep
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT or state.get("kind") != self.kind:
            found = state.get("kind", state.get("format")) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"the checkpoint's compression is {found!r}, this run's is uncompressed {self.kind!r}")
        self._floats = int(state["floats"])
        self._dense = int(state.get("dense", self._floats))  # (checkpoints from before it: as many)
        self._bytes = int(state.get("bytes", self._floats * (2 if self.kind in ("fp16", "bf16") else 4)))
        self._dense_bytes = int(state.get("dense_bytes", self._dense * 4))
