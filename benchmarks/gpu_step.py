"""A GPU training step: our DDP hook against DDP's own hooks, every method in one launch
(issue 65; the device image has torch with CUDA and torchrun, no Horovod).

    torchrun --standalone --nproc_per_node 1 benchmarks/gpu_step.py --out DIR     # one GPU, NCCL (world 1)
    torchrun --standalone --nproc_per_node 2 benchmarks/gpu_step.py --backend gloo \\
        --methods fp16,ours-default,ours-quantize8s,ours-r4 --out DIR             # 2 processes share the GPU

Per model, in each of ``--rounds`` rounds every method trains a fresh copy of the same model
(seed 0) wrapped in DDP (default buckets) with its hook, for ``--steps`` steps on synthetic
batches; steps 4 to 12 are timed, each with the GPU synchronized before the clock is read,
and the run's median step is the method's figure for that round (``ours-default`` runs
two detection windows longer, past its link gate's trials, and its last steps are timed). The methods' order rotates
from round to round, so that a slow moment hits them alike; ratios are taken within a round.
World 1 over NCCL: no link to wait for, but every hook still does its work (casts, the
compression math, its one-rank collectives): what compression costs a GPU step.

Methods: ``none`` (DDP's own allreduce), ``fp16`` (``fp16_compress_hook``), ``powersgd-r4``
(``powerSGD_hook`` at rank 4, PowerSGD from step 2, error feedback and warm start: its
documented options; over Gloo with a group per DDP bucket, ddp_train.py ``group_per_bucket``,
without which its buckets' collectives pair wrongly there), ``ours-default`` (``acc.register_ddp_hook(ddp, acc.AccordionCompressor())``:
the default, its link gate included, which may settle on 16-bit dense where compression does
not pay), ``ours-quantize8s`` (the default's codec without the gate:
``Quantize(8, skip_energy=0.05)``, static), ``ours-r4`` (``PowerSGD(rank=4)``, static).
The report: each method's median over all its rounds, and per pair (ours / PyTorch's: the
default and its codec against fp16, ours-r4 against powersgd-r4) the median of the per-round
ratios and in how many rounds ours was faster; for our hooks, the data plane they built.
Writes ``DIR/gpu-step.md`` and ``DIR/gpu-step.json`` (every run).

``--device cpu --tiny`` runs the same on the CPU with small models (the script's own test,
tests/test_gpu_step.py).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpu_models import GPT2Small, ResNet50  # noqa: E402

import accordion_hvd as acc  # noqa: E402

METHODS = ("none", "fp16", "powersgd-r4", "ours-default", "ours-quantize8s", "ours-r4")
PAIRS = [("ours-default", "fp16", 1.05), ("ours-quantize8s", "fp16", None), ("ours-r4", "powersgd-r4", 1.0)]
FIRST, LAST = 3, 12  # steps FIRST+1..LAST timed: the first ones warm up (cuDNN, buckets, the gate's first trial)


def build(name: str, tiny: bool, batch: int, device: torch.device):
    """(model, batches, optimizer class and its arguments) of ``name``, seed 0."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    if name == "resnet50":
        model, size = ResNet50(tiny=tiny), 32 if tiny else 224
        data = [(torch.randn(batch, 3, size, size, generator=gen), torch.randint(0, 1000, (batch,), generator=gen))
                for _ in range(2)]
        optimizer = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    elif name == "gpt2-small":
        model = GPT2Small(tiny=tiny)
        tokens = [torch.randint(0, model.vocabulary, (batch, model.context + 1), generator=gen) for _ in range(2)]
        data = [(t[:, :-1], t[:, 1:].reshape(-1)) for t in tokens]
        optimizer = (torch.optim.AdamW, {"lr": 3e-4})
    else:
        raise SystemExit(f"--models: resnet50 or gpt2-small, got {name!r}")
    return model.to(device), [(x.to(device), y.to(device)) for x, y in data], optimizer


