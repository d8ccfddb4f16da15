"""The front-end-neutral step engine (engine.py, with its planes and exchanges in planes.py,
its calls between steps in between_steps.py and its settled route for flat buffers in
whole.py), and what it is made of: the codec and policy resolved, gradients checked
(checks.py), settings agreed across ranks (settings.py), learning rates
(learning_rates.py), level announcements (announce.py), checkpoints and statistics
(state.py). The front ends (accordion_hvd/horovod/, ddp.py, elastic.py) drive it."""

from . import state
from .engine import COMPRESSED, DENSE, UNCOMPRESSED, StepEngine

__all__ = ["COMPRESSED", "DENSE", "UNCOMPRESSED", "StepEngine", "state"]
