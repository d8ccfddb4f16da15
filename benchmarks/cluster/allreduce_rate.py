"""Time a big dense allreduce across the emulated cluster and report the achieved link rate.

Run under horovodrun on the cluster, e.g. (2 nodes, 100 Mbit/s links):

    benchmarks/cluster/cluster.sh run 2 --rate 100mbit --timeout 300 -- \\
        horovodrun -np 2 -H node1:1,node2:1 --gloo --network-interfaces hvd0 \\
        python benchmarks/cluster/allreduce_rate.py --mbytes 25

In a ring allreduce each node sends (and receives) 2 (n-1)/n x the tensor size, which is
the tensor size itself for n = 2; that volume over the median time is the per-link rate
printed, to compare with the configured --rate.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import torch
import horovod.torch as hvd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbytes", type=float, default=25.0, help="tensor size in MB (10^6 bytes)")
    parser.add_argument("--repeats", type=int, default=5, help="timed allreduces after one warm-up")
    args = parser.parse_args()

    hvd.init()
    n = hvd.size()
    numel = int(args.mbytes * 1e6) // 4
    tensor = torch.ones(numel, dtype=torch.float32)

    hvd.allreduce(tensor, op=hvd.Sum, name="warmup")  # connection set-up, allocations
    times = []
    for i in range(args.repeats):
        hvd.allreduce(torch.zeros(1), name=f"barrier.{i}")  # start together
        start = time.perf_counter()
        result = hvd.allreduce(tensor, op=hvd.Sum, name=f"big.{i}")
        times.append(time.perf_counter() - start)
    assert result[0].item() == n and result[-1].item() == n, "allreduce gave a wrong sum"

    median = statistics.median(times)
    per_link_bits = 2 * (n - 1) / n * numel * 4 * 8
    if hvd.rank() == 0:
        print(f"allreduce {numel * 4 / 1e6:.1f} MB float32, {n} ranks "
              f"(hosts {', '.join(sorted(set(hvd.allgather_object(socket.gethostname()))))}): "
              f"median {median:.3f} s over {args.repeats} (min {min(times):.3f}, max {max(times):.3f}); "
              f"per-link rate {per_link_bits / median / 1e6:.0f} Mbit/s", flush=True)
    else:
        hvd.allgather_object(socket.gethostname())


if __name__ == "__main__":
    main()
