"""Data sets for the training CLI, sharded across ranks.

``digits`` (scikit-learn's bundled 1,797 8x8 images) needs no download and is the default;
``text`` (the standard library's own source, tokenized) needs none either, nor does
``torch-source`` (the installed torch package's source: protocol evidence-v3's held-out corpus).
"""

from __future__ import annotations

import re
from typing import Iterator, NamedTuple

import torch


class Split(NamedTuple):
    x: torch.Tensor  # (N, C, H, W) float32 images, or (N, T) int64 token ids
    y: torch.Tensor  # (N,) int64 labels, or (N, T) int64 next tokens


def load_digits(seed: int = 0, folds: int = 5, fold: int = 0) -> tuple[Split, Split]:
    """Digits as (train, test), the same split on every rank: the images in an order fixed by
    ``seed``, cut into ``folds`` nearly equal folds; fold ``fold`` is the test set, the
    others the training set (cross-validation: over the folds every image is tested once)."""
    if not (isinstance(folds, int) and isinstance(fold, int) and folds >= 2 and 0 <= fold < folds):
        raise ValueError(f"need folds >= 2 and 0 <= fold < folds, got folds={folds!r}, fold={fold!r}")
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    start, end = len(y) * fold // folds, len(y) * (fold + 1) // folds
    test, train = perm[start:end], torch.cat([perm[:start], perm[end:]])
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


# --- language modelling on the standard library's own source ---------------------------------
# Real text that every Python installation ships: the source of these standard-library
# modules (present as plain files from Python 3.9 to 3.13), split by file so that no module
# is in two splits. The corpus is the interpreter's own: another Python version has other
# source, so the log states the corpus's digest.
TEXT_VALID = ("calendar.py", "ftplib.py", "shutil.py", "statistics.py", "uuid.py")
TEXT_TEST = ("base64.py", "configparser.py", "fractions.py", "smtplib.py", "threading.py")
TEXT_TRAIN = (
    "argparse.py", "ast.py", "bisect.py", "codecs.py", "collections/__init__.py", "copy.py", "csv.py",
    "dataclasses.py", "difflib.py", "enum.py", "fnmatch.py", "functools.py", "gettext.py", "glob.py", "heapq.py",
    "http/client.py", "http/server.py", "imaplib.py", "inspect.py", "ipaddress.py", "json/decoder.py",
    "json/encoder.py", "locale.py", "logging/__init__.py", "mailbox.py", "netrc.py", "optparse.py", "os.py",
    "pickle.py", "plistlib.py", "poplib.py", "pprint.py", "random.py", "socket.py", "ssl.py", "string.py",
    "subprocess.py", "tarfile.py", "tempfile.py", "textwrap.py", "tokenize.py", "traceback.py", "typing.py",
    "unittest/case.py", "urllib/parse.py", "weakref.py",
)
# Tokens: a line break, an identifier or keyword, a run of digits, or one other visible
# character (operators and punctuation); indentation and other whitespace are dropped.
TEXT_TOKEN = re.compile(r"\n|[A-Za-z_]\w*|\d+|[^\s\w]", re.ASCII)
TEXT_MIN_COUNT = 3  # tokens seen fewer times in the training split are <unk>
UNK = "<unk>"


class TextCorpus(NamedTuple):
    train: Split  # x: (N, seq_len) token ids, y: the same shifted by one token
    valid: Split
    test: Split
    vocabulary: list[str]
    digest: str   # sha256 of the files' bytes, in order: which corpus this was


