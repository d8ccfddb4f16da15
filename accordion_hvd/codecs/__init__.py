"""Codecs: the math of compression with error feedback, per layer, with explicit state.

A codec never communicates: it turns a gradient into what must be exchanged, and what was
exchanged back into a gradient, updating the layer's error feedback. The engine
(``accordion_hvd.engine``) runs the exchange in between. ``base.py`` holds the protocol
the engine asks of every codec.
"""

from .base import Codec, check_codec
from .powersgd import PowerSGD
from .quantize import Quantize
from .topk import TopK


def default_codec() -> PowerSGD:
    """The codec of ``AccordionCompressor()``: PowerSGD at rank 16, 32 in critical regimes.
    Why so gentle: time to quality (docs/time-to-quality.md). On the transformer language
    model rank 4 left out a third of each step's gradient energy and trailed 16-bit dense by
    about 1.8x in steps to the same validation perplexity; rank 16 leaves out about 9%
    (benchmarks/results/gradient-energy.md), and its bytes still hide on a 100 Mbit/s link
    behind most of a small model's step. Where they would not pay, the default policy (the
    link gate) sends 16-bit dense."""
    return PowerSGD(rank=16, critical_rank=32)


__all__ = ["Codec", "PowerSGD", "Quantize", "TopK", "check_codec", "default_codec"]
