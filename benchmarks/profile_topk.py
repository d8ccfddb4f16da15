"""A few calls of accordion::topk_ef on the GPU, for Nsight Compute's per-kernel times:

    ncu --print-summary per-kernel python3 benchmarks/profile_topk.py --n 1e8 --ratio 0.1
"""

import argparse

import torch

import accordion_hvd as acc

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--n", type=float, default=1e8)
p.add_argument("--ratio", type=float, default=0.1)
p.add_argument("--dtype", default="float32")
p.add_argument("--calls", type=int, default=2)
args = p.parse_args()
n, k = int(args.n), max(1, int(args.ratio * args.n))
grad = torch.randn(n, device="cuda").to(getattr(torch, args.dtype))
residual = 0.1 * torch.randn(n, device="cuda")
for _ in range(args.calls):
    acc.ops.topk_ef(grad, residual, k)
torch.cuda.synchronize()
