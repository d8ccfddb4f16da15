"""Which exchange carries which codec: the one place that pairs them.

A codec's exchange module registers its pair when it is imported (``register``), and the
engine asks ``make_exchange`` for the exchange of whatever codec it was given, so neither
the engine nor a front end names a concrete codec. A new codec family registers its own
exchange the same way, without editing either.
"""

from __future__ import annotations

_EXCHANGES: dict[type, type] = {}


def register(codec_type: type, exchange_type: type) -> None:
    """Carry every codec of ``codec_type`` (and its subclasses) with ``exchange_type``."""
    from .base import Exchange

    if not isinstance(codec_type, type) or not isinstance(exchange_type, type):
        raise TypeError(f"register(codec_type, exchange_type) takes two classes, got {codec_type!r}, {exchange_type!r}")
    if not issubclass(exchange_type, Exchange):
        raise TypeError(f"register: {exchange_type.__name__} must subclass accordion_hvd.exchange.Exchange (the "
                        f"engine's contract, exchange/base.py)")
    _EXCHANGES[codec_type] = exchange_type


def exchange_for(codec) -> type:
    """The exchange class registered for ``codec``'s class or the nearest of its bases."""
    for klass in type(codec).__mro__:
        if klass in _EXCHANGES:
            return _EXCHANGES[klass]
    raise TypeError(f"no exchange is registered for codec {type(codec).__name__}; register one with "
                    f"accordion_hvd.exchange.register({type(codec).__name__}, YourExchange)")


def make_exchange(codec, channel, *, first_cap: int, cap: int, counters, per_step: bool):
    """The exchange of ``codec`` on ``channel``, given what the engine shares with every
    exchange: bucket caps, its counters (accordion_hvd/counters.py), and whether the policy
    decides per step (the engine then asks the controller between ``gains`` and ``results``)."""
    return exchange_for(codec)(codec, channel, first_cap=first_cap, cap=cap, counters=counters, per_step=per_step)
