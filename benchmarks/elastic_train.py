"""Training under Horovod Elastic with AccordionCompressor, for the worker-failure runs of
benchmarks/reliability.py on the emulated cluster (benchmarks/cluster/).

    horovodrun --gloo --network-interfaces hvd0 --min-np 1 --max-np 2 \\
        --host-discovery-script benchmarks/cluster/discover_hosts.sh \\
        python benchmarks/elastic_train.py --epochs 20 --die-on node2 --die-at 100

The compressor's state is in ``hvd.elastic.TorchState`` (``import accordion_hvd.elastic``),
committed every ``--commit-every`` steps and at each epoch's end. With ``--die-on HOST`` the
worker on HOST is killed (SIGKILL, as the OOM killer or a lost machine would end it: no
cleanup, no goodbye to the other ranks) in the middle of step ``--die-at``'s backward pass
(from a gradient hook, so its compressed exchanges are in flight on the other ranks):
Horovod blacklists the host, the survivors restore the last commit and go on in a smaller
world; a host added to the discovery file later joins and gets the state by ``sync``.
Rank 0 prints one line per epoch (world size, test accuracy) and at the end the final
accuracy, the world sizes seen, and whether every rank ended with the same parameters and
the same shared compressor state.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import socket
import sys
import time
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import accordion_hvd as acc  # noqa: E402
import accordion_hvd.elastic  # noqa: E402,F401  (lets TorchState hold the compressor)
from accordion_hvd.cli import data, models  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.02, help="per rank: scaled by the world size of the moment")
    p.add_argument("--lr-milestones", default="12", help="epochs at which the lr is multiplied by 0.1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-seconds", type=float, default=0.0,
                   help="sleep this long after each step (gives a joining worker time to start; no effect on the math)")
    p.add_argument("--commit-every", type=int, default=5, help="optimizer steps between state.commit()")
    p.add_argument("--die-on", default="", help="hostname whose worker is killed mid-step (once)")
    p.add_argument("--die-at", type=int, default=100, help="global optimizer step at which it is killed")
    p.add_argument("--died-file", type=Path, default=None, help="the dying worker creates this file first "
                                                                "(lets a driver add a host afterwards)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    milestones = [int(m) for m in args.lr_milestones.split(",") if m]
    hvd.init()
    torch.manual_seed(args.seed)
    train_split, test_split = data.load_digits(seed=args.seed)
    model = models.SmallCNN(channels=1)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    compression = acc.AccordionCompressor(acc.PowerSGD(rank=1, critical_rank=4), interval=None)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, compression=compression,
                                   epoch=0, batch=0, step=0, sizes=[])
    host = socket.gethostname()
    die = {"armed": host == args.die_on}

    def maybe_die(grad):
        if die["armed"] and state.step == args.die_at:
            print(f"{host}: worker killed (SIGKILL) in the backward pass of step {state.step}", flush=True)
            if args.died_file is not None:
                args.died_file.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    model.features[0].weight.register_hook(maybe_die)

    @hvd.elastic.run
    def train(state):
        state.sizes = [*state.sizes, hvd.size()]  # one entry per (re)start of the world
        while state.epoch < args.epochs:
            lr = args.lr * hvd.size() * 0.1 ** sum(state.epoch >= m for m in milestones)
            for group in opt.param_groups:
                group["lr"] = lr
            batches = data.shard_batches(train_split, args.batch_size, hvd.rank(), hvd.size(), state.epoch, args.seed)
            for i, (x, y) in enumerate(batches):
                if i < state.batch:  # done before the last commit
                    continue
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
                state.batch, state.step = i + 1, state.step + 1
                time.sleep(args.step_seconds)
                if state.step % args.commit_every == 0:
                    state.commit()
            compression.epoch_end()
            accuracy = evaluate(model, test_split)
            state.epoch, state.batch = state.epoch + 1, 0
            state.commit()
            if hvd.rank() == 0:
                print(f"epoch {state.epoch} size {hvd.size()} step {state.step} accuracy {accuracy:.4f}", flush=True)

    train(state)
    accuracy = evaluate(model, test_split)
    same = ranks_agree(model, compression)
    if hvd.rank() == 0:
        print(f"final test accuracy: {accuracy:.4f}; world sizes {state.sizes}; steps {state.step}; "
              f"ranks agree: {same}", flush=True)


@torch.no_grad()
def evaluate(model, split) -> float:
    model.eval()
    correct = (model(split.x).argmax(1) == split.y).sum().item()
    model.train()
    return correct / len(split.y)


def ranks_agree(model, compression) -> bool:
    """Whether every rank holds the same parameters and the same shared compressor state
    (levels, warm-start Q, counters), by digest."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    shared = compression.state_dict()
    digest.update(repr(sorted(shared["controller"]["levels"].items())).encode())
    for name, layer in sorted(shared["layers"].items()):
        digest.update(layer["qt"].numpy().tobytes())
    digest.update(repr((shared["steps"], sorted(shared["sent"].items()))).encode())
    mine = torch.tensor(list(digest.digest()[:8]), dtype=torch.uint8).unsqueeze(0)
    everyone = hvd.allgather(mine, name="elastic.agree")
    return bool((everyone == everyone[0]).all())


if __name__ == "__main__":
    main()
