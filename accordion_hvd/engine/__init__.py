"""The front-end-neutral step engine (engine.py) and its parts: its planes and exchanges
(planes.py), its calls between steps (between_steps.py), its settled route for flat buffers
(whole.py) and the step in flight (open_step.py); and what it uses: the codec and policy
resolved, gradients checked (checks.py), settings agreed across ranks (settings.py), learning
rates (learning_rates.py), level announcements (announce.py), checkpoints and statistics
(state.py). The front ends (accordion_hvd/horovod/, ddp.py, hsdp.py, diloco.py, elastic.py)
drive it."""

from . import state
from .engine import Route, StepEngine

__all__ = ["Route", "StepEngine", "state"]
