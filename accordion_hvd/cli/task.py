"""What the training CLI trains: the device, the task (data and metric), the model, the
optimizer, the loss and the evaluation over every rank's slice. No training loop here
(cli/train.py), no communication but the evaluation's one sum."""

from __future__ import annotations

import logging
import math
import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import data, models

log = logging.getLogger("accordion_hvd.train")


def device_type(choice: str) -> str:
    return "cpu" if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()) else "cuda"


def pick_device(choice: str, local_rank: int) -> torch.device:
    """The GPU of this rank's local rank (shared round-robin when there are fewer GPUs
    than ranks on a host), or the CPU."""
    if device_type(choice) == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


class Task(NamedTuple):
    train: data.Split
    valid: data.Split | None  # evaluated after every epoch (else the test split is)
    test: data.Split
    metric: str               # "accuracy" (classification) or "perplexity" (language modelling)
    classes: int              # classes, or the vocabulary's size


def load_data(args) -> Task:
    """The task of --dataset, cut to --max-train-samples / --max-eval-samples; a missing file
    ends the run with one line naming it."""
    task = _load_whole(args)
    train, valid, test = (_first(split, n) for split, n in ((task.train, args.max_train_samples),
                                                            (task.valid, args.max_eval_samples),
                                                            (task.test, args.max_eval_samples)))
    return task._replace(train=train, valid=valid, test=test)


def _first(split: data.Split | None, n: int) -> data.Split | None:
    return split if split is None or n == 0 else data.Split(split.x[:n], split.y[:n])


def _load_whole(args) -> Task:
    try:
        if args.dataset == "text":
            corpus = data.load_text(seq_len=args.seq_len)
            log.info("corpus: the standard library of Python %s (%d files, sha256 %s), %s / %s / %s training / "
                     "validation / test tokens; vocabulary: %d", ".".join(map(str, sys.version_info[:3])),
                     len(data.TEXT_TRAIN + data.TEXT_VALID + data.TEXT_TEST), corpus.digest,
                     *(f"{split.y.numel():,}" for split in corpus[:3]), len(corpus.vocabulary))
            return Task(corpus.train, corpus.valid, corpus.test, "perplexity", len(corpus.vocabulary))
        if args.dataset == "torch-source":
            corpus = data.load_torch_source(seq_len=args.seq_len)
            log.info("corpus: the source of torch %s (evidence-v3's held-out corpus, sha256 %s), %s / %s / %s "
                     "training / validation / test tokens; vocabulary: %d", torch.__version__, corpus.digest,
                     *(f"{split.y.numel():,}" for split in corpus[:3]), len(corpus.vocabulary))
            return Task(corpus.train, corpus.valid, corpus.test, "perplexity", len(corpus.vocabulary))
        if args.dataset == "digits":
            train, test = data.load_digits(seed=args.seed, folds=args.folds, fold=args.fold)
        elif args.dataset == "synthetic" and args.model in ("cnn", "cnn-wide"):
            train, test = data.load_synthetic(seed=args.seed, channels=1, size=8)
        elif args.dataset == "synthetic":
            # 3x32x32 images for ResNet-18 throughput runs: fewer of them (4,096 + 1,024 is 63 MB)
            train, test = data.load_synthetic(seed=args.seed, n_train=4_096, n_test=1_024)
        else:
            train, test = data.load_cifar10(args.data_dir)
    except FileNotFoundError as exc:
        raise SystemExit(str(exc)) from None
    return Task(train, None, test, "accuracy", 10)


def make_model(args, task: Task) -> torch.nn.Module:
    if args.model == "lstm":
        return models.LSTMLanguageModel(task.classes)
    if args.model == "transformer":
        return models.TransformerLanguageModel(task.classes, context=args.seq_len)
    if args.model == "gru":
        return models.GRULanguageModel(task.classes)
    train = task.train
    channels = train.x.shape[1]
    if args.model in ("cnn", "cnn-wide"):
        if tuple(train.x.shape[2:]) != (8, 8):
            raise SystemExit(f"--model {args.model} takes 8x8 images; {args.dataset} has {tuple(train.x.shape[2:])}: "
                             f"use --model resnet18")
        return (models.SmallCNN if args.model == "cnn" else models.WideCNN)(channels=channels)
    return models.ResNet18(channels=channels)


def make_optimizer(name: str, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """SGD with momentum 0.9 (the papers' CNNs and LSTM), or AdamW (what transformers are
    usually trained with: betas 0.9/0.999, weight decay 0.01 on matrices only)."""
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": 0.01}, {"params": others, "weight_decay": 0.0}],
                             lr=lr)


def loss_of(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of class logits (N, C) or next-token logits (N, T, V)."""
    return F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction=reduction)


@torch.no_grad()
def evaluate(front, model: torch.nn.Module, split: data.Split, metric: str) -> float:
    """Accuracy, or perplexity (exp of the mean cross-entropy per token), over all ranks:
    each rank scores its slice, the sums are reduced."""
    model.eval()
    mine = slice(front.rank, None, front.size)
    score = torch.zeros((), dtype=torch.float64)
    for xb, yb in zip(split.x[mine].split(512), split.y[mine].split(512)):
        logits = model(xb)
        score += (logits.argmax(1) == yb).sum().double().cpu() if metric == "accuracy" else \
            loss_of(logits, yb, reduction="sum").double().cpu()
    count = float(split.y[mine].numel())
    totals = front.sum(torch.stack([score, torch.tensor(count, dtype=torch.float64)]), name=f"eval.{metric}")
    model.train()
    mean = (totals[0] / totals[1]).item()
    return mean if metric == "accuracy" else math.exp(min(mean, 700.0))  # a diverged run: inf, not an overflow
