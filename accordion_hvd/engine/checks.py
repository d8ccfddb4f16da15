"""Checks: the codec and policy a compressor runs, resolved from what the user gave and
checked against each other before anything runs; and each gradient against its layer."""

from __future__ import annotations

from typing import Any

import torch

from ..codecs import check_codec, default_codec
from ..codecs.base import NETWORK, residual_dtype
from ..exchange import exchange_for
from ..levels import positive_number
from ..policies import make_policy


def resolve(codec, policy: Any, eta: float, interval: int | None):
    """``(codec, policy, eta, interval)``: no codec means the default configuration (the
    default codec under the link gate, unless a policy is given)."""
    if isinstance(codec, type):  # acc.PowerSGD rather than acc.PowerSGD(...): say so, not "no exchange"
        raise TypeError(f"codec must be a codec instance, got the class {codec.__name__} "
                        f"itself; pass an instance, e.g. acc.{codec.__name__}(...) "
                        f"(acc.PowerSGD(rank=1), acc.TopK(ratio=0.01)), or no codec for the default")
    if codec is None:
        codec = default_codec()
        policy = "link-gate" if policy is None else policy
    check_codec(codec)  # the engine's protocol, and an exchange registered for it
    exchange_for(codec)
    eta = float(positive_number("eta", eta))
    interval = None if interval is None else positive_number("interval", interval, integer=True)
    policy = make_policy(policy, eta=eta, codec_adaptive=codec.adaptive, gate_pays=getattr(codec, "gate_pays", None))
    if policy.needs_two_levels and not codec.adaptive:
        raise ValueError(f"policy {policy!r} switches each layer between the codec's two levels, but {codec!r} "
                         f"has one; give the codec a gentler critical level (PowerSGD(rank=1, critical_rank=4), "
                         f"TopK(ratio=0.01, critical_ratio=0.1)) or pass policy='static'")
    if policy.per_step and not codec.measures_gain:
        raise ValueError(f"policy {policy!r} needs the TopK codec: it chooses a level every step from the "
                         f"compression gain, which only TopK measures; got {codec!r}")
    return codec, policy, eta, interval


def check_network(policy, codec, accumulate: bool) -> None:
    """A policy that measures the network needs the codec's cost hooks and window sums."""
    lacking = [name for name in NETWORK if not hasattr(codec, name)]
    if lacking:
        raise TypeError(f"policy {policy!r} measures the network, which needs the codec's "
                        f"{', '.join(NETWORK)} (accordion_hvd/codecs/base.py): {type(codec).__name__} lacks "
                        f"{', '.join(lacking)}")
    if not accumulate:
        raise ValueError(f"policy {policy!r} needs accumulate=True: it measures each level's error on "
                         f"the layer's gradient accumulated over the window")


def same_layer(name: str, layer, tensor: torch.Tensor) -> None:
    """A layer keeps its shape, device and dtype from step to step (its state was made for them)."""
    if layer.shape != tensor.shape:
        raise ValueError(f"AccordionCompressor: gradient of {name!r} changed shape from "
                         f"{tuple(layer.shape)} to {tuple(tensor.shape)}")
    if layer.residual.device != tensor.device or layer.residual.dtype != residual_dtype(tensor.dtype):
        raise ValueError(f"AccordionCompressor: gradient of {name!r} moved from {layer.residual.device} "
                         f"({layer.residual.dtype} error feedback) to {tensor.device} ({tensor.dtype}); "
                         f"a layer must keep its device and dtype")


def gradient(name: str, tensor) -> None:
    """A gradient handed to the engine is a CPU or CUDA tensor (else a clear error, naming it)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"AccordionCompressor: the gradient of {name!r} must be a torch.Tensor, "
                        f"got {type(tensor).__name__}")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"AccordionCompressor: the gradient of {name!r} is on device {tensor.device}; "
                         f"expected a CPU or CUDA tensor")
