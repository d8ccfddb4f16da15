"""A compressor bound to the whole job's ranks: shared by the front ends that own their
exchange (``acc.DiLoCo`` without a mesh, ``acc.OneBitAdam``).

Under torchrun: new process groups of every rank (made in the same order on every rank, as
the DDP front end's): one for the data with the default group's backend and ``lanes``, and a
Gloo one for control. Under horovodrun: the compressor's default planes over Horovod's world
(comm/planes.py), as under ``hvd.DistributedOptimizer``.
"""

from __future__ import annotations

from ..binding import bind_planes


def bind_to_job(compressor, owner, optimizer, device_type: str, timeout: float, who: str,
                lanes: tuple[str, ...] = ("q", "dense"), settings: dict | None = None) -> int:
    """Bind ``compressor`` to ``owner`` over every rank of the job; returns the number of
    ranks. ``who`` names the front end (``acc.WHO`` in refusals; alone in the error when no
    job is running); ``settings``, the front end's own that every rank must share."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        ranks = list(range(dist.get_world_size()))
        bind_planes(compressor, owner, ranks, timeout, lanes=lanes, backend=dist.get_backend(), optimizer=optimizer,
                    speaks=dist.get_rank() == 0, front_end=f"acc.{who}", settings=settings)
        return len(ranks)
    size = horovod_size()
    if size is None:
        raise RuntimeError(f"{who} needs torch.distributed initialized (dist.init_process_group, under torchrun) "
                           f"or Horovod (hvd.init(), under horovodrun)")
    compressor.bind(owner, channel=None, control=None, optimizer=optimizer, front_end=f"acc.{who}", settings=settings,
                    device_type=device_type)  # the device picks the default data plane
    return size


def horovod_size() -> int | None:
    """Horovod's world size, if Horovod is initialized in this process."""
    try:
        import horovod.torch as hvd
    except ImportError:
        return None
    return hvd.size() if hvd.is_initialized() else None
