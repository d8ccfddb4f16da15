"""Codecs: the math of compression with error feedback, per layer, with explicit state.

A codec never communicates: it turns a gradient into what must be exchanged, and what was
exchanged back into a gradient, updating the layer's error feedback. The engine
(``accordion_hvd.engine``) runs the exchange in between. ``base.py`` holds the protocol
the engine asks of every codec.
"""

from .base import Codec, check_codec
from .powersgd import PowerSGD
from .quantize import Quantize
from .sign import Sign
from .topk import TopK


def default_codec() -> Quantize:
    """The codec of ``AccordionCompressor()``: 8 bits per entry in sparse chunks, the chunks
    holding 95% of a step's energy sent, the rest waiting in error feedback
    (``Quantize(8, skip_energy=0.05)``). Why: time to quality (docs/time-to-quality.md,
    evidence-v2 amendment 8). Under the default policy (the link gate, which sends 16-bit
    dense where a compressed step is not measurably shorter) it reached 16-bit dense's quality
    sooner than any other configuration measured, on both language models: 8 bits lose almost
    nothing a step, and a language model's bytes are mostly its embedding, whose gradient
    lives in the rows of the tokens a batch holds. PowerSGD at rank 16 (the default before)
    stepped as fast but lost quality a step that it never made up on the transformer."""
    return Quantize(8, skip_energy=0.05)


__all__ = ["Codec", "PowerSGD", "Quantize", "Sign", "TopK", "check_codec", "default_codec"]