def wrap(method: str, model, opt, device: torch.device):
    """DDP with ``method``'s hook; returns (ddp, compressor or None)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if method == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif method == "powersgd-r4":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                                            min_compression_rate=2, use_error_feedback=True, warm_start=True,
                                            random_seed=0)
        hook = powerSGD_hook.powerSGD_hook
        if dist.get_backend() == "gloo":  # its buckets' collectives race on one Gloo group (ddp_train.py)
            from ddp_train import group_per_bucket
            hook = group_per_bucket(hook, model)
        ddp.register_comm_hook(state, hook)
    elif method.startswith("ours-"):
        compressor = {"ours-default": lambda: acc.AccordionCompressor(),
                      "ours-quantize8s": lambda: acc.AccordionCompressor(acc.Quantize(8, skip_energy=0.05),
                                                                         policy="static"),
                      "ours-r4": lambda: acc.AccordionCompressor(acc.PowerSGD(rank=4), policy="static")}[method]()
        acc.register_ddp_hook(ddp, compressor, optimizer=opt)
        return ddp, compressor
    return ddp, None


def run(method: str, initial, data, optimizer, steps: int, device: torch.device) -> dict:
    """One method on a fresh copy of the model: its median step and what it built."""
    model = copy.deepcopy(initial)
    opt = optimizer[0](model.parameters(), **optimizer[1])
    ddp, compressor = wrap(method, model, opt, device)
    if method == "ours-default":  # past the link gate's two trial windows: its steady step, whichever it chose
        steps += 2 * compressor.interval
    times = []
    for step in range(steps):
        x, y = data[step % len(data)]
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        if compressor is None or not compressor.step_skipped:
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    timed = times[steps - (LAST - FIRST) - 2:steps - 2]  # the last steps but two (steps 4-12 of a 14-step run)
    result = {"method": method, "step_s": statistics.median(timed), "steps_s": times}
    if compressor is not None:
        channel = compressor.channel
        result["data_plane"] = f"{type(channel).__name__} ({dist.get_backend()}), {channel.size} rank(s)"
        result["levels"] = sorted({layer["level"] for layer in compressor.stats()["layers"].values()})
        result["gate"] = (compressor.stats()["gate"] or {}).get("verdict")
    del ddp, model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def report(runs: list[dict], args, device_name: str) -> str:
    lines = [f"# A GPU training step: our DDP hook against DDP's own ({device_name})", "",
             f"{dist.get_world_size()} process(es), backend {dist.get_backend()}, torch {torch.__version__}, "
             f"{platform.node()}. Per model, {args.rounds} rounds; in each, every method on a fresh copy of the "
             f"model for {args.steps} steps, steps {FIRST + 1}-{LAST} timed (synchronized), the median per run; "
             f"the order rotating. Command: `torchrun --standalone --nproc_per_node {dist.get_world_size()} "
             f"benchmarks/gpu_step.py {' '.join(sys.argv[1:])}`. Every run: gpu-step.json.", ""]
    for model in args.models.split(","):
        mine = [r for r in runs if r["model"] == model]
        lines += [f"## {model} (batch {args.batch[model]} per process)", "",
                  "| method | median step (s) over all rounds | range | data plane (ours) | levels at the end |",
                  "|---|---|---|---|---|"]
        for method in args.methods.split(","):
            steps = [r["step_s"] for r in mine if r["method"] == method]
            last = next((r for r in reversed(mine) if r["method"] == method), {})
            lines.append(f"| {method} | {statistics.median(steps):.4f} | {min(steps):.4f}-{max(steps):.4f} | "
                         f"{last.get('data_plane', '')} | {', '.join(last.get('levels', []))} |")
        lines += ["", "| ours / PyTorch's | per-round ratio, median (range) | rounds ours faster | bar |",
                  "|---|---|---|---|"]
        for ours, peer, bar in PAIRS:
            ratios = []
            for r in range(args.rounds):
                a = [x["step_s"] for x in mine if x["method"] == ours and x["round"] == r]
                b = [x["step_s"] for x in mine if x["method"] == peer and x["round"] == r]
                if a and b:
                    ratios.append(a[0] / b[0])
            if ratios:
                verdict = "" if bar is None else f"at most {bar:.2f}x: {'met' if statistics.median(ratios) <= bar else 'not met'}"
                lines.append(f"| {ours} / {peer} | {statistics.median(ratios):.3f}x ({min(ratios):.3f}-"
                             f"{max(ratios):.3f}) | {sum(x < 1 for x in ratios)} of {len(ratios)} | {verdict} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet50,gpt2-small")
    p.add_argument("--methods", default="none,fp16,powersgd-r4,ours-default,ours-quantize8s,ours-r4")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=LAST + 2)
    p.add_argument("--batch", default="resnet50=64,gpt2-small=8", help="per process, model=N,...")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None, help="default: nccl on CUDA, gloo on the CPU")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="small models (the CPU check of this script)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if unknown or args.rounds < 1 or args.steps < LAST + 2:
        p.error(f"unknown methods {unknown} (known: {', '.join(METHODS)})" if unknown else
                f"--rounds must be >= 1 and --steps >= {LAST + 2}")
    args.batch = {k: int(v) for k, v in (item.split("=") for item in args.batch.split(","))}
    if args.device == "cuda":
        if not torch.cuda.is_available():
            p.error("--device cuda: no CUDA GPU on this machine")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # what a user runs
        torch.backends.cudnn.benchmark = True
    else:
        device = torch.device("cpu")
    backend = args.backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "gloo":  # 8 worker threads: PowerSGD's hook blocks inside callbacks (ddp_train.gloo_options)
        from ddp_train import gloo_options
        dist.init_process_group(backend, pg_options=gloo_options())
    else:
        dist.init_process_group(backend)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    methods, runs = args.methods.split(","), []
    for model_name in args.models.split(","):
        initial, data, optimizer = build(model_name, args.tiny, args.batch[model_name], device)
        for r in range(args.rounds):
            for method in methods[r % len(methods):] + methods[:r % len(methods)]:
                result = run(method, initial, data, optimizer, args.steps, device)
                runs.append({"model": model_name, "round": r, **result})
                if dist.get_rank() == 0:
                    print(f"{model_name} round {r + 1}/{args.rounds}: {method}: {result['step_s']:.4f} s/step",
                          flush=True)
    if dist.get_rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu-step.json").write_text(json.dumps(runs, indent=1))
        (args.out / "gpu-step.md").write_text(report(runs, args, name))
        print(report(runs, args, name))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
