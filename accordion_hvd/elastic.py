"""Horovod Elastic: the compressor's state travels with ``hvd.elastic.TorchState``.

    import accordion_hvd.elastic  # registers the handler below with Horovod
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, compression=compression, epoch=0)

    @hvd.elastic.run
    def train(state): ...  # state.commit() between steps, as usual

What each of Horovod's state operations does with an ``AccordionCompressor``:

* ``commit()`` / ``save()``: keeps a copy of ``state_dict()`` (call it between steps, as for
  the model and optimizer);
* ``restore()`` (a worker failed mid-step): drops the step in flight, whose exchanges will
  never complete, and loads the last commit;
* ``sync()`` (the world was re-formed, or a worker joined): everything that must be the same
  on every rank (levels, PowerSGD's warm-start Q, the controller's and policy's state, the
  counters) comes from rank 0; each rank keeps its own error feedback and its own window
  sums, which are local by nature (a worker that joined starts them at zero). Settings are
  compared across ranks again at the next step.
"""

from __future__ import annotations

import torch
from horovod.torch.elastic.state import StateHandler, get_handler_registry, set_handler_registry
from horovod.torch.functions import broadcast_object

from .horovod.compressor import AccordionCompressor

_LOCAL_CONTROLLER_KEYS = ("sums", "sq")  # window sums of this rank's own gradients


class CompressorStateHandler(StateHandler):
    def __init__(self, compression: AccordionCompressor) -> None:
        super().__init__(compression)
        self._saved = compression.state_dict()

    def save(self) -> None:
        self._saved = self.value.state_dict()

    def restore(self) -> None:
        self.value.abort_step()
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        compression = self.value
        compression.world_changed()
        own = compression.state_dict()
        shared = broadcast_object(shared_part(own), root_rank=0, name="acc.elastic.sync")
        compression.load_state_dict(merge(shared, own))


def shared_part(state: dict) -> dict:
    """A ``state_dict()`` without the rank-local tensors (error feedback, window sums): only
    their shapes and dtypes, which is what a rank that lacks them needs."""
    layers = {n: {**d, "residual": _shape_of(d["residual"])} for n, d in state["layers"].items()}
    controller = dict(state["controller"])
    controller["sums"] = {n: _shape_of(t) for n, t in controller["sums"].items()}
    controller["sq"] = {}
    return {**state, "layers": layers, "controller": controller}


def merge(shared: dict, own: dict) -> dict:
    """Rank 0's shared state with this rank's own error feedback and window sums where it
    has them for the same layer and shape, else zeros."""
    def mine_or_zeros(spec, mine):
        shape, dtype = spec
        if isinstance(mine, torch.Tensor) and list(mine.shape) == shape:
            return mine
        return torch.zeros(shape, dtype=getattr(torch, dtype))

    layers = {n: {**d, "residual": mine_or_zeros(d["residual"], own["layers"].get(n, {}).get("residual"))}
              for n, d in shared["layers"].items()}
    controller = dict(shared["controller"])
    controller["sums"] = {n: mine_or_zeros(spec, own["controller"]["sums"].get(n))
                          for n, spec in controller["sums"].items()}
    controller["sq"] = {n: v for n, v in own["controller"]["sq"].items() if n in controller["weight"]}
    # Whose the result is: this rank's (its own error feedback, in the world it is in now).
    return {**shared, "rank": own.get("rank"), "world_size": own.get("world_size"), "layers": layers,
            "controller": controller}


def _shape_of(t: torch.Tensor) -> tuple[list[int], str]:
    return list(t.shape), str(t.dtype).removeprefix("torch.")


def register() -> None:
    """Let ``hvd.elastic.TorchState`` take an ``AccordionCompressor`` as a keyword argument
    (done on import; idempotent)."""
    registry = get_handler_registry()
    if not any(cls is AccordionCompressor for cls, _ in registry):
        set_handler_registry([*registry, (AccordionCompressor, CompressorStateHandler)])


register()
