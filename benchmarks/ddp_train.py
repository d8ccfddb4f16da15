"""The peer a user would pick instead: PyTorch DDP with its PowerSGD communication hook,
on the same task as ``python -m accordion_hvd.train`` (benchmarks/e2e.py runs both).

    torchrun --nnodes 2 --nproc_per_node 1 --node_rank K --master_addr node1 --master_port 29533 \\
        benchmarks/ddp_train.py --model cnn-wide --rank 4 --epochs 10 --logdir runs/ddp
    ... benchmarks/ddp_train.py --model lstm --rank 4 --epochs 6 --lr 0.5 --lr-milestones 4   # the LM task

Same data (digits with its cross-validation folds, or the standard-library text), sharding,
model, seed, optimizer and schedule as our CLI (SGD with momentum 0.9,
lr per rank times the world size, decays at --lr-milestones); Gloo backend. The hook is
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` with error feedback and warm
start, PowerSGD from step 2 (its earliest), ``min_compression_rate`` 2 as ours. Rank 0 writes
``steps.csv`` and ``eval.csv`` in our CLI's format (``accordion_hvd.cli.metrics``), floats sent
counted by the hook's own rule (a matrix is compressed when (n + m) r * 2 < n m).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from accordion_hvd.cli import data, models  # noqa: E402
from accordion_hvd.cli.metrics import MetricsLogger  # noqa: E402

START_ITER, MIN_RATE = 2, 2.0


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("cnn", "cnn-wide", "lstm"), default="cnn-wide",
                   help="lstm: the language model of our CLI's --dataset text (2 layers, 128, tied)")
    p.add_argument("--seq-len", type=int, default=35, help="lstm: tokens per training sequence")
    p.add_argument("--rank", type=int, default=4, help="PowerSGD rank (0: no hook, plain DDP allreduce)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.02, help="per rank, scaled by the world size")
    p.add_argument("--lr-milestones", default="")
    p.add_argument("--lr-gamma", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--folds", type=int, default=5, help="digits cross-validation folds (as our CLI)")
    p.add_argument("--fold", type=int, default=0, help="the fold that is the test set (as our CLI)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="DDP's bucket size; default: DDP's own (25 MB, the first bucket 1 MB)")
    p.add_argument("--group-per-bucket", action="store_true",
                   help="each DDP bucket's collectives on a Gloo group of their own (group_per_bucket: the fix "
                        "of the hook's race with several buckets)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after N optimizer steps (smoke runs)")
    p.add_argument("--logdir", type=Path, default=None)
    return p.parse_args()


def floats_per_step(model, rank: int, compressing: bool) -> int:
    """What this rank sends per step under the hook's rule (or dense)."""
    total = 0
    for p in model.parameters():
        if not compressing or p.dim() <= 1:
            total += p.numel()
            continue
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(rank, n, m)
        total += (n + m) * r if (n + m) * r * MIN_RATE < n * m else p.numel()
    return total


def gloo_options():
    """The Gloo group's options: Gloo's defaults, but 8 worker threads instead of 2.

    With several buckets PyTorch's powerSGD_hook can deadlock on Gloo (seen with cnn-wide,
    2 buckets, torch 2.13): the hook calls ``.wait()`` on a new allreduce inside a future
    callback (powerSGD_hook.py, ``unpack_uncompressed_tensors_and_allreduce_ps`` and
    ``compute_qs``), callbacks run on the group's worker threads, and when two buckets'
    callbacks block at once no thread is left to run the allreduces they wait for (py-spy:
    both threads in ``unpack_uncompressed_tensors_and_allreduce_ps``). With more threads than
    buckets a blocked callback always leaves one free, so DDP keeps its default buckets.
    That trades the hang for a race: two buckets' callbacks issue their allreduces from two
    threads, Gloo numbers collectives in the order they are issued, and the ranks can pair
    different tensors. On the LSTM (2 buckets) it fails every time ("collective mismatch",
    benchmarks/ddp_hook_gloo.py, results/ddp-hook-gloo.md); there the evidence runs give DDP
    one bucket (``--bucket-cap-mb 1000``, protocol evidence-v1, amendment 1). The fix that
    keeps DDP's buckets, a Gloo group per bucket (``group_per_bucket``), came later; the
    step-time benchmark's ``ddp-pg-*`` methods use it.
    """
    options = dist.ProcessGroupGloo._Options()
    options._threads = 8
    return options