def load_text(seq_len: int = 35, stdlib: str | None = None) -> TextCorpus:
    """The standard-library corpus, tokenized, as non-overlapping sequences of ``seq_len``
    tokens (inputs) and the same shifted by one (targets), per split. The vocabulary is the
    training split's tokens seen at least ``TEXT_MIN_COUNT`` times, by count then text,
    plus ``<unk>``. Raises FileNotFoundError naming a missing file and where it looked."""
    import sysconfig
    from pathlib import Path

    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    splits = {}
    for split, names in (("train", TEXT_TRAIN), ("valid", TEXT_VALID), ("test", TEXT_TEST)):
        for name in names:
            if not (root / name).is_file():
                raise FileNotFoundError(f"--dataset text: the standard library file {name} is missing (looked in "
                                        f"{root}); this Python installation does not ship its sources")
        splits[split] = [root / name for name in names]
    return tokenized(splits, seq_len)


# --- the held-out corpus of protocol evidence-v3: the installed torch package's own source ----
# Every .py file of the package, sorted by path, visited in a fixed stride order (file i of n
# at position (i * TORCH_STRIDE) % n: spread over the whole package without a random draw),
# and dealt out to validation, test and training in that order until each split holds its
# bytes (the standard-library corpus's sizes, so that an epoch is as long as the text task's).
TORCH_STRIDE = 7919  # a prime: the stride visits every file once (2,285 files in torch 2.13.0)
TORCH_SPLIT_BYTES = (("valid", 190_000), ("test", 210_000), ("train", 2_150_000))


def torch_source_files(root, budgets: tuple = TORCH_SPLIT_BYTES) -> dict[str, list]:
    """The held-out corpus's files per split (see above), from the torch package at ``root``;
    ``budgets``: (split, bytes) in the order they are filled."""
    from pathlib import Path

    files = sorted(Path(root).rglob("*.py"), key=lambda f: f.relative_to(root).as_posix())
    n = len(files)
    if n == 0:
        raise FileNotFoundError(f"--dataset torch-source: no .py file under {root}")
    order = sorted(range(n), key=lambda i: (i * TORCH_STRIDE) % n)
    splits, budget = {}, iter(budgets)
    split, left = next(budget)
    for i in order:
        size = files[i].stat().st_size
        if size == 0:
            continue
        splits.setdefault(split, []).append(files[i])
        left -= size
        if left <= 0:
            split, left = next(budget, (None, 0))
            if split is None:
                break
    return splits


def load_torch_source(seq_len: int = 35, root=None) -> TextCorpus:
    """The held-out corpus (above), tokenized as ``load_text``'s."""
    if root is None:
        import os

        import torch as _torch
        root = os.path.dirname(_torch.__file__)
    return tokenized(torch_source_files(root), seq_len)


def tokenized(splits: dict[str, list], seq_len: int) -> TextCorpus:
    """Files per split ("train", "valid", "test") as a ``TextCorpus``: tokens by ``TEXT_TOKEN``,
    the vocabulary the training split's tokens seen ``TEXT_MIN_COUNT`` times or more,
    non-overlapping sequences of ``seq_len``; the digest is of every file's bytes in order."""
    import collections
    import hashlib

    digest = hashlib.sha256()
    tokens = {}
    for split in ("train", "valid", "test"):
        stream = []
        for path in splits[split]:
            raw = path.read_bytes()
            digest.update(raw)
            stream += TEXT_TOKEN.findall(raw.decode("utf-8", errors="replace"))
        tokens[split] = stream
    counts = collections.Counter(tokens["train"])
    vocabulary = sorted((t for t, c in counts.items() if c >= TEXT_MIN_COUNT), key=lambda t: (-counts[t], t))
    vocabulary.append(UNK)
    index = {t: i for i, t in enumerate(vocabulary)}
    unk = index[UNK]

    def sequences(stream: list[str]) -> Split:
        ids = torch.tensor([index.get(t, unk) for t in stream], dtype=torch.int64)
        n = (len(ids) - 1) // seq_len
        return Split(ids[:n * seq_len].view(n, seq_len), ids[1:n * seq_len + 1].view(n, seq_len))

    return TextCorpus(sequences(tokens["train"]), sequences(tokens["valid"]), sequences(tokens["test"]),
                      vocabulary, digest.hexdigest()[:16])
