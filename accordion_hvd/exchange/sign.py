"""Sign's exchange: Quantize's, one allgather per bucket of every layer's payload.

A Sign payload (codecs/sign.py: a float32 scale and one bit per entry) has, like Quantize's,
a length fixed by the layer and its level, the same on every rank; the codec decodes the
gathered rows (and runs the server side of the compression, alike on every rank) and settles
both of its error feedbacks at the end of the step. Only the collectives' names differ.
"""

from __future__ import annotations

from ..codecs.sign import Sign
from .quantize import QuantizeExchange
from .registry import register


class SignExchange(QuantizeExchange):
    """Sign's exchange (module doc; the contract and the arguments: exchange/base.py)."""

    round1_kind, round1_prefix = "allgather", "acc.sign"


register(Sign, SignExchange)