def group_per_bucket(hook, model, bucket_cap_mb: float = 25.0):
    """``hook`` (PyTorch's ``powerSGD_hook``) with each DDP bucket's collectives on a Gloo
    group of their own: the fix of the race in ``gloo_options``'s docstring.

    Within one bucket the hook issues its collectives one after the other (the uncompressed
    tensors, then P, then Q, each from the callback of the one before), so every rank issues
    them in the same order; only two buckets' chains interleave differently on different ranks.
    On a group per bucket they cannot: Gloo pairs each group's collectives by their order in
    that group. The hook's math, its state (one ``PowerSGDState``, keyed by bucket index as
    before) and DDP's default buckets are PyTorch's; only the group a bucket talks in differs.
    Every rank makes the groups here, before training, in the same order (a collective)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    # DDP closes a bucket once it holds its cap (1 MiB for the first): at most this many
    count = 2 + math.ceil(total / (bucket_cap_mb * 2**20))
    groups = [dist.new_group(backend="gloo", pg_options=gloo_options()) for _ in range(count)]

    def hook_in_bucket_group(state, bucket):
        if bucket.index() >= count:
            raise RuntimeError(f"DDP made bucket {bucket.index()}, but group_per_bucket made {count} groups")
        state.process_group = groups[bucket.index()]
        return hook(state, bucket)

    return hook_in_bucket_group


def loss_of(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of class logits (N, C) or next-token logits (N, T, V), as our CLI."""
    return F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction=reduction)


@torch.no_grad()
def evaluate(model, split, metric: str) -> float:
    """Accuracy, or perplexity (exp of the mean cross-entropy per token), on the whole split."""
    model.eval()
    score = 0.0
    for xb, yb in zip(split.x.split(512), split.y.split(512)):
        logits = model(xb)
        score += (logits.argmax(1) == yb).sum().item() if metric == "accuracy" else \
            loss_of(logits, yb, reduction="sum").item()
    model.train()
    mean = score / split.y.numel()
    return mean if metric == "accuracy" else math.exp(min(mean, 700.0))


def main() -> None:
    args = parse_args()
    milestones = [int(m) for m in args.lr_milestones.split(",") if m]
    dist.init_process_group("gloo", pg_options=gloo_options())
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    if args.model == "lstm":  # our CLI's --dataset text: validation perplexity per epoch, test at the end
        corpus = data.load_text(seq_len=args.seq_len)
        train, valid, test, metric = corpus.train, corpus.valid, corpus.test, "perplexity"
        model = models.LSTMLanguageModel(len(corpus.vocabulary))
    else:
        train, test = data.load_digits(seed=args.seed, folds=args.folds, fold=args.fold)
        valid, metric = test, "accuracy"
        model = (models.SmallCNN if args.model == "cnn" else models.WideCNN)(channels=1)
    # DDP's default buckets unless told (gloo_options: why the group has more threads).
    buckets = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    ddp = DistributedDataParallel(model, **buckets)  # broadcasts rank 0's parameters
    if args.rank > 0:
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=args.rank,
                                       start_powerSGD_iter=START_ITER, min_compression_rate=MIN_RATE,
                                       use_error_feedback=True, warm_start=True, random_seed=args.seed)
        hook = powersgd.powerSGD_hook
        if args.group_per_bucket:
            hook = group_per_bucket(hook, model, args.bucket_cap_mb or 25.0)
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr * size, momentum=0.9)
    names = [n for n, _ in model.named_parameters()]
    metrics = MetricsLogger(args.logdir, layers=names, overwrite=True) if rank == 0 and args.logdir else None
    dense = sum(p.numel() for p in model.parameters())
    sent = step = 0
    start = time.perf_counter()
    for epoch in range(args.epochs):
        lr = args.lr * size * args.lr_gamma ** sum(epoch >= m for m in milestones)
        for group in opt.param_groups:
            group["lr"] = lr
        for x, y in data.shard_batches(train, args.batch_size, rank, size, epoch, args.seed):
            opt.zero_grad()
            loss = loss_of(ddp(x), y)
            loss.backward()
            opt.step()
            sent += floats_per_step(model, args.rank, args.rank > 0 and step >= START_ITER)
            step += 1
            if metrics is not None:
                metrics.log_step(step, epoch=epoch + 1, loss=loss.item(), lr=lr, floats_sent=sent,
                                 floats_dense=step * dense, levels={}, compress_s=math.nan, comm_s=math.nan,
                                 wall_s=time.perf_counter() - start)
            if step == args.max_steps:  # every rank stops at the same step: no collective left waiting
                break
        score = evaluate(model, valid, metric)
        if metrics is not None:
            metrics.log_eval(step, epoch=epoch + 1, wall_s=time.perf_counter() - start, floats_sent=sent,
                             **{metric: score})
        if rank == 0:
            print(f"epoch {epoch + 1} {metric} {score:.4f} wall {time.perf_counter() - start:.1f} s", flush=True)
        if step == args.max_steps:
            break
    if valid is not test:
        score = evaluate(model, test, metric)
    if rank == 0:
        print(f"final test {metric}: {score:.4f} ({size} ranks, {args.epochs} epochs, "
              f"{time.perf_counter() - start:.1f} s)", flush=True)
    if metrics is not None:
        metrics.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "hvd0")
    main()
