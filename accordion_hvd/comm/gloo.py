"""The compressor's own data plane: a Gloo process group over Horovod's ranks.

Why not Horovod's collectives for the compressed data: Horovod runs every collective through
its background loop, which wakes every ``HOROVOD_CYCLE_TIME`` (1 ms by default), agrees with
the other ranks on what is ready, and only then starts the transfer. A collective issued
between two cycles waits for the next one, and the agreement itself is a round trip: a
layer's tiny P allreduce waited for the slowest rank's negotiation message far longer than its
transfer took (measured: docs/design.md, "Measured reasons"), and the step's last round (Q)
added a negotiation on top of its transfer. A long cycle makes the loop cheaper in CPU but
adds its latency to every round; a short one costs CPU that the backward pass needs when cores
are scarce.

A Gloo process group (``torch.distributed.ProcessGroupGloo``, the engine DDP runs on) has no
cycle and no negotiation: a collective starts on its worker threads the moment it is issued,
and ranks pair collectives by the order they issue them. The exchange (accordion_hvd/
exchange/) issues them in an order that every rank agrees on (its buckets, in a fixed
order), so that is safe. The group is built from Horovod's world: rank 0 opens a
``TCPStore`` on a free port and its address reaches the other ranks in one Horovod broadcast;
it works the same under ``horovodrun --gloo`` and ``--mpi``. Horovod keeps the uncompressed
tensors and everything else it does.

A channel has **lanes** (``lane("q")``): further Gloo groups of the same ranks, built at the
same time from the same store. Collectives on different lanes pair independently, so a rank
may interleave its issues on two lanes in any order; PowerSGD's exchange uses one for its Q
rounds, which start when each bucket's P average is back, a matter of timing on each rank,
and the compressor one for the gradients it does not compress (biases, normalization
layers), whose buckets fill at other times than the compressed layers' ones.

One more group carries the regime controller's reductions where MPI cannot
(``control_plane``: under ``horovodrun --gloo``; under ``--mpi`` they stay on MPI). It is
not a lane: its collectives are not data-plane traffic and stay out of the link fit
(comm/link.py), and it pairs its collectives by order on its own, between steps.

Every wait has the channel's timeout (a ``TimeoutError`` naming the collective); the group's
own timeout is the same, so a collective that a rank never issues fails on every rank. A
failed or timed-out collective also says which rank stopped answering (comm/liveness.py:
heartbeats through the same store), and is a ``HorovodInternalError``, as Horovod's own
failures are, so that Horovod Elastic restores the last commit and re-forms the world.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import weakref

import torch.distributed as dist

from .channel import HorovodInternalError, collective_timeout
from .liveness import Heartbeat
from .process_group import ProcessGroupChannel, timeout_delta

log = logging.getLogger("accordion_hvd.comm")

ADDR_ENV = "ACCORDION_GLOO_ADDR"  # the address other ranks reach rank 0 at (default: see _advertised_host)
IFACE_ENVS = ("ACCORDION_GLOO_IFACE", "HOROVOD_GLOO_IFACE", "GLOO_SOCKET_IFNAME")
LANES = ("q", "dense")  # built with every channel: a group is a collective setup, not something to do mid-step


class GlooChannel(ProcessGroupChannel):
    """Collectives on Gloo groups of Horovod's ranks (see module doc).

    Args:
        timeout: seconds a collective may take; default $ACCORDION_COLLECTIVE_TIMEOUT, else 300.
        backend: "gloo", or "nccl" for CUDA gradients (comm/planes.py chooses): the data
            groups (the main one and its lanes) are then NCCL groups of the same ranks, built
            from the same store, each rank on its current CUDA device; the control group and
            the heartbeats stay on Gloo.
    """

    def __init__(self, timeout: float | None = None, backend: str = "gloo") -> None:
        import horovod.torch as hvd

        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")

        timeout = collective_timeout(timeout)
        rank, size = hvd.rank(), hvd.size()
        delta = timeout_delta(timeout)
        iface = next((os.environ[e] for e in IFACE_ENVS if os.environ.get(e)), None)
        host = os.environ.get(ADDR_ENV) or _advertised_host(iface)
        store = None
        if rank == 0:
            store = dist.TCPStore(host, 0, size, is_master=True, timeout=delta, wait_for_workers=False)
            address = f"{host}:{store.port}"
        # The one Horovod collective of the channel's life: where rank 0's store listens.
        address = hvd.broadcast_object(address if rank == 0 else None, root_rank=0, name="acc.gloo.rendezvous")
        if store is None:
            store_host, port = address.rsplit(":", 1)
            store = dist.TCPStore(store_host, int(port), size, is_master=False, timeout=delta)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = delta
        options._devices = [dist.ProcessGroupGloo.create_device(interface=iface) if iface
                            else dist.ProcessGroupGloo.create_device(hostname=host)]

        def group(prefix: str):
            return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, options)

        data = group
        if backend == "nccl":
            nccl_options = dist.ProcessGroupNCCL.Options()
            nccl_options._timeout = delta

            def data(prefix: str):
                return dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, size, nccl_options)

        # The heartbeat first: each lane is a view holding a copy of the channel's attributes
        # (process_group.py), and a lane's failure needs it for its diagnosis.
        store_host, port = address.rsplit(":", 1)
        self._heartbeat = Heartbeat(store_host, int(port), rank, size, setup_timeout=timeout)
        # A channel dropped without close() must not leave its heartbeat the live one: a later
        # diagnosis would read counters nobody updates and blame the ranks of a live channel.
        weakref.finalize(self, self._heartbeat.close)
        super().__init__(data("accordion"), rank, size, timeout,
                         lanes={name: data(f"accordion.{name}") for name in LANES})
        self._control_group = group("accordion.control")
        self._store = store  # kept alive with the groups
        log.info("rank %d: compressed gradients travel on a%s group of %d ranks (%s)", rank,
                 " Gloo" if backend == "gloo" else "n NCCL", size, f"interface {iface}" if iface else f"host {host}")

    def control_plane(self):
        """The compressor's control plane (comm/control.py, ``control_plane``): MPI where MPI's
        world is Horovod's, else this channel's control group, whose reductions take a
        millisecond where Horovod's wait for its cycle. Failures are this channel's kind."""
        from .control import ProcessGroupControlPlane, control_plane

        def gloo():
            return ProcessGroupControlPlane(self._control_group, self.rank, self.size, self.timeout,
                                            failure=self._failure)
        return control_plane("auto", timeout=self.timeout, fallback=gloo)

    def _failure(self, name: str, exc: RuntimeError) -> Exception:
        """A collective that timed out raises ``CollectiveTimeout`` (see channel.py), one that
        failed because a peer went away ``HorovodInternalError``: both are Horovod's error
        kind, as Horovod's own collectives raise, so that Horovod Elastic restores the last
        commit and re-forms the world (the compressor then builds a new group:
        ``world_changed``). Both name the collective and the ranks that stopped answering."""
        error = super()._failure(name, exc)
        if isinstance(error, TimeoutError):
            return error
        why = self._heartbeat.diagnose()
        return HorovodInternalError(f"{error} Diagnosis: {why}." if why else str(error))

    def note_step(self, step: int) -> None:
        """The optimizer step this rank is in now: published with its heartbeats, so that a
        diagnosis can say where a rank that left was (comm/liveness.py)."""
        self._heartbeat.note_step(step)

    def close(self) -> None:
        """Stop the heartbeat (the world was re-formed; a new channel replaces this one)."""
        self._heartbeat.close()


def _advertised_host(iface: str | None) -> str:
    """The address other ranks reach this one at: the interface's IPv4 address when an
    interface is named (horovodrun --network-interfaces), else what the hostname resolves to."""
    if iface:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", iface[:15].encode()))  # SIOCGIFADDR
            return socket.inet_ntoa(packed[20:24])
        except OSError as exc:
            raise RuntimeError(f"AccordionCompressor: network interface {iface!r} (from "
                               f"{', '.join(IFACE_ENVS)}) has no IPv4 address: {exc}") from exc
    return socket.gethostbyname(socket.gethostname())
