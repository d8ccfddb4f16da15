"""One step of a front end whose gradients come in buffers: shared by DDP, HSDP and DiLoCo.

DDP hands us its buckets, FSDP2 its reduce-scatter outputs, DiLoCo a round's
pseudo-gradients. Each front end keeps only its framework's plumbing (where a tensor comes
from, where its result goes); the step itself is this object's, numbered:

1. ``add(name, tensor, target)`` for each layer: the engine routes it (its codec's exchange
   carries it, or our uncompressed round does); a layer the engine hands back (sent whole
   this step: ``Route.FRONT_END``) waits here for the buffer's averages. ``add_as_is`` takes a tensor
   the engine does not know (averaged as it is). ``took(name, out, route, target)`` records a
   layer a front end added to the engine itself, earlier (DDP's accumulation hooks).
2. ``send(label)`` at the end of each buffer: the ``Route.FRONT_END`` layers added since the last ``send``
   averaged in one collective per dtype (a float16 layer apart, not promoted to float32),
   issued in the same order on every rank (their levels agree, so do their dtypes).
   Once the policy has settled every layer at 16-bit dense for good, a front end may send a
   flat buffer whole instead: ``send_whole(key, buffer, half, target)`` with the engine's
   ``add_whole`` (engine/whole.py).
3. ``finish(agree_over)`` once every buffer is in: wait for the averages, finish every
   layer, agree on a fault over ``agree_over`` (HSDP's node: each column finds the faults in
   its own data only), end the engine's step.
   Returns ``(target, result)`` per layer and the targets of the whole buffers; the front end
   writes them where its framework reads them. After ``end_step``: a skipped step's results
   are zero by then.
"""

from __future__ import annotations

from typing import Any

import torch

from .comm.channel import Channel
from .engine import Route, StepEngine


class BufferedStep:
    """The step in flight (module doc); one per front end, reused step after step. Its
    averages go on the engine's data plane (the one the front end bound, else the default).
    ``prefix`` names its collectives (``acc.ddp``: ``acc.ddp.dense.b3.float32.12``)."""

    def __init__(self, engine: StepEngine, prefix: str) -> None:
        self.engine, self.prefix = engine, prefix
        self._reset()

    @property
    def channel(self):
        return self.engine.channel

    def _reset(self) -> None:
        # per layer: (name or None for a tensor averaged as it is, route, (send, dtype, index) or None, target)
        self._layers: list[tuple] = []
        self._pending: dict[torch.dtype, list[torch.Tensor]] = {}  # FRONT_END-route tensors not sent yet, by dtype
        self._sent: list[dict] = []    # per send(): dtype -> the handle of its average
        self._whole: list[tuple] = []  # per send_whole(): (key, buffer, handle, target)

    @property
    def empty(self) -> bool:
        """Nothing added this step yet."""
        return not self._layers and not self._whole and not self._pending

    @property
    def sent_whole(self) -> int:
        """Buffers sent whole this step so far."""
        return len(self._whole)

    # --- 1. add ------------------------------------------------------------------------------
    def add(self, name: str, tensor: torch.Tensor, target: Any, *, uncompressed_here: bool = False) -> None:
        """Layer ``name`` into the engine (``uncompressed_here`` as ``engine.add``'s); its result
        comes back from ``finish`` with ``target``."""
        out, route = self.engine.add(name, tensor, uncompressed_here=uncompressed_here)
        self.took(name, out, route, target)

    def took(self, name: str, out: torch.Tensor | None, route: Route, target: Any) -> None:
        """A layer the front end gave the engine itself (``out, route`` as ``engine.add`` returned)."""
        self._layers.append((name, route, self._average(out) if route == Route.FRONT_END else None, target))

    def add_as_is(self, tensor: torch.Tensor, target: Any) -> None:
        """A tensor the engine does not know (DDP: a parameter added after registration),
        averaged as it is."""
        self._layers.append((None, Route.FRONT_END, self._average(tensor), target))

    def _average(self, tensor: torch.Tensor) -> tuple:
        group = self._pending.setdefault(tensor.dtype, [])
        group.append(tensor)
        return len(self._sent), tensor.dtype, len(group) - 1

    # --- 2. send -----------------------------------------------------------------------------
    def send(self, label: str) -> None:
        """Issue the averages of the ``Route.FRONT_END`` layers added since the last ``send``."""
        pending, self._pending = self._pending, {}
        self._sent.append({dtype: self.channel.allreduce_mean_async(
            tensors, name=f"{self.prefix}.dense.{label}.{str(dtype).removeprefix('torch.')}.{len(tensors)}")
            for dtype, tensors in sorted(pending.items(), key=lambda item: str(item[0]))})

    def send_whole(self, key: str, buffer: torch.Tensor, half: torch.Tensor, target: Any) -> None:
        """Average ``half`` (``engine.add_whole(key, buffer, ...)``'s) in one collective."""
        handle = self.channel.allreduce_mean_async([half], name=f"{self.prefix}.whole.{len(self._whole)}")
        self._whole.append((key, buffer, handle, target))

    # --- 3. finish ---------------------------------------------------------------------------
    def finish(self, agree_over: Channel | None = None) -> tuple[list, list]:
        """Every buffer is in: ``([(target, result) per layer], [target per whole buffer])``.
        ``agree_over``: a channel over which a fault any of its ranks found skips the step on
        all of them. HSDP's node: each column finds the faults in its own data, and a node
        holds one rank of each column, so one reduction inside the node gives every rank the
        verdict without crossing the slow link. The flag stays on the device (no host read)."""
        if self._pending:
            self.send("last")
        layers, sent, whole = self._layers, self._sent, self._whole
        self._reset()
        wholes = []
        for key, buffer, handle, target in whole:
            self.engine.finish_whole(key, buffer, self.channel.wait(handle)[0])
            wholes.append(target)
        averages = [{dtype: self.channel.wait(handle) for dtype, handle in handles.items()} for handles in sent]
        results = []
        for name, route, where, target in layers:
            average = None if where is None else averages[where[0]][where[1]][where[2]]
            results.append((target, average if name is None else self.engine.finish(route, name, average)))
        if agree_over is not None:
            named = [result for (name, *_), (_, result) in zip(layers, results) if name is not None]
            device = (named[0].device if named else whole[0][1].device if whole else torch.device("cpu"))
            bad = self.engine.step_fault()
            flag = torch.zeros((), device=device) if bad is None else bad.to(device=device, dtype=torch.float32)
            handle = agree_over.allreduce_mean_async([flag], name=f"{self.prefix}.fault")
            self.engine.saw_fault(agree_over.wait(handle)[0] > 0)
        self.engine.end_step()
        return results, wholes
