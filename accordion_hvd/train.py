"""Data-parallel training under horovodrun: ``python -m accordion_hvd.train``.

    horovodrun -np 2 -H localhost:2 python -m accordion_hvd.train --codec powersgd --rank 1

Every rank trains on its shard of the data with Horovod's DistributedOptimizer and the
chosen gradient compression; rank 0 reports the test accuracy (over all ranks' shards of
the test set) and the floats this rank sent against what dense allreduce would send.
"""

from __future__ import annotations

import argparse
import logging
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from .codecs import PowerSGD, TopK
from .compressor import AccordionCompressor
from .data import load_digits, shard_batches
from .models import SmallCNN

log = logging.getLogger("accordion_hvd.train")

CODECS = ("none", "fp16", "powersgd", "topk")


def make_codec(args):
    """Our codec for --codec powersgd/topk (raises on bad levels), else None."""
    if args.codec == "powersgd":
        return PowerSGD(args.rank, args.critical_rank)
    if args.codec == "topk":
        return TopK(args.ratio, args.critical_ratio)
    return None


def make_compression(args):
    codec = make_codec(args)
    if codec is not None:
        return AccordionCompressor(codec)
    return hvd.Compression.fp16 if args.codec == "fp16" else hvd.Compression.none


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m accordion_hvd.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codec", choices=CODECS, default="powersgd",
                   help="gradient compression: none, Horovod's fp16, or ours (default: powersgd)")
    p.add_argument("--rank", type=int, default=1, help="PowerSGD rank in normal regimes")
    p.add_argument("--critical-rank", type=int, default=None, help="PowerSGD rank in critical regimes")
    p.add_argument("--ratio", type=float, default=0.05, help="TopK fraction kept in normal regimes")
    p.add_argument("--critical-ratio", type=float, default=None, help="TopK fraction kept in critical regimes")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.02,
                   help="learning rate per rank (scaled by world size); 0.02 keeps the last epochs of a "
                        "compressed run on digits steady, higher rates make them swing by several points")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.lr <= 0:
        p.error(f"--lr must be positive, got {args.lr}")
    try:
        make_codec(args)
    except (TypeError, ValueError) as exc:
        p.error(str(exc))
    return args


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Accuracy over all ranks: each rank scores its slice, the counts are summed."""
    model.eval()
    mine = slice(hvd.rank(), None, hvd.size())
    correct = (model(x[mine]).argmax(1) == y[mine]).sum()
    totals = hvd.allreduce(torch.stack([correct.double(), torch.tensor(float(len(y[mine])), dtype=torch.float64)]),
                           op=hvd.Sum, name="eval.accuracy")
    model.train()
    return (totals[0] / totals[1]).item()


def main(argv=None) -> float:
    args = parse_args(argv)
    hvd.init()
    logging.basicConfig(level=logging.INFO if hvd.rank() == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)
    train, test = load_digits(seed=args.seed)

    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=(compression := make_compression(args)))
    log.info("training on %d ranks, compression %s, %d train / %d test images",
             hvd.size(), compression, len(train.y), len(test.y))

    start = time.perf_counter()
    for epoch in range(args.epochs):
        for x, y in shard_batches(train, args.batch_size, hvd.rank(), hvd.size(), epoch, args.seed):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        acc = evaluate(model, test.x, test.y)
        log.info("epoch %d/%d  loss %.4f  test accuracy %.4f", epoch + 1, args.epochs, loss.item(), acc)
    if hvd.rank() == 0:
        print(f"final test accuracy: {acc:.4f} ({hvd.size()} ranks, {args.epochs} epochs, "
              f"{time.perf_counter() - start:.1f} s)", flush=True)
        if isinstance(compression, AccordionCompressor):
            stats = compression.stats()
            print(f"floats sent by rank 0: {stats['floats_sent']:,} of {stats['floats_dense']:,} "
                  f"({stats['floats_dense'] / stats['floats_sent']:.1f}x less than dense)", flush=True)
    return acc


if __name__ == "__main__":
    main()
