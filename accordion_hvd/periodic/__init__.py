"""The periodic wing: front ends whose ranks exchange less often than every optimizer step.

- ``DiLoCo`` (diloco.py): each rank takes inner steps with its own optimizer; a round every
  ``sync_every`` inner steps averages the ranks' pseudo-gradients through a compressor
  (``acc.Compressor``, the same codecs and error feedback as the per-step front ends) and an
  outer step moves every rank's model alike. ``sync_every="auto"`` asks ``SyncInterval``
  (interval.py, the rule) once per window of inner steps, on statistics measured by
  ``WindowStatistic`` (window.py) and reduced across ranks.
- ``OneBitAdam`` (onebit_adam.py): Adam's step exchanged every step, after a warm-up, as the
  signs of its momentum with a scale and error feedback (the second moment frozen).
- checks.py (arguments, sharding, the same start on every rank, the inner step before each
  ``step()``), job.py (a compressor bound to every rank of the job) and tensors.py (a rank's
  shard of a parameter, a model swapped in, a norm), shared by both.

One round of DiLoCo, on every rank (diloco.py ``sync``):

    inner steps (local) ──► pseudo-gradient = start - local ──► compressor: average over ranks
          ▲                                                          │
          └── local = start ◄── start = outer step(start, average) ◄─┘
                                 (the outer optimizer: Nesterov SGD, or ``outer_optimizer=``)

The wing depends on the compressor, the buffered step and communication below it; nothing
below imports it, and it imports nothing of the Horovod wing (tests/test_architecture.py).
"""

from .diloco import DiLoCo
from .interval import IntervalReport, SyncInterval
from .onebit_adam import OneBitAdam

__all__ = ["DiLoCo", "IntervalReport", "OneBitAdam", "SyncInterval"]
