"""Plain-torch reference implementations of every ``accordion::`` kernel.

Each function here defines what the matching op must compute; tests compare the compiled
kernels (CPU and CUDA) against these. They are also what a reader should look at first to
understand an op. They are not a fallback for a missing build.
"""

from __future__ import annotations

import torch


def ef_add(grad: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """Error-feedback add: ``grad + residual`` in the residual's dtype.

    The residual may be float32 while the gradient is float16/bfloat16 (error feedback is
    accumulated in higher precision); otherwise both have the same dtype.
    """
    return residual + grad.to(residual.dtype)
