"""No host round-trip per layer inside a step.

On a GPU every read of a tensor's value by the host (``.item()``, ``bool(t)``, ``.tolist()``)
waits for the device to finish all queued work, so a read per layer serializes the step. The
compressor keeps its per-layer facts (finiteness, norms, faults) in 0-d tensors on the device
instead. On the CPU such reads cost nothing, so here they are counted: a steady-state step
must make the same small number of reads whatever the number of layers (the CUDA
counterpart, under ``torch.cuda.set_sync_debug_mode("error")``, needs a GPU).
"""

from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

import accordion_hvd as acc
from accordion_hvd.comm import SimulatedWorld
from channels import Forwarding

HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__,
              torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__}
WORLD, STEPS = 2, 4
MEASURED = (2, 3)  # steps after the first two (the first agrees on settings and bucket layouts)


class CountHostReads(TorchFunctionMode):
    """Counts the calls that read a tensor's value on the host, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.calls[func.__name__] += 1
        return func(*args, **(kwargs or {}))


COMPRESSORS = {
    "powersgd-static": lambda: acc.AccordionCompressor(acc.PowerSGD(rank=2), policy="static"),
    "powersgd-accordion": lambda: acc.AccordionCompressor(acc.PowerSGD(rank=1, critical_rank=2), interval=100),
    "topk-static": lambda: acc.AccordionCompressor(acc.TopK(ratio=0.05), policy="static"),
    "topk-accordion": lambda: acc.AccordionCompressor(acc.TopK(ratio=0.05, critical_ratio=0.1), interval=100),
    # the first window is critical: 99% is sent dense, through the error-feedback flush
    "topk-dense-level": lambda: acc.AccordionCompressor(acc.TopK(ratio=0.05, critical_ratio=0.99), interval=100),
}
# On CUDA only: the default codec reads one integer per layer and step on the host (the next
# step's chunk count), which the CPU count above would count; on CUDA it arrives through
# pinned memory behind an event (codecs/quantize.py _take_k), never waiting for the device.
CUDA_COMPRESSORS = {**COMPRESSORS,
                    "default-codec": lambda: acc.AccordionCompressor(acc.codecs.default_codec(), policy="static")}


def shapes(layers: int) -> dict[str, tuple[int, ...]]:
    out = {}
    for i in range(layers):
        out[f"l{i}.weight"] = (32, 16, 3, 3)
        out[f"l{i}.bias"] = (32,)  # not compressed: passed through, checked after the allreduce
    return out


def reads_per_step(make, layers: int, fault_at: int | None = None) -> list[tuple[list[Counter], list[bool]]]:
    """Per rank, the host reads of each measured step (compress, allreduce of what it passes
    through, decompress) with ``layers`` compressed layers, and every step's ``step_skipped``
    (read after the counting). Rank 1's gradient of l0.weight holds a NaN at step ``fault_at``."""
    def worker(rank, channel):
        comp = make()
        comp.engine.use_planes(channel)
        counted, skipped = [], []
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(100 * step + rank)
            grads = {n: torch.randn(s, generator=gen) for n, s in shapes(layers).items()}
            if step == fault_at and rank == 1:
                grads["l0.weight"].view(-1)[3] = float("nan")
            mode = CountHostReads()
            with mode:
                sent = {n: comp.compress_named(n, grads[n]) for n in grads}
                for n in sorted(sent):
                    averaged = channel.wait(channel.allreduce_mean_async([sent[n][0]], f"hvd.{n}"))[0]
                    comp.decompress(averaged.clone(), sent[n][1])
            if step in MEASURED:
                counted.append(mode.calls)
            skipped.append(comp.step_skipped)
        return counted, skipped
    return SimulatedWorld(WORLD).run(worker)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_a_step_reads_nothing_per_layer_from_the_device(name):
    few, many = reads_per_step(COMPRESSORS[name], 2), reads_per_step(COMPRESSORS[name], 6)
    for rank in range(WORLD):
        for step_few, step_many in zip(few[rank][0], many[rank][0]):
            assert step_few == step_many, (rank, step_few, step_many)  # nothing grows with the layers
            # what is left: the host reading the step's outcome once, to log it (on a GPU, a later step does)
            assert sum(step_many.values()) <= 1, (rank, step_many)


def test_the_counter_sees_a_read_per_layer():
    """The instrument itself: a compressor that read each layer's finiteness would be caught."""
    mode = CountHostReads()
    with mode:
        for t in [torch.randn(4) for _ in range(5)]:
            bool(torch.isfinite(t.sum()))
    assert mode.calls == Counter({"__bool__": 5})


@pytest.mark.parametrize("name", ["powersgd-accordion", "topk-accordion"])
def test_a_faulty_step_is_skipped_on_every_rank_without_per_layer_reads(name):
    """The fault path too is device-side: the step that holds a NaN is skipped on every rank,
    and reading its outcome to log it (which layers, on the rank that had them) is one more
    read, not one per layer."""
    for layers in (2, 6):
        out = reads_per_step(COMPRESSORS[name], layers, fault_at=MEASURED[0])
        for rank, (counted, skipped) in enumerate(out):
            assert skipped == [step == MEASURED[0] for step in range(STEPS)], (rank, skipped)
            assert sum(counted[0].values()) <= 2, (rank, counted)
            assert sum(counted[1].values()) <= 1, (rank, counted)


class SyncFreeOutsideCollectives(Forwarding):
    """A channel whose waits (the collectives, which may synchronize) run with the CUDA sync
    check off; everything else, the compressor's own work, runs under "error"."""

    def wait(self, handle):
        mode = torch.cuda.get_sync_debug_mode()  # back to it after: steps before the checked one stay unchecked
        torch.cuda.set_sync_debug_mode(0)
        try:
            return self.inner.wait(handle)
        finally:
            torch.cuda.set_sync_debug_mode(mode)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("name", CUDA_COMPRESSORS)
def test_a_cuda_step_never_synchronizes_the_host(name):
    """A whole step of the compressor on CUDA tensors under
    ``torch.cuda.set_sync_debug_mode("error")`` (the collectives excepted): any host read
    inside the compressor raises. One rank: the sync mode is process-wide."""
    if not acc.with_cuda:
        pytest.fail("torch has CUDA but accordion_hvd was built without its CUDA kernels")

    def worker(rank, channel):
        comp = CUDA_COMPRESSORS[name]()
        comp.engine.use_planes(wrapped := SyncFreeOutsideCollectives(channel))
        for step in range(4):
            gen = torch.Generator().manual_seed(step)
            grads = {n: torch.randn(s, generator=gen).cuda() for n, s in shapes(3).items()}
            torch.cuda.synchronize()
            if step == 3:  # the first steps agree on settings and layouts (blocking, by design)
                torch.cuda.set_sync_debug_mode("error")
            try:
                sent = {n: comp.compress_named(n, grads[n]) for n in grads}
                for n in sorted(sent):
                    averaged = wrapped.wait(channel.allreduce_mean_async([sent[n][0]], f"hvd.{n}"))[0]
                    comp.decompress(averaged, sent[n][1])
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return comp.step_skipped
    assert SimulatedWorld(1).run(worker) == [False]
