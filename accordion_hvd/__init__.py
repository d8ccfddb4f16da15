"""accordion-hvd: communication-efficient Horovod training for PyTorch.

Gradient compression (PowerSGD, TopK, with error feedback) whose level adapts per layer to
the phase of training (the Accordion rule). Importing the package loads the compiled
kernels and refuses a missing or stale build with an ImportError that says how to build.

Importing it has no side effect on Horovod or the environment: Horovod's background-loop
cycle is the user's choice (``quiet_horovod_cycle()``, before ``hvd.init()``).
"""

from ._extension import load as _load_extension

_C = _load_extension()  # registers torch.ops.accordion.*; raises ImportError if unusable

from . import levels, ops, policies  # noqa: E402
from .batch_size import AccordionBatchSize  # noqa: E402
from . import codecs  # noqa: E402
from .codecs import PowerSGD, Quantize, Sign, TopK  # noqa: E402
from .compressor import Compressor  # noqa: E402
from .horovod import AccordionCompressor, quiet_horovod_cycle  # noqa: E402
from .ddp import register_ddp_hook  # noqa: E402
from .hsdp import compress_hsdp  # noqa: E402
from .periodic import DiLoCo, OneBitAdam, SyncInterval  # noqa: E402

__version__ = "0.1.0"
with_cuda: bool = bool(_C.with_cuda)

__all__ = ["AccordionBatchSize", "AccordionCompressor", "Compressor", "DiLoCo", "OneBitAdam", "PowerSGD", "Quantize", "Sign", "TopK", "codecs", "compress_hsdp", "levels", "ops", "policies",
           "quiet_horovod_cycle", "register_ddp_hook", "SyncInterval", "with_cuda", "__version__"]
