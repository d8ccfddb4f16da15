"""The training CLI's data sets: deterministic on every rank, sharded without overlap."""

import torch

from accordion_hvd.cli import data


def test_synthetic_is_the_same_for_the_same_seed_and_differs_across_seeds():
    a_train, a_test = data.load_synthetic(seed=3, channels=1, size=8)
    b_train, b_test = data.load_synthetic(seed=3, channels=1, size=8)
    c_train, _ = data.load_synthetic(seed=4, channels=1, size=8)
    assert torch.equal(a_train.x, b_train.x) and torch.equal(a_train.y, b_train.y)
    assert torch.equal(a_test.x, b_test.x) and torch.equal(a_test.y, b_test.y)
    assert not torch.equal(a_train.x, c_train.x)
    assert a_train.x.shape == (32_768, 1, 8, 8) and a_test.x.shape == (8_192, 1, 8, 8)
    assert a_train.x.dtype == torch.float32 and a_train.y.dtype == torch.int64


def test_synthetic_labels_come_from_a_linear_teacher_every_class_present():
    train, test = data.load_synthetic(seed=0, channels=1, size=8)
    assert torch.bincount(train.y, minlength=10).min() > 1_000  # no class starved
    # A linear least-squares fit on the training images recovers the teacher well enough to
    # label unseen images: the task is learnable from its training set, not memorised.
    w = torch.linalg.lstsq(train.x.flatten(1), torch.nn.functional.one_hot(train.y, 10).float()).solution
    assert ((test.x.flatten(1) @ w).argmax(1) == test.y).float().mean() > 0.85


def test_shards_are_disjoint_equal_and_the_same_permutation_on_every_rank():
    n, size, batch = 1_000, 3, 32
    ids = data.Split(torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1), torch.zeros(n, dtype=torch.int64))
    shards = [[int(v) for x, _ in data.shard_batches(ids, batch, r, size, epoch=2, seed=0) for v in x.flatten()]
              for r in range(size)]
    assert [len(s) for s in shards] == [(n // size // batch) * batch] * size  # same number of steps per rank
    assert len(set().union(*shards)) == sum(len(s) for s in shards)  # no sample on two ranks
    again = [int(v) for x, _ in data.shard_batches(ids, batch, 1, size, epoch=2, seed=0) for v in x.flatten()]
    other_epoch = [int(v) for x, _ in data.shard_batches(ids, batch, 1, size, epoch=3, seed=0) for v in x.flatten()]
    assert again == shards[1] and other_epoch != shards[1]
