"""Data-parallel training under horovodrun: ``python -m accordion_hvd.train``.

    horovodrun -np 2 -H localhost:2 python -m accordion_hvd.train --epochs 15

Every rank trains on its shard of the data with Horovod's DistributedOptimizer; rank 0
reports the test accuracy, averaged over all ranks' shards of the test set.
"""

from __future__ import annotations

import argparse
import logging
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from .data import load_digits, shard_batches
from .models import SmallCNN

log = logging.getLogger("accordion_hvd.train")

COMPRESSIONS = {"none": lambda: hvd.Compression.none, "fp16": lambda: hvd.Compression.fp16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m accordion_hvd.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compression", choices=sorted(COMPRESSIONS), default="none",
                   help="gradient compression (default: none)")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate per rank (scaled by world size)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.lr <= 0:
        p.error(f"--lr must be positive, got {args.lr}")
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
                                   compression=COMPRESSIONS[args.compression]())
    log.info("training on %d ranks, compression=%s, %d train / %d test images",
             hvd.size(), args.compression, len(train.y), len(test.y))

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
    return acc


if __name__ == "__main__":
    main()
