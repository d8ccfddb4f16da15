"""The training CLI's data sets: deterministic on every rank, sharded without overlap."""

import pytest
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


# --- language modelling: the standard library's own source ----------------------------------
def test_text_corpus_is_deterministic_split_by_file_and_shifted_by_one():
    a, b = data.load_text(seq_len=35), data.load_text(seq_len=35)
    assert a.digest == b.digest and a.vocabulary == b.vocabulary
    for split_a, split_b in zip(a[:3], b[:3]):
        assert torch.equal(split_a.x, split_b.x) and torch.equal(split_a.y, split_b.y)
    assert not set(data.TEXT_TRAIN) & set(data.TEXT_VALID + data.TEXT_TEST)
    assert not set(data.TEXT_VALID) & set(data.TEXT_TEST)
    assert a.vocabulary[-1] == data.UNK and len(set(a.vocabulary)) == len(a.vocabulary)
    assert "\n" in a.vocabulary and "self" in a.vocabulary and "def" in a.vocabulary
    train = a.train
    assert train.x.shape[1] == 35 and train.x.shape[0] > 10_000 and train.x.dtype == torch.int64
    assert torch.equal(train.y[:, :-1], train.x[:, 1:])     # the next token, within a sequence
    assert torch.equal(train.y[:-1, -1], train.x[1:, 0])    # and across consecutive sequences
    assert int(train.x.max()) < len(a.vocabulary) and int(a.test.x.max()) < len(a.vocabulary)
    unk = len(a.vocabulary) - 1
    assert (a.test.x == unk).float().mean() < 0.1  # held-out modules share most of the vocabulary


def test_text_tokens_are_lines_identifiers_numbers_and_single_symbols():
    assert data.TEXT_TOKEN.findall("def f(x=10):\n    return x  # ok\n") == [
        "def", "f", "(", "x", "=", "10", ")", ":", "\n", "return", "x", "#", "ok", "\n"]


def test_text_without_the_standard_library_sources_names_the_file_and_where_it_looked(tmp_path, monkeypatch):
    import sysconfig

    from accordion_hvd.cli import train

    with pytest.raises(FileNotFoundError, match=f"{data.TEXT_TRAIN[0]} is missing \\(looked in {tmp_path}\\)"):
        data.load_text(stdlib=str(tmp_path))
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    with pytest.raises(SystemExit, match="does not ship its sources"):
        train.load_data(train.parse_args(["--dataset", "text"]))


# --- CIFAR-10 from a local copy ----------------------------------------------------------------
def write_cifar(root, per_batch=6):
    import pickle

    import numpy as np

    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rs = np.random.RandomState(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rs.randint(0, 256, size=(per_batch, 3072), dtype=np.uint8),
                 "labels": rs.randint(0, 10, size=per_batch).tolist()}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    return folder


def test_cifar10_loader_reads_a_cifar_format_directory(tmp_path):
    folder = write_cifar(tmp_path)
    for given in (tmp_path, folder):  # the parent, as torchvision leaves it, or the folder itself
        train, test = data.load_cifar10(given)
        assert train.x.shape == (30, 3, 32, 32) and test.x.shape == (6, 3, 32, 32)
        assert train.y.dtype == torch.int64 and int(train.y.max()) < 10
        # normalized per channel with the training set's statistics
        assert torch.allclose(train.x.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5)
        assert torch.allclose(train.x.std(dim=(0, 2, 3)), torch.ones(3), atol=1e-4)


def test_a_data_dir_without_cifar10_ends_with_one_line_naming_what_is_missing(tmp_path):
    from accordion_hvd.cli import train

    with pytest.raises(SystemExit, match=f"--data-dir {tmp_path}: CIFAR-10 .*missing .*data_batch_1"):
        train.load_data(train.parse_args(["--dataset", "cifar10", "--data-dir", str(tmp_path)]))


def test_digits_folds_cover_every_image_once_and_fold_0_is_the_historical_split():
    folds = [data.load_digits(seed=1, folds=5, fold=k) for k in range(5)]
    tested = sorted(map(tuple, torch.cat([test.x.flatten(1) for _, test in folds]).tolist()))
    everything = sorted(map(tuple, torch.cat([folds[0][0].x, folds[0][1].x]).flatten(1).tolist()))
    assert tested == everything  # every image is a test image exactly once
    for train, test in folds:
        assert len(train.y) + len(test.y) == 1797 and len(test.y) in (359, 360)
    assert len(folds[0][1].y) == 359  # fold 0: the first 20% of the seed's order, as before folds existed
    with pytest.raises(ValueError, match="0 <= fold < folds"):
        data.load_digits(folds=5, fold=5)


def test_the_held_out_corpus_is_dealt_by_the_stride_order_to_each_splits_bytes(tmp_path):
    """evidence-v3 amendment 1 on a small package: validation first, then test, then training,
    each split closed once it holds its bytes, in the fixed stride order, files disjoint."""
    root = tmp_path / "pkg"
    for i in range(60):
        (root / f"m{i // 10}").mkdir(parents=True, exist_ok=True)
        (root / f"m{i // 10}" / f"f{i:02d}.py").write_text(f"x{i} = {i}\n" * (50 + i))
    (root / "empty.py").write_text("")
    plan = (("valid", 4_000), ("test", 4_000), ("train", 20_000))
    budgets = dict(plan)
    splits = data.torch_source_files(root, plan)
    files = sorted(root.rglob("*.py"), key=lambda f: f.relative_to(root).as_posix())
    order = [files[i] for i in sorted(range(len(files)), key=lambda i: (i * data.TORCH_STRIDE) % len(files))]
    dealt = [f for f in order if f.stat().st_size][:sum(len(v) for v in splits.values())]
    assert splits["valid"] + splits["test"] + splits["train"] == dealt  # in order, each split whole
    held = {name: sum(f.stat().st_size for f in files_) for name, files_ in splits.items()}
    largest = max(f.stat().st_size for f in files)
    for name, budget in budgets.items():
        assert budget <= held[name] < budget + largest, (name, held)
    assert data.torch_source_files(root, plan) == splits  # no random draw


def test_the_held_out_corpus_of_the_installed_torch_is_cut_to_the_text_tasks_size():
    import os

    splits = data.torch_source_files(os.path.dirname(torch.__file__))
    held = {name: sum(f.stat().st_size for f in files) for name, files in splits.items()}
    for name, budget in data.TORCH_SPLIT_BYTES:
        assert budget <= held[name] < budget + 2_000_000, (name, held)  # closed at the file that filled it
    assert not set(splits["train"]) & set(splits["valid"]) and not set(splits["train"]) & set(splits["test"])
