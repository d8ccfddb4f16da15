"""Sign: 1 bit per entry and one scale per layer, with error feedback on both sides.

The compressed all-reduce of 1-bit Adam (Tang et al., ICML 2021; DeepSpeed's
``compressed_allreduce``), per layer and step:

    g = x + e                          the worker's error feedback e (flat, float32)
    s = ||g|| / sqrt(n)                one float32 scale: the RMS of g
    send s and sign(g)                 1 bit per entry (0 counts as +1)
    e = g - s * sign(g)                (once the step is known not to be skipped)

    a = mean_r(s_r * sign(g_r))        every rank's message, decoded and averaged
    z = a + f                          the server side's error feedback f
    result = ||z|| / sqrt(n) * sign(z)
    f = z - result

The second compression is DeepSpeed's server side. There each rank owns a slice of the layer,
compresses its slice of the average and gathers the slices again; here every rank gathers
every message (exchange/sign.py: one allgather per bucket) and computes the server side for
the whole layer, alike on every rank, so every rank keeps the same ``f`` and no second round
crosses the network. Why keep it at all, when the exact average is at hand: the result is
what 1-bit Adam's momentum becomes, and in issue 80's pilots an exact average of the ranks'
signs stalled (benchmarks/results/explore-v5/README.md). What crosses the wire per rank and
step is 4 + n/8 bytes per layer (padded to 4 bytes); every rank receives every other's, so a
step costs each rank ``(ranks - 1)`` messages: the right exchange for few ranks (the slow
link between a few nodes), not for hundreds.

Layers of fewer than 2 dimensions or fewer than ``min_numel`` entries (biases, norms) go
dense: one sign and one scale for a bias vector costs more quality than its bytes save.
A policy's whole-layer level (``DENSE16``: the link gate) sends the layer in float16.

The plain-torch reference of the math is ``reference.sign_ef`` / ``reference.sign_average``;
the compiled kernels (csrc/cpu/sign.cpp) are held to it by tests/test_sign.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import ops
from ..levels import DENSE16, NORMAL, Level, check_level, positive_number
from ._common import flush_whole, residual_dtype, settle_sent, whole_layer_work
from .base import Codec

_SHIFTS: dict[torch.device, torch.Tensor] = {}


@dataclass
class SignState:
    name: str
    shape: torch.Size
    level: Level
    residual: torch.Tensor          # the worker's e, flat; holds g = x + e from ``encode`` to ``settle``
    server: torch.Tensor            # the server side's f, flat (the same on every rank)
    sent: torch.Tensor | None = None         # this rank's payload of the step in flight
    server_next: torch.Tensor | None = None  # f after the step in flight, kept if it goes through


class Sign(Codec):
    """Args:
        min_numel: layers with fewer entries, or fewer than 2 dimensions, are sent dense (1024).
    """

    levels = (NORMAL,)
    measures_gain = False
    adaptive = False

    def __init__(self, *, min_numel: int = 1024) -> None:
        self.min_numel = positive_number("min_numel", min_numel, integer=True)

    def __repr__(self) -> str:
        return f"Sign(min_numel={self.min_numel})"

    def config(self) -> dict:
        return {"codec": "sign", "min_numel": self.min_numel}

    # --- which layers, and what they cost ---------------------------------------------------
    def compressible(self, shape: torch.Size) -> bool:
        return len(shape) >= 2 and math.prod(shape) >= self.min_numel

    @staticmethod
    def payload_bytes(numel: int) -> int:
        """One rank's payload for a layer: its float32 scale, then one bit per entry, padded to
        a multiple of 4 bytes (csrc/ops.h ``sign_payload_bytes``, the layout the kernels write)."""
        return 4 + -(-numel // 32) * 4

    def floats_sent(self, state: SignState) -> int:
        """In float32 equivalents (the payload's bytes over 4)."""
        numel = state.residual.numel()
        return numel if state.level == DENSE16 else self.payload_bytes(numel) // 4

    def wire(self, shape: torch.Size, level: Level, itemsize: int = 4) -> tuple[tuple[str, int], ...]:
        numel = math.prod(shape)
        if level == DENSE16:
            return (("dense", min(itemsize, 2) * numel),)
        return (("allgather", self.payload_bytes(numel)),)

    def kernel_work(self, shape: torch.Size, level: Level, itemsize: int = 4) -> tuple[float, ...]:
        """g = grad + e (3 passes) and its norm and signs (1 and 1/32); then every rank's
        message decoded into the mean (1 pass), the server side (4) and e settled (2)."""
        numel = math.prod(shape)
        if level == DENSE16:
            return whole_layer_work(numel, level, itemsize)
        return 4.0 * numel * itemsize + numel / 8, 7.0 * numel * itemsize + numel / 8

    # --- state --------------------------------------------------------------------------------
    def init_state(self, name: str, grad: torch.Tensor, level: Level = NORMAL) -> SignState:
        dtype = residual_dtype(grad.dtype)
        zeros = lambda: torch.zeros(grad.numel(), dtype=dtype, device=grad.device)  # noqa: E731
        return SignState(name, grad.shape, level, zeros(), zeros())

    def set_level(self, state: SignState, level: Level) -> None:
        check_level("level", level, allowed=self.levels + (DENSE16,))
        state.level = level

    def state_to_dict(self, state: SignState) -> dict:
        return {"shape": list(state.shape), "level": state.level.to_state(), "residual": state.residual.clone(),
                "server": state.server.clone()}

    def state_from_dict(self, name: str, d: dict) -> SignState:
        shape, level = torch.Size(d["shape"]), Level.from_state(d["level"])
        flat = (math.prod(shape),)
        residual, server = d["residual"], d.get("server")
        if (level not in self.levels + (DENSE16,) or tuple(residual.shape) != flat
                or not isinstance(server, torch.Tensor) or tuple(server.shape) != flat):
            raise ValueError(f"Sign state of {name!r} does not fit this codec: level {level!r}, residual "
                             f"{tuple(residual.shape)}, server {getattr(server, 'shape', server)} (expected {flat})")
        return SignState(name, shape, level, residual.clone(), server.clone())

    # --- a step -------------------------------------------------------------------------------
    def sends_dense(self, state: SignState) -> bool:
        """DENSE16 (a policy's whole-layer level): float16 through the front end's allreduce."""
        return state.level == DENSE16

    def flush_dense(self, state: SignState, grad: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        return flush_whole(state.residual, grad, state.level, finite)

    @staticmethod
    def settle_dense(state: SignState, sent_dtype: torch.dtype, done: torch.Tensor) -> None:
        settle_sent(state.residual, sent_dtype, done)

    def encode(self, state: SignState, x: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        """g = x + e into the worker's residual (not if ``finite`` is False: then g = e and the
        scale sent is NaN); returns this rank's payload bytes."""
        state.sent = encode_sign(x.reshape(-1), state.residual, finite)
        return state.sent

    def decode(self, state: SignState, rows: torch.Tensor, grad_dtype: torch.dtype) -> torch.Tensor:
        """Every rank's payload (a (ranks, bytes) uint8 block) -> the server side's message of
        their mean (module doc), in the gradient's dtype and shape; ``f`` after it waits in
        ``server_next`` for ``settle``."""
        numel = state.residual.numel()
        mean = average_signs(rows, numel)
        z = state.server.clone()
        own = encode_sign(mean, z, torch.ones((), dtype=torch.bool, device=z.device))  # z = mean + f
        out = average_signs(own.unsqueeze(0), numel)
        state.server_next = z.sub_(out)
        return out.to(grad_dtype).view(state.shape)

    def settle(self, state: SignState, done: torch.Tensor) -> None:
        """End of step: where it went through (``done``), e = g - s * sign(g) and f = z - result;
        else e keeps g and f is unchanged."""
        sent = average_signs(state.sent.unsqueeze(0), state.residual.numel())
        state.residual.sub_(torch.where(done, sent, torch.zeros_like(sent)))
        if state.server_next is not None:  # (no result was read if the step was dropped)
            state.server.copy_(torch.where(done, state.server_next, state.server))
        state.sent = state.server_next = None


def encode_sign(x: torch.Tensor, residual: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """``residual`` becomes g = x + residual (not where ``finite`` is False); returns the payload
    (``reference.sign_ef``'s layout): the compiled kernel where the device has one, else torch ops."""
    if residual.dtype == torch.float32 and ops.has_kernel(residual, "sign_ef_"):
        return ops.sign_ef_(x, residual, finite)
    g = ops.ef_add_(x, residual, finite)
    n = g.numel()
    scale = (g.double().square().sum() / max(n, 1)).sqrt().float()
    scale = torch.where(finite, scale, float("nan")).reshape(1)
    bits = torch.nn.functional.pad((g >= 0).to(torch.uint8), (0, -(-n // 32) * 32 - n)).view(-1, 8)
    packed = (bits << _shifts(g.device)).sum(dim=1, dtype=torch.uint8)
    return torch.cat([scale.view(torch.uint8), packed])


def average_signs(rows: torch.Tensor, numel: int) -> torch.Tensor:
    """The mean over the rows (one payload each) of ``s * (+1 or -1)``, float32, added in rank
    order (``reference.sign_average``'s arithmetic)."""
    if ops.has_kernel(rows, "sign_average") and rows.stride(-1) == 1:
        return ops.sign_average(rows, numel, torch.float32)
    total = torch.zeros(numel, dtype=torch.float32, device=rows.device)
    for row in rows:
        scale = row[:4].clone().view(torch.float32)
        bits = ((row[4:].unsqueeze(1) >> _shifts(row.device)) & 1).reshape(-1)[:numel]
        total += torch.where(bits.bool(), scale, -scale)
    return total / torch.full((), rows.shape[0], dtype=torch.float32, device=rows.device)


def _shifts(device: torch.device) -> torch.Tensor:
    if device not in _SHIFTS:
        _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return _SHIFTS[device]
