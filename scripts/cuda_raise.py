"""Diagnostic: an accordion:: op that must raise (a bad argument) on the CPU, then on CUDA."""
import torch

import accordion_hvd as acc

for device in ("cpu", "cuda"):
    try:
        acc.ops.topk_ef(torch.randn(3, device=device), torch.randn(3, device=device), 5)
    except RuntimeError as e:
        print(f"{device}: raised as expected: {str(e).splitlines()[0][:90]}", flush=True)
