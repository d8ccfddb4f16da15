"""The compressor's own data plane: a Gloo process group over Horovod's ranks.

Why not Horovod's collectives for the compressed data: Horovod runs every collective through
its background loop, which wakes every ``HOROVOD_CYCLE_TIME`` (1 ms by default), agrees with
the other ranks on what is ready, and only then starts the transfer. A collective issued
between two cycles waits for the next one, and the agreement itself is a round trip: on
ResNet-18 (benchmarks/results/step-profile.md) a layer's tiny P allreduce spent 140-560 ms
between its submission and its start, waiting for the slowest rank's negotiation message, and
the step's last round (Q) added a negotiation on top of its transfer. A long cycle makes the
loop cheaper in CPU but adds its latency to every round; a short one costs CPU that the
backward pass needs when cores are scarce.

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
rounds, which start when each bucket's P average is back, a matter of timing on each rank.

Every wait has the channel's timeout (a ``TimeoutError`` naming the collective); the group's
own timeout is the same, so a collective that a rank never issues fails on every rank.
"""

from __future__ import annotations

import copy
import datetime
import fcntl
import logging
import os
import socket
import struct

import torch
import torch.distributed as dist

from .channel import collective_timeout, collective_timeout_error
from .horovod import check_horovod_cycle, install_polite_wait

log = logging.getLogger("accordion_hvd.comm")

ADDR_ENV = "ACCORDION_GLOO_ADDR"  # the address other ranks reach rank 0 at (default: see _advertised_host)
IFACE_ENVS = ("ACCORDION_GLOO_IFACE", "HOROVOD_GLOO_IFACE", "GLOO_SOCKET_IFNAME")
LANES = ("q",)  # built with every channel: a group is a collective setup, not something to do mid-step


class GlooChannel:
    """Collectives on a Gloo process group of Horovod's ranks (see module doc).

    Args:
        timeout: seconds a collective may take; default $ACCORDION_COLLECTIVE_TIMEOUT, else 300.
    """

    def __init__(self, timeout: float | None = None) -> None:
        import horovod.torch as hvd

        install_polite_wait()  # Horovod still carries the uncompressed tensors
        check_horovod_cycle()
        self.timeout = collective_timeout(timeout)
        self.rank, self.size = hvd.rank(), hvd.size()
        self._issued = [0]  # collectives issued so far on every lane (tests count them per step)
        # timedelta cannot hold math.inf ("wait forever"): a week stands in for it.
        self._delta = delta = datetime.timedelta(seconds=min(self.timeout, 7 * 24 * 3600.0))
        iface = next((os.environ[e] for e in IFACE_ENVS if os.environ.get(e)), None)
        host = os.environ.get(ADDR_ENV) or _advertised_host(iface)
        store = None
        if self.rank == 0:
            store = dist.TCPStore(host, 0, self.size, is_master=True, timeout=delta, wait_for_workers=False)
            address = f"{host}:{store.port}"
        # The one Horovod collective of the channel's life: where rank 0's store listens.
        address = hvd.broadcast_object(address if self.rank == 0 else None, root_rank=0,
                                       name="acc.gloo.rendezvous")
        if store is None:
            store_host, port = address.rsplit(":", 1)
            store = dist.TCPStore(store_host, int(port), self.size, is_master=False, timeout=delta)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = delta
        options._devices = [dist.ProcessGroupGloo.create_device(interface=iface) if iface
                            else dist.ProcessGroupGloo.create_device(hostname=host)]
        self._store = store  # kept alive with the groups
        self._pg = dist.ProcessGroupGloo(dist.PrefixStore("accordion", store), self.rank, self.size, options)
        self._lanes = {}
        for name in LANES:
            view = copy.copy(self)  # the same ranks, timeout and counter, its own group
            view._pg = dist.ProcessGroupGloo(dist.PrefixStore(f"accordion.{name}", store), self.rank, self.size,
                                             options)
            view._lanes = {}
            self._lanes[name] = view
        log.info("rank %d: compressed gradients travel on a Gloo group of %d ranks (%s)", self.rank, self.size,
                 f"interface {iface}" if iface else f"host {host}")

    @property
    def issued(self) -> int:
        return self._issued[0]

    def lane(self, name: str) -> "GlooChannel":
        """The channel's lane ``name`` (see module doc)."""
        if name not in self._lanes:
            raise ValueError(f"GlooChannel has no lane {name!r} (lanes: {', '.join(self._lanes) or 'none'})")
        return self._lanes[name]

    def allreduce_mean_async(self, tensors: list[torch.Tensor], name: str):
        """One collective for the whole list: the tensors are packed into one buffer."""
        flat = torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) != 1 else tensors[0].reshape(-1).clone()
        self._issued[0] += 1
        try:
            work = self._pg.allreduce([flat])
        except RuntimeError as exc:
            raise self._failure(name, exc) from exc
        return ("allreduce", name, work, flat, [t.shape for t in tensors])

    def allgather_async(self, tensor: torch.Tensor, name: str):
        tensor = tensor.reshape(-1).contiguous()
        out = torch.empty(self.size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        self._issued[0] += 1
        try:
            work = self._pg.allgather([list(out.chunk(self.size))], [tensor])
        except RuntimeError as exc:
            raise self._failure(name, exc) from exc
        return ("allgather", name, work, out, None)

    def test(self, handle) -> bool:
        """Whether the collective has completed (never waits; a failed one counts as
        completed: ``wait`` raises its error)."""
        return handle[2].is_completed()

    def wait(self, handle):
        kind, name, work, out, shapes = handle
        try:
            work.wait(self._delta)
        except RuntimeError as exc:
            raise self._failure(name, exc) from exc
        if kind == "allgather":
            return out
        out.div_(self.size)
        if len(shapes) == 1:
            return [out.view(shapes[0])]
        return [part.view(shape) for part, shape in zip(out.split([s.numel() for s in shapes]), shapes)]

    def _failure(self, name: str, exc: RuntimeError) -> Exception:
        """A collective that timed out raises the channel's TimeoutError. One that failed
        because a peer went away raises Horovod's ``HorovodInternalError`` (a RuntimeError),
        as Horovod's own collectives do, so that Horovod Elastic restores the last commit and
        re-forms the world (the compressor then builds a new group: ``world_changed``)."""
        text = str(exc)
        if "timed out" in text.lower() or "timeout" in text.lower():
            return collective_timeout_error(name, self.rank, self.size, self.timeout)
        from horovod.common.exceptions import HorovodInternalError
        return HorovodInternalError(f"AccordionCompressor: collective {name!r} failed on rank {self.rank} "
                                    f"(world size {self.size}): {text}")

    def forget_handles(self) -> None:
        """Horovod Elastic re-formed the world; this group belongs to the old one."""


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
