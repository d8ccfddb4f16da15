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
Network faults (a cut link, a frozen worker) are injected from outside by
benchmarks/reliability.py; ``--mark-at STEP --mark-file PATH`` tells it when (rank 0 creates
PATH once step STEP is done) and ``--pid-dir`` where each worker's process id is.

Nothing may be lost in a recovery: every rank records a digest of each piece of its state at
every commit (parameters, optimizer state, the compressor's error feedback, warm-start Q,
levels, controller and policy state, counters, the step) and, when Horovod Elastic runs
``train`` again after a failure (restore, new world, sync), compares each piece with that
record. Rank 0 prints one line per epoch (world size, test accuracy) and at the end the
final accuracy, the world sizes seen, whether every rank ended with the same parameters and
the same shared compressor state, and the recoveries checked and pieces that differed.
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
    p.add_argument("--mark-at", type=int, default=0, help="rank 0 creates --mark-file once this step is done")
    p.add_argument("--mark-file", type=Path, default=None)
    p.add_argument("--pid-dir", type=Path, default=None, help="each worker writes HOSTNAME.pid here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    milestones = [int(m) for m in args.lr_milestones.split(",") if m]
    acc.quiet_horovod_cycle()
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
    if args.pid_dir is not None:
        (args.pid_dir / f"{host}.pid").write_text(str(os.getpid()))
    committed: dict[str, str] = {}  # piece of state -> its digest at this rank's last commit
    checks = {"recoveries": 0, "pieces": 0, "mismatches": []}

    def commit():
        # Recorded first: commit() saves, then raises HostsUpdatedInterrupt if hosts changed.
        committed.clear()
        committed.update(state_digests(model, opt, compression, state.step))
        state.commit()

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
        if state.sizes and committed:  # a recovery: restored, world re-formed, synced
            now = state_digests(model, opt, compression, state.step)
            checks["recoveries"] += 1
            checks["pieces"] += len(committed)
            checks["mismatches"] += [f"rank {hvd.rank()}: {k}" for k in committed if now.get(k) != committed[k]]
            print(f"{host}: recovered at step {state.step}: {len(committed)} pieces of state compared with the "
                  f"last commit, {sum(now.get(k) != v for k, v in committed.items())} differ", flush=True)
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
                if hvd.rank() == 0 and state.step == args.mark_at and args.mark_file is not None:
                    args.mark_file.touch()
                if state.step % args.commit_every == 0:
                    commit()
            compression.epoch_end()
            accuracy = evaluate(model, test_split)
            state.epoch, state.batch = state.epoch + 1, 0
            commit()
            if hvd.rank() == 0:
                print(f"epoch {state.epoch} size {hvd.size()} step {state.step} accuracy {accuracy:.4f}", flush=True)

    train(state)
    accuracy = evaluate(model, test_split)
    same = ranks_agree(model, compression)
    everyone = hvd.allgather_object(checks, name="elastic.checks")
    if hvd.rank() == 0:
        mismatches = [m for c in everyone for m in c["mismatches"]]
        print(f"final test accuracy: {accuracy:.4f}; world sizes {state.sizes}; steps {state.step}; "
              f"ranks agree: {same}; recoveries checked: {sum(c['recoveries'] for c in everyone)}; "
              f"pieces compared: {sum(c['pieces'] for c in everyone)}; state mismatches: {len(mismatches)}"
              + (f" ({', '.join(mismatches[:8])})" if mismatches else ""), flush=True)


@torch.no_grad()
def evaluate(model, split) -> float:
    model.eval()
    correct = (model(split.x).argmax(1) == split.y).sum().item()
    model.train()
    return correct / len(split.y)


def state_digests(model, opt, compression, step: int) -> dict[str, str]:
    """A digest per piece of this rank's training state (what a recovery must give back)."""
    def feed(h, obj) -> None:  # canonical bytes of nested dicts, lists, tensors and scalars
        if isinstance(obj, torch.Tensor):
            h.update(obj.detach().contiguous().numpy().tobytes())
        elif isinstance(obj, dict):
            for k in sorted(obj, key=repr):
                h.update(repr(k).encode())
                feed(h, obj[k])
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                feed(h, item)
        else:
            h.update(repr(obj).encode())

    def digest(obj) -> str:
        h = hashlib.sha256()
        feed(h, obj)
        return h.hexdigest()[:16]

    own = compression.state_dict()
    controller = own["controller"]
    pieces = {"step": digest(step), "parameters": digest(list(model.parameters())),
              "optimizer momentum": digest([opt.state[p].get("momentum_buffer") for p in model.parameters()]),
              "levels": digest(controller["levels"]),
              "controller and policy": digest({k: v for k, v in controller.items() if k not in ("levels", "sums")}),
              "window sums": digest(controller["sums"]),
              "counters": digest([own["steps"], own["skipped_steps"], own["sent"], own["dense"]])}
    for name, layer in own["layers"].items():
        pieces[f"error feedback {name}"] = digest(layer["residual"])
        if "qt" in layer:
            pieces[f"warm-start Q {name}"] = digest(layer["qt"])
    return pieces


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
