"""The settled route: flat buffers sent whole in 16 bits, once nothing will be compressed again.

When the policy has put every layer at ``DENSE16`` for good (the link gate found that
compression does not pay on this job's link: policies/link_gate.py), the per-layer route still
costs host time for every layer of every step: routing, the controller's norms, a finite flag
and a cast per layer, the average issued and checked per layer: a visible share of a step
against FSDP's own all-reduce (measured: docs/design.md, "Measured reasons"). A front
end whose gradients arrive in flat buffers (FSDP2's reduce-scatter output, one per module)
then hands the engine each buffer instead:

1. ``add_whole(key, flat, layers)``: g = flat + e (``e``: the buffer's error feedback), returned
   in float16 (a 16-bit buffer as it is) for the front end's one collective; NaN where this
   rank's gradient was not finite, so the fault shows in the average on every rank.
2. ``finish_whole(key, flat, average)``: the average written into ``flat`` (its dtype), checked.
3. ``end_step`` settles each buffer's ``e`` (engine.py): what float16 rounded away, or all of
   g if the step was skipped; the skipped step's results are zero, as on the per-layer route.

The math is the per-layer route's at ``DENSE16`` (``flush_whole`` and ``settle_sent``, which
every codec uses for a layer sent whole), applied to the whole buffer: layers too small to
compress, sent in their own dtype on the per-layer route, go in float16 here too, their rounding
kept in ``e`` like the rest. A buffer's ``e`` starts as its layers' error feedback (the last
compressed trial's, flushed in the first whole step, as the per-layer route would flush it),
and is saved in the engine's checkpoint under its key.
"""

from __future__ import annotations

import torch

from ..codecs.base import flush_whole, residual_dtype, settle_sent, wire_dtype
from ..flags import finite_flag
from ..levels import DENSE16


class WholeBuffers:
    """Each buffer's layout and error feedback, and this step's buffers to settle.

    A buffer is known by its key and its layout ((name, numel) of its layers, in order). A
    front end's buffers may change their layout (DDP rebuilds its buckets after the first
    step): a buffer whose layout is new starts with each layer's error feedback from the
    buffer that held the layer until now, else from the layer's codec state (``layers``: the
    engine's, read-only), else zero; a buffer none of whose layers it still holds is dropped."""

    def __init__(self, layers: dict) -> None:
        self._buffers: dict[str, tuple[tuple, torch.Tensor]] = {}  # key -> (layout, e)
        self._holder: dict[str, tuple[str, int, int]] = {}  # layer -> (key, offset, numel) of the buffer holding it
        self._layers = layers
        self._step: list[tuple[torch.Tensor, torch.dtype]] = []  # (e, wire dtype) of this step's buffers

    @property
    def names(self) -> set[str]:
        """The layers sent in a buffer (stats: their level is DENSE16)."""
        return set(self._holder)

    def add(self, key: str, flat: torch.Tensor, layers: list[tuple[str, int]], finite: torch.Tensor) -> torch.Tensor:
        layout = tuple((str(name), int(numel)) for name, numel in layers)
        known = self._buffers.get(key)
        if known is None or known[0] != layout:
            e = self._seed(key, flat, layout)
        else:
            e = known[1]
            if e.device != flat.device:  # loaded from a checkpoint on the host
                e = e.to(flat.device)
                self._buffers[key] = (layout, e)
        self._step.append((e, wire_dtype(DENSE16, flat.dtype)))
        return flush_whole(e, flat, DENSE16, finite)

    def _seed(self, key: str, flat: torch.Tensor, layout: tuple) -> torch.Tensor:
        if sum(numel for _, numel in layout) != flat.numel():
            raise ValueError(f"add_whole: the layers given hold {sum(n for _, n in layout)} elements, "
                             f"the buffer {flat.numel()}")
        e = torch.zeros(flat.numel(), dtype=residual_dtype(flat.dtype), device=flat.device)
        offset = 0
        for name, numel in layout:
            held = self._holder.get(name)
            state = self._layers.get(name)
            if held is not None and held[2] == numel:
                source = self._buffers[held[0]][1]
                e[offset:offset + numel].copy_(source[held[1]:held[1] + numel])
            elif state is not None and state.residual.numel() == numel:
                e[offset:offset + numel].copy_(state.residual.reshape(-1))
            offset += numel
        self._register(key, layout, e)
        return e

    def _register(self, key: str, layout: tuple, e: torch.Tensor) -> None:
        self._buffers[key] = (layout, e)
        offset = 0
        for name, numel in layout:
            self._holder[name] = (key, offset, numel)
            offset += numel
        holding = {k for k, _, _ in self._holder.values()}
        for stale in [k for k in self._buffers if k not in holding]:
            del self._buffers[stale]

    def settle(self, done: torch.Tensor) -> None:
        """End of step: ``done`` (0-d bool) False for a skipped step."""
        for e, sent in self._step:
            settle_sent(e, sent, done)
        self._step = []

    def forget_step(self) -> None:
        """An aborted step: its buffers' g stays in their error feedback, as a skipped step's."""
        self._step = []

    def state_dict(self) -> dict[str, dict]:
        return {key: {"layers": [list(layer) for layer in layout], "e": e.clone()}
                for key, (layout, e) in sorted(self._buffers.items())}

    @staticmethod
    def parse(state: dict) -> dict[str, tuple[tuple, torch.Tensor]]:
        """A checkpoint's buffers, checked (ValueError), changing nothing."""
        parsed = {}
        for key, entry in state.items():
            layout = tuple((str(name), int(numel)) for name, numel in entry["layers"])
            e = entry["e"]
            if not isinstance(e, torch.Tensor) or e.dim() != 1 or not e.is_floating_point():
                raise ValueError(f"the error feedback of buffer {key!r} is not a flat float tensor")
            if e.numel() != sum(numel for _, numel in layout):
                raise ValueError(f"the error feedback of buffer {key!r} has {e.numel()} elements, its layers "
                                 f"{sum(numel for _, numel in layout)}")
            if not bool(torch.isfinite(e).all()):
                raise ValueError(f"the error feedback of buffer {key!r} is not finite")
            parsed[str(key)] = (layout, e.clone())
        return parsed

    def load(self, parsed: dict[str, tuple[tuple, torch.Tensor]]) -> None:
        self._buffers.clear()
        self._holder.clear()
        for key, (layout, e) in parsed.items():
            self._register(key, layout, e)
        self._step = []


