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


def load_synthetic(seed: int = 0, n_train: int = 32_768, n_test: int = 8_192, channels: int = 3,
                   size: int = 32, classes: int = 10) -> tuple[Split, Split]:
    """A learnable synthetic image task: Gaussian images labelled by a fixed random linear
    teacher (the same on every rank; ``seed`` picks the teacher and the images). No file
    is needed, and samples are free, so there are enough of them for test accuracy to mean
    something: with the 4,096 training images this task once had, the small CNN fit them
    all within 15 epochs while its test accuracy peaked at epoch 8 (52%) and then fell, so
    a run's final accuracy said how far it had overfit rather than how well it had learned.
    The test set is large too (8,192 images: one image is 0.012 points)."""
    gen = torch.Generator().manual_seed(10_007 + seed)
    x = torch.randn(n_train + n_test, channels, size, size, generator=gen)
    teacher = torch.randn(channels * size * size, classes, generator=gen)
    y = (x.flatten(1) @ teacher).argmax(1)
    return Split(x[:n_train], y[:n_train]), Split(x[n_train:], y[n_train:])


def load_cifar10(data_dir) -> tuple[Split, Split]:
    """CIFAR-10 from a local copy of the python version (``cifar-10-batches-py``, as
    torchvision or the official tarball leave it); never downloads. Normalized per channel."""
    import pickle
    from pathlib import Path

    import numpy as np

    root = Path(data_dir)
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    files = [root / f"data_batch_{i}" for i in range(1, 6)] + [root / "test_batch"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"--data-dir {data_dir}: CIFAR-10 (python version) not found, missing "
                                f"{missing[0]}; nothing is downloaded, unpack cifar-10-python.tar.gz there")

    def read(paths):
        xs, ys = [], []
        for path in paths:
            with open(path, "rb") as f:
                batch = pickle.load(f, encoding="latin1")
            xs.append(np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            ys.append(np.asarray(batch["labels"], dtype=np.int64))
        return torch.from_numpy(np.concatenate(xs)).float() / 255.0, torch.from_numpy(np.concatenate(ys))

    (x_train, y_train), (x_test, y_test) = read(files[:5]), read(files[5:])
    mean = x_train.mean(dim=(0, 2, 3), keepdim=True)
    std = x_train.std(dim=(0, 2, 3), keepdim=True)
    return Split((x_train - mean) / std, y_train), Split((x_test - mean) / std, y_test)
