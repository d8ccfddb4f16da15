"""Shared by the worker scripts (their directory is on sys.path when they run)."""

import sys


def say(line: str) -> None:
    """Print one line in a single write: with PYTHONUNBUFFERED, print() writes the text and
    the newline separately, and mpirun can put another rank's output in between."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def checker(rank: int):
    """check(condition, message): on failure print which rank failed and why, then exit 1."""
    def check(condition, message):
        if not condition:
            say(f"rank {rank}: FAILED: {message}")
            sys.exit(1)
    return check


def world_of(launcher: str):
    """(rank, size, sum_, gather) of the job: under "horovod" Horovod initialized and its
    collectives; else torch.distributed (Gloo) initialized and a group of every rank of its
    own, so that a reference's sums never pair with the code under test's. ``sum_(tensor)``
    sums it over the ranks in place; ``gather(tensor)`` is the list of every rank's."""
    if launcher == "horovod":
        import horovod.torch as hvd

        hvd.init()

        def sum_(tensor):
            tensor.copy_(hvd.allreduce(tensor, op=hvd.Sum))

        def gather(tensor):
            return list(hvd.allgather(tensor.unsqueeze(0)))
        return hvd.rank(), hvd.size(), sum_, gather
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(size)), backend="gloo")

    def sum_(tensor):
        dist.all_reduce(tensor, group=group)

    def gather(tensor):
        gathered = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(gathered, tensor, group=group)
        return gathered
    return rank, size, sum_, gather


def leave_torch_distributed(dist) -> None:
    """End a torchrun worker whose checks all passed: a barrier, every process group destroyed,
    then exit at once. Skipping the interpreter's teardown is deliberate: with Gloo, torch's
    worker threads can still hold work objects whose destruction at interpreter finalization
    aborts the process ("terminate called without an active exception", SIGABRT; pytorch
    issues 190489 and PR 179291). Seen once in this suite, on a loaded machine, after both
    ranks had printed OK; what the test checks is done before this point."""
    import os
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def orthogonalize(p, eps: float):
    """Gram-Schmidt on the columns of a NumPy matrix, eps added to each column norm: the
    NumPy references' PowerSGD orthogonalization (a copy; ``p`` is not changed)."""
    import numpy as np

    p = p.copy()
    for i in range(p.shape[1]):
        p[:, i] /= np.linalg.norm(p[:, i]) + eps
        p[:, i + 1:] -= np.outer(p[:, i], p[:, i] @ p[:, i + 1:])
    return p


def quantize32(g, bits: int, chunk: int):
    """(q, scales) of flat float32 NumPy g: per chunk s = max|g| / (2^(bits-1) - 1), q =
    round(g / s) half to even, all in float32 as the codec computes it, so the result is exact."""
    import numpy as np

    qmax = np.float32(2 ** (bits - 1) - 1)
    chunks = -(-g.size // chunk)
    padded = np.zeros(chunks * chunk, np.float32)
    padded[:g.size] = g
    padded = padded.reshape(chunks, chunk)
    s = (np.abs(padded).max(axis=1) / qmax).astype(np.float32)
    safe = np.where(s > 0, s, np.float32(1)).astype(np.float32)
    return np.clip(np.round(padded / safe[:, None]), -qmax, qmax).reshape(-1)[:g.size], s
