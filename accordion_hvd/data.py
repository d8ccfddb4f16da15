"""Data sets for the training CLI, sharded across Horovod ranks.

``digits`` (scikit-learn's bundled 1,797 8x8 images) needs no download and is the default.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

import torch


class Split(NamedTuple):
    x: torch.Tensor  # (N, C, H, W) float32
    y: torch.Tensor  # (N,) int64


def load_digits(seed: int = 0, test_fraction: float = 0.2) -> tuple[Split, Split]:
    """Digits as (train, test), the same split on every rank (fixed seed)."""
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return Split(x[train], y[train]), Split(x[test], y[test])


def shard_batches(split: Split, batch_size: int, rank: int, size: int, epoch: int,
                  seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's mini-batches for one epoch.

    Every rank draws the same permutation (seeded by seed and epoch) and takes every
    size-th sample, so shards are disjoint; all ranks run the same number of steps (the
    tail that does not divide evenly is dropped) so that collectives stay paired.
    """
    perm = torch.randperm(len(split.y), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    per_rank = len(perm) // size
    mine = perm[rank::size][:per_rank]
    for start in range(0, per_rank - batch_size + 1, batch_size):
        idx = mine[start:start + batch_size]
        yield split.x[idx], split.y[idx]
