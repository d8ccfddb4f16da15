"""The one place a front end's planes are made and its compressor bound to them, shared by
the DDP hook (ddp.py), HSDP (hsdp.py) and the periodic wing (periodic/job.py, DiLoCo across
HSDP's nodes).

The data plane is a channel of new process groups over ``ranks`` (the DDP model's group, the
job), or with ``mesh`` this rank's column (the ranks holding the same shard on the other
nodes, comm/mesh.py); the control plane a Gloo group over ``ranks`` (unless the front end
made one already). ``new_group`` is collective: every rank calls this in the same order as
its other group calls, so that every rank makes every group alike.
"""

from __future__ import annotations

from .comm.control import new_control_plane
from .comm.mesh import column_channel
from .comm.process_group import new_channel


def bind_planes(compressor, owner, ranks: list[int], timeout: float, *, lanes: tuple[str, ...], backend=None,
                mesh=None, control=None, optimizer=None, speaks: bool | None = None,
                front_end: str = "AccordionCompressor", settings: dict | None = None):
    """New planes for ``compressor``, bound to ``owner`` (``Compressor.bind``: the optimizer
    whose learning rates its policy reads, whether this rank speaks for the job, what the front
    end declares to the engine); returns the data plane."""
    channel = column_channel(mesh, timeout, lanes=lanes) if mesh is not None else \
        new_channel(ranks, timeout, backend, lanes=lanes)
    control = control if control is not None else new_control_plane(ranks, timeout)
    compressor.bind(owner, channel=channel, control=control, optimizer=optimizer, speaks=speaks,
                    front_end=front_end, settings=settings)
    return channel
