"""Which data and control planes a compressor uses when its front end gives none (Horovod's).

Data plane: our own Gloo group over Horovod's ranks for CPU gradients (a collective starts
the moment it is issued, no negotiation cycle: comm/gloo.py), Horovod's own collectives for
GPU ones; $ACCORDION_DATA_PLANE ("gloo" or "horovod") overrides. Control plane (the
controller's reductions): the data plane's own when it has one (the simulated world), else
comm/control.py's choice.
"""

from __future__ import annotations

import os

DATA_PLANE_ENV = "ACCORDION_DATA_PLANE"


def default_data_plane(device_type: str):
    """The data plane for gradients on ``device_type`` ("cpu" or "cuda")."""
    choice = os.environ.get(DATA_PLANE_ENV, "auto").strip().lower() or "auto"
    if choice not in ("auto", "gloo", "horovod"):
        raise ValueError(f"{DATA_PLANE_ENV} must be 'auto', 'gloo' or 'horovod', got {choice!r}")
    if choice == "gloo" or (choice == "auto" and device_type == "cpu"):
        from .gloo import GlooChannel
        return GlooChannel()
    from .horovod import HorovodChannel
    return HorovodChannel()


def default_control_plane(channel):
    """The control plane that goes with ``channel``."""
    make = getattr(channel, "control_plane", None)  # the simulated world has its own
    if make is not None:
        return make()
    from .control import control_plane
    return control_plane("auto")
