"""The exchange engine: how each codec's compressed gradients cross the network in a step.

* ``buckets``: the first round of every codec, by buckets of layers in the order their
  gradients become ready (DDP's cut), with the layout agreed by all ranks;
* ``powersgd``: PowerSGD's P and Q rounds per bucket, pipelined with backward;
* ``topk``: TopK's packed allgather of values and indices per bucket (and a per-step
  policy's choice, such as GraVAC's).

Each codec's exchange is a small object with the same four calls, which the Horovod adapter
(compressor.py) drives without knowing the codec: ``add(name, state, grad, finite)`` as each
gradient arrives, ``results()`` at the first decompress, ``end_step(skipped)`` to commit the
step's error feedback or roll it back, ``abort()`` when Elastic drops a step.
"""

from .buckets import (BUCKET_BYTES, FIRST_BUCKET_BYTES, Round1, agree_layout, arrived, bytes_of, lane,
                      plan_buckets, split_bytes)
from .powersgd import PowerSGDExchange
from .topk import TopKExchange


def make_exchange(codec, channel, *, first_cap: int, cap: int, before_last, seconds, per_step, control, sent):
    """The exchange of ``codec`` (an ``acc.PowerSGD`` or ``acc.TopK``) on ``channel``; what
    the adapter shares with it: bucket caps, the learning-rate gather to issue after the last
    bucket, its seconds counters, and when the policy decides per step, the regime
    controller (``per_step``), the control plane (a callable) and the floats-sent counters."""
    from ..codecs import PowerSGD, TopK

    common = dict(first_cap=first_cap, cap=cap, before_last=before_last, seconds=seconds)
    if isinstance(codec, PowerSGD):
        return PowerSGDExchange(codec, channel, **common)
    if isinstance(codec, TopK):
        return TopKExchange(codec, channel, **common, per_step=per_step, control=control, sent=sent)
    raise TypeError(f"no exchange for codec {type(codec).__name__}")


__all__ = ["BUCKET_BYTES", "FIRST_BUCKET_BYTES", "PowerSGDExchange", "Round1", "TopKExchange", "agree_layout",
           "arrived", "bytes_of", "lane", "make_exchange", "plan_buckets", "split_bytes"]
