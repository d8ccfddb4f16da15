"""The Horovod front end, in one place: ``AccordionCompressor`` (compressor.py), how it finds
a gradient's parameter and Horovod's optimizer (seam.py), and everything it changes in
Horovod itself (patches.py), applied only when Horovod calls it."""

from .compressor import AccordionCompressor
from .patches import quiet_horovod_cycle

__all__ = ["AccordionCompressor", "quiet_horovod_cycle"]
