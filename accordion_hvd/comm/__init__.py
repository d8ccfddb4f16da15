"""Communication: who talks to whom. Codecs never communicate; the engine talks through a
``Channel``: Horovod's collectives in real runs, an in-process simulation in unit tests."""

from .channel import Channel, Handle
from .simulated import SimulatedWorld

__all__ = ["Channel", "Handle", "SimulatedWorld"]