class WholeRoute:
    """The engine's calls for the settled route (module doc): a part with its buffers
    (``buffers``, a ``WholeBuffers``), handed the engine's policy, fault record, counters and
    step record (engine/open_step.py) at construction; the engine's ``end_step`` settles it."""

    def __init__(self, buffers: WholeBuffers, *, policy, faults, counters, step) -> None:
        self.buffers, self.policy, self.faults, self.counters, self.step = buffers, policy, faults, counters, step

    @property
    def settled_dense(self) -> bool:
        """Whether the policy has put every layer at 16-bit dense for good (the same on every
        rank): ``add`` may carry flat buffers from now on."""
        return self.policy.settled_level == DENSE16

    @torch.no_grad()
    def add(self, key: str, flat: torch.Tensor, layers: list[tuple[str, int]]) -> torch.Tensor:
        """Once ``settled_dense``: buffer ``key`` (a flat float tensor holding ``layers``, (name,
        numel) in order) sent whole. Returns the 16-bit tensor the front end averages; its
        average goes to ``finish``."""
        if not self.settled_dense:
            raise RuntimeError("AccordionCompressor: add_whole before the policy settled every layer at 16-bit dense")
        if flat.dim() != 1 or not flat.is_floating_point():
            raise ValueError(f"AccordionCompressor: buffer {key!r} must be a flat float tensor, got "
                             f"{flat.dim()}-D {flat.dtype}")
        if key in self.step.in_flight:
            raise RuntimeError(f"AccordionCompressor: buffer {key!r} added twice in one step")
        self.step.in_flight.add(key)
        finite = finite_flag(flat)
        self.faults.local(key, finite)
        half = self.buffers.add(key, flat, layers, finite)
        itemsize, sent = flat.element_size(), half.element_size()
        for name, numel in layers:
            self.counters.gradient(name, numel, numel * itemsize)
            self.counters.floats(name, numel)
            self.counters.wire(name, numel * sent)
        return half

    def finish(self, key: str, flat: torch.Tensor, average: torch.Tensor) -> None:
        """Buffer ``key``'s average (of what ``add`` returned) written into ``flat``."""
        if key not in self.step.in_flight:
            raise RuntimeError(f"AccordionCompressor: no buffer {key!r} in flight")
        self.faults.seen(~finite_flag(average))
        flat.copy_(average.view_as(flat))
        self.step.outputs.append(flat)
        self.step.in_flight.discard(key)
