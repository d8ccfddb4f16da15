"""Which data and control planes a compressor uses when its front end gives none (Horovod's).

Data plane, by the gradients' device (``choose_data_plane``, said once in the log):

* CPU gradients: our own Gloo group over Horovod's ranks (a collective starts the moment it
  is issued, no negotiation cycle: comm/gloo.py);
* CUDA gradients: an NCCL group over Horovod's ranks, built the same way (a GPU step then
  issues the same fixed collectives as a CPU step, with no Horovod negotiation); where the
  ranks of a node outnumber its GPUs (NCCL cannot put two ranks on one device) a Gloo group
  over the CUDA tensors instead; where this torch has no NCCL, Horovod's own collectives.

$ACCORDION_DATA_PLANE ("gloo", "nccl" or "horovod") overrides the choice. Control plane (the
controller's reductions): the data plane's own when it has one (the simulated world), else
comm/control.py's choice.
"""

from __future__ import annotations

import logging
import os

DATA_PLANE_ENV = "ACCORDION_DATA_PLANE"
PLANES = ("gloo", "nccl", "horovod")

log = logging.getLogger("accordion_hvd.comm")


def choose_data_plane(device_type: str, *, override: str = "auto", nccl_available: bool = False, gpus: int = 0,
                      ranks_per_node: int = 1) -> tuple[str, str]:
    """``(plane, why)``: the data plane for gradients on ``device_type`` ("cpu" or "cuda"),
    given the override ("auto" or one of ``PLANES``), whether torch has NCCL, the GPUs this
    node sees and how many ranks run on it."""
    if override != "auto":
        return override, f"${DATA_PLANE_ENV}={override}"
    if device_type == "cpu":
        return "gloo", "CPU gradients: a Gloo group over Horovod's ranks"
    if not nccl_available:
        return "horovod", "CUDA gradients, and this torch has no NCCL: Horovod's own collectives"
    if gpus < ranks_per_node:
        return "gloo", (f"CUDA gradients, but {ranks_per_node} ranks share {gpus} GPU(s) on this node and NCCL "
                        f"needs one GPU per rank: a Gloo group over the CUDA tensors")
    return "nccl", "CUDA gradients: an NCCL group over Horovod's ranks"


def default_data_plane(device_type: str):
    """The data plane for gradients on ``device_type``, built (see module doc)."""
    override = os.environ.get(DATA_PLANE_ENV, "auto").strip().lower() or "auto"
    if override not in ("auto", *PLANES):
        raise ValueError(f"{DATA_PLANE_ENV} must be 'auto', 'gloo', 'nccl' or 'horovod', got {override!r}")
    facts = {}
    if device_type == "cuda" and override == "auto":
        import horovod.torch as hvd
        import torch
        import torch.distributed as dist
        facts = {"nccl_available": dist.is_nccl_available(), "gpus": torch.cuda.device_count(),
                 "ranks_per_node": hvd.local_size()}
    plane, why = choose_data_plane(device_type, override=override, **facts)
    log.info("data plane: %s (%s)", plane, why)
    if plane == "horovod":
        from .horovod import HorovodChannel
        return HorovodChannel()
    from .gloo import GlooChannel
    return GlooChannel(backend=plane)


def default_control_plane(channel):
    """The control plane that goes with ``channel``."""
    own = channel.control_plane()  # the simulated world's, a Gloo channel's
    if own is not None:
        return own
    from .control import control_plane
    return control_plane("auto")
