"""Horovod Elastic on the emulated cluster: a worker dies, the job carries on smaller.

    benchmarks/cluster/cluster.sh run 2 --timeout 300 -- \\
        horovodrun --gloo --network-interfaces hvd0 --min-np 1 --max-np 2 \\
        --host-discovery-script benchmarks/cluster/discover_hosts.sh \\
        python benchmarks/cluster/elastic_demo.py --steps 30 --die-on node2 --die-at 10

The worker on host --die-on is killed (SIGKILL) at step --die-at (first attempt only).
Horovod blacklists that host; the remaining workers restore the last `state.commit()`
and finish. Rank 0 prints one line per step with the world size, then 'done'.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import time

import torch
import horovod.torch as hvd


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--die-on", default="", help="hostname whose worker is killed mid-run")
    parser.add_argument("--die-at", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, default=0.2)
    args = parser.parse_args()

    hvd.init()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.step < args.steps:
            if socket.gethostname() == args.die_on and state.step == args.die_at:
                print(f"{socket.gethostname()}: killed (SIGKILL) at step {state.step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            state.step += 1
            state.commit()
            if hvd.rank() == 0:
                print(f"step {state.step} size {hvd.size()}", flush=True)
            time.sleep(args.step_seconds)

    train(state)
    if hvd.rank() == 0:
        print(f"done: {state.step} steps, final size {hvd.size()}", flush=True)


if __name__ == "__main__":
    main()
