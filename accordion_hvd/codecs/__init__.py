"""Codecs: the math of compression with error feedback, per layer, with explicit state.

A codec never communicates: it turns a gradient into what must be exchanged, and what was
exchanged back into a gradient, updating the layer's error feedback. The adapter
(``accordion_hvd.compressor``) runs the exchange in between.
"""

from .powersgd import PowerSGD
from .topk import TopK

__all__ = ["PowerSGD", "TopK"]
