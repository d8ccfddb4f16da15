"""The exchange engine: how each codec's compressed gradients cross the network in a step.

* ``buckets``: the first round of every codec, by buckets of layers in the order their
  gradients become ready (DDP's cut), with the layout agreed by all ranks;
* ``powersgd``: PowerSGD's P and Q rounds per bucket, pipelined with backward;
* ``topk``: TopK's packed allgather of values and indices per bucket (and a per-step
  policy's choice, such as GraVAC's);
* ``quantize``: Quantize's allgather of scales and integers per bucket;
* ``sign``: Sign's, the same allgather of a scale and bits per layer.

Each codec's exchange is an ``Exchange`` (base.py: the written contract, the shared
constructor and the optional parts' defaults), which the step engine (engine/engine.py) drives
without knowing the codec (``registry.py`` pairs each codec with its exchange):
``add(name, state, grad, finite)`` as each gradient arrives, ``results()`` at the first
decompress, ``end_step(skipped)`` to commit the step's error feedback or roll it back,
``abort()`` when Elastic drops a step.
"""

from .buckets import (BUCKET_BYTES, FIRST_BUCKET_BYTES, Round1, agree_layout, arrived, bytes_of, lane,
                      plan_buckets, split_bytes)
from .base import Exchange
from .registry import exchange_for, make_exchange, register
from .powersgd import PowerSGDExchange  # noqa: E402 - each registers itself with its codec
from .quantize import QuantizeExchange  # noqa: E402
from .sign import SignExchange  # noqa: E402
from .topk import TopKExchange  # noqa: E402

__all__ = ["BUCKET_BYTES", "Exchange", "FIRST_BUCKET_BYTES", "PowerSGDExchange", "QuantizeExchange", "Round1", "SignExchange", "TopKExchange", "agree_layout",
           "arrived", "bytes_of", "exchange_for", "lane", "make_exchange", "plan_buckets", "register", "split_bytes"]
