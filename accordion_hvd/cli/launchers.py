"""Which front end the CLI's arguments choose (``--launcher``, ``--sync``): every step
(frontends.py: Horovod, DDP, FSDP) or periodically (periodic.py: DiLoCo, PyTorch's local
SGD). Apart from both, so that neither module imports the other's."""

from __future__ import annotations

from .frontends import DDPFrontEnd, FSDPFrontEnd, HorovodFrontEnd
from .options import diloco_options
from .onebit import OursOneBitAdamFrontEnd
from .onebit_shared import Quantized8WarmupOneBitAdamFrontEnd, SharedVarianceOneBitAdamFrontEnd
from .published import OneBitAdamFrontEnd, PseudoGradientFrontEnd
from .periodic import DiLoCoFrontEnd, HSDPDiLoCoFrontEnd, TorchLocalSGDFrontEnd


def make_front_end(args, device_type: str, ours: bool = False):
    """The front end of the CLI's ``args`` (``--launcher``, ``--sync``; ``--nodes`` and
    ``--reduce-dtype`` for fsdp). ``ours``: the job compresses with AccordionCompressor (no
    gradient through Horovod's loop, so Horovod's cycle is made long: comm/horovod.py
    ``quiet_horovod_cycle``)."""
    if args.sync != "every-step":  # under torchrun (options.py refuses other launchers)
        if args.sync == "diloco" and args.launcher == "fsdp":
            return HSDPDiLoCoFrontEnd(device_type, args.nodes, args.reduce_dtype, diloco_options(args))
        if args.sync == "onebit-adam" and args.variance_every is not None:
            return SharedVarianceOneBitAdamFrontEnd(device_type, args.variance_every)
        if args.sync == "onebit-adam" and args.warmup_bits == 8:
            return Quantized8WarmupOneBitAdamFrontEnd(device_type, args.freeze_step)
        if args.sync == "ours-onebit-adam":
            return OursOneBitAdamFrontEnd(device_type, args.freeze_step, args.max_update)
        if args.sync == "onebit-adam":
            return OneBitAdamFrontEnd(device_type, args.freeze_step)
        if args.sync in ("sparseloco", "signloco"):
            return PseudoGradientFrontEnd(device_type, args.sync, args.sync_every, args.ef_decay, args.outer_lr,
                                          args.topk_density, args.topk_chunk, args.value_bits)
        if args.sync == "diloco":
            return DiLoCoFrontEnd(device_type, diloco_options(args))
        return TorchLocalSGDFrontEnd(device_type, args.sync_every, args.localsgd_warmup)
    if args.launcher == "fsdp":
        return FSDPFrontEnd(device_type, args.nodes, args.reduce_dtype)
    return HorovodFrontEnd(quiet_cycle=ours) if args.launcher == "horovod" else DDPFrontEnd(device_type)
