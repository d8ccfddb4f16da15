"""Which data plane the Horovod front end builds (accordion_hvd/comm/planes.py): Gloo for CPU
gradients; for CUDA ones NCCL, Gloo over the CUDA tensors where a node's ranks outnumber its
GPUs, Horovod's collectives where torch has no NCCL; the environment overrides. The choice
is a pure function of those facts, checked here for every case; the NCCL group itself can
only be built on a GPU machine (scripts/gpu_check.sh)."""

import pytest

from accordion_hvd.comm import planes
from accordion_hvd.comm.planes import choose_data_plane


@pytest.mark.parametrize("device,facts,plane,said", [
    ("cpu", {}, "gloo", "CPU gradients"),
    ("cpu", {"nccl_available": True, "gpus": 8, "ranks_per_node": 8}, "gloo", "CPU gradients"),
    ("cuda", {"nccl_available": True, "gpus": 8, "ranks_per_node": 8}, "nccl", "NCCL group"),
    ("cuda", {"nccl_available": True, "gpus": 8, "ranks_per_node": 4}, "nccl", "NCCL group"),
    ("cuda", {"nccl_available": True, "gpus": 1, "ranks_per_node": 2}, "gloo", "2 ranks share 1 GPU"),
    ("cuda", {"nccl_available": False, "gpus": 8, "ranks_per_node": 8}, "horovod", "no NCCL"),
])
def test_the_plane_follows_the_device_and_what_the_node_has(device, facts, plane, said):
    got, why = choose_data_plane(device, **facts)
    assert got == plane and said in why


@pytest.mark.parametrize("override", planes.PLANES)
def test_the_environment_overrides_whatever_the_device(override):
    for device in ("cpu", "cuda"):
        assert choose_data_plane(device, override=override, nccl_available=False)[0] == override


def test_a_bad_override_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(planes.DATA_PLANE_ENV, "mpi")
    with pytest.raises(ValueError, match="ACCORDION_DATA_PLANE must be 'auto', 'gloo', 'nccl' or 'horovod'"):
        planes.default_data_plane("cpu")


def test_the_gloo_channel_takes_only_gloo_or_nccl():
    from accordion_hvd.comm.gloo import GlooChannel
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl'"):
        GlooChannel(backend="mpi")
