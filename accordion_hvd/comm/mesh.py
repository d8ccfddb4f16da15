"""HSDP's 2-D device mesh, as the front ends that synchronise across its nodes read it
(hsdp.py: every step; diloco.py: every round): ranks on a grid of ``replicate`` (nodes) x
``shard`` (the ranks of a node, each holding one shard of the model). The ranks holding the
same shard on every node, a *column*, average that shard; the data plane of a rank is its
column. The ranks of one node, a *row*, agree on whether a step (or round) is skipped: each
column finds the faults in its own data only."""

from __future__ import annotations

from .process_group import ProcessGroupChannel, new_channel

MESH_DIMS = ("replicate", "shard")


def check_mesh(mesh) -> None:
    """``mesh`` is a 2-D DeviceMesh with dimensions ("replicate", "shard"), else a ValueError
    naming the argument and what was expected."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
        got = (f"a {mesh.ndim}-D DeviceMesh with dimensions {mesh.mesh_dim_names}" if isinstance(mesh, DeviceMesh)
               else type(mesh).__name__)
        raise ValueError(f"mesh must be a 2-D DeviceMesh with dimensions {MESH_DIMS} (init_device_mesh(device, "
                         f"(nodes, ranks_per_node), mesh_dim_names={MESH_DIMS})), got {got}")


def column_channel(mesh, timeout: float, lanes: tuple[str, ...] = ("q", "dense")) -> ProcessGroupChannel:
    """This rank's column as a data plane, on new process groups (with ``lanes``). Every rank
    makes every column's groups, in the same order (``new_group`` is collective)."""
    import torch.distributed as dist

    backend = dist.get_backend(mesh.get_group("replicate"))
    channel = None
    for column in mesh.mesh.transpose(0, 1).tolist():  # one replicate group per shard index
        channel = new_channel(column, timeout, backend, lanes=lanes) or channel
    return channel


def node_channel(mesh, timeout: float) -> ProcessGroupChannel | None:
    """This rank's row (its node's shard group), on new process groups, for the agreement on a
    skipped step inside the node; None with one rank a node (a column is then the whole job).
    Every rank makes every row's group, in the same order (``new_group`` is collective)."""
    import torch.distributed as dist

    backend = dist.get_backend(mesh.get_group("replicate"))
    channel = None
    for row in mesh.mesh.tolist():  # one shard group per node
        channel = new_channel(row, timeout, backend) or channel
    return channel if mesh.size(1) > 1 else None
