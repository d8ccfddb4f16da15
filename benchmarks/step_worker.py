"""One training job for the step-time benchmark: every method runs the same loop.

    horovodrun -np 2 -H node1:1,node2:1 python benchmarks/step_worker.py --method ours-r1 --out r.json
    torchrun ... benchmarks/step_worker.py --method ddp-r4 --out r.json
    python benchmarks/step_worker.py --method floor --out r.json     # on every node at once

The loop is the one a user writes (zero_grad, forward, backward, optimizer step) on a fixed
set of synthetic batches (the data costs nothing), SGD with momentum, one thread per worker.
Only the communication differs between methods:

* ``floor``: no communication at all (run a copy on every node at the same time: the compute
  floor of the step on this machine);
* ``hvd-idle``: the floor with Horovod initialized but never called (what Horovod's
  background cycle costs by itself);
* ``hvd-fp32``, ``hvd-fp16``: Horovod's dense allreduce (``hvd.Compression.none`` / ``fp16``);
* ``ours-r1``, ``ours-r4``, ``ours-accordion`` (rank 1 <-> 4, a window every 4 steps, so it
  switches inside the run), ``ours-network-aware`` (the same levels, chosen by
  ``policies.NetworkAware`` every 4 steps), ``ours-network-aware-fp16`` (the same, with
  float16 as its dense level, ``NetworkAware(dense="fp16")``), ``ours-topk1``, ``ours-topk10`` (1% and 10%):
  ``AccordionCompressor`` in the stock ``hvd.DistributedOptimizer``;
* ``plain-topk1``: TopK 1% with error feedback written the obvious way in plain torch
  (per layer: add the residual, ``topk``, allgather values and indices, scatter-add,
  average), dense allreduce for the rest, as the Accordion authors' code does it;
* ``ddp-idle``: PyTorch DDP whose comm hook sends nothing (it hands DDP its bucket back): what
  DDP's own machinery costs (its autograd hooks, the copies into its buckets and back), the
  floor of any DDP comm hook, as ``hvd-idle`` is of a Horovod job;
* ``ddp-fp32``, ``ddp-fp16``, ``ddp-r1``, ``ddp-r4``: PyTorch DDP with its default buckets
  (and 8 Gloo threads, without which its PowerSGD hook can deadlock: ddp_train.gloo_options),
  plain, with ``fp16_compress_hook``, or with ``powerSGD_hook`` (rank 1 / 4,
  ``start_powerSGD_iter=2``, error feedback and warm start, as its docs recommend);
* ``ddp-pg-r1``, ``ddp-pg-r4``: the same hook with each DDP bucket's collectives on a Gloo
  group of their own (``ddp_train.group_per_bucket``), the fix of the race through which the
  hook aborts with several buckets (most 4-node runs of ``ddp-r1``, ``ddp-r4``);
* ``ddp-ours-r1``, ``ddp-ours-r4``, ``ddp-ours-accordion``: the same DDP with our compressor
  as its comm hook (``acc.register_ddp_hook``), configured as ``ours-*``;
* protocol evidence-v3's methods: ``ours-default`` (``acc.AccordionCompressor()`` in Horovod's
  ``DistributedOptimizer``, quiet cycle), and the periodic ones under torchrun, timed over whole
  periods (``period_step_s``: the mean step over the periods after the warmup, a sync
  included): ``localsgd-p4`` (PyTorch's post-local SGD, period 4, in its local phase from the
  first step), ``diloco-hH`` (DiLoCo as published, the CLI's plain-torch one, every H steps)
  and ``diloco-ours-hH`` (``acc.DiLoCo`` with the default compressor, every H steps), H in
  16, 64, 256; ``diloco-ours-overlap-hH`` the same with ``overlap=True`` (each round lands at
  the next; the one in flight at the end lands after the timed steps).

Rank 0 writes a JSON file: per-step wall times (and, for ours, the compressor's seconds in
compression and in waiting on its collectives, in all and during backward, each
collective's issue and completion times, and the link fitted to them:
``AccordionCompressor.measure_link``; how many layers were at each level after every step,
and NetworkAware's last decision), every rank's per-step times and CPU use (its main
thread's and its other threads', by thread name, over the same steps), and the median of
steps 4..12.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from accordion_hvd.cli import models  # noqa: E402

HVD = ("hvd-idle", "hvd-fp32", "hvd-fp16", "ours-r1", "ours-r4", "ours-accordion", "ours-network-aware",
       "ours-network-aware-fp16", "ours-topk1", "ours-topk10", "plain-topk1")
DDP = ("ddp-idle", "ddp-fp32", "ddp-fp16", "ddp-r1", "ddp-r4", "ddp-pg-r1", "ddp-pg-r4", "ddp-ours-r1", "ddp-ours-r4",
       "ddp-ours-accordion")
PERIODIC = ("localsgd-p4", *(f"diloco{ours}-h{h}" for ours in ("", "-ours", "-ours-overlap") for h in (16, 64, 256)))
HVD += ("ours-default",)
DDP += PERIODIC  # under torchrun
METHODS = ("floor", *HVD, *DDP)
FIRST, LAST = 3, 12  # the median is over steps FIRST+1..LAST (the first steps warm up), or to --steps - 2


LM_VOCABULARY, LM_SEQ_LEN = 7783, 35  # the text task's vocabulary (benchmarks/results/lm-smoke) and sequences


HELD_OUT_VOCABULARY = 7998  # the held-out corpus's (len(cli.data.load_torch_source().vocabulary), torch 2.13.0)


class FlatLanguageModel(torch.nn.Module):
    """A language model with its logits flattened to (tokens, vocabulary), so that the loop's
    ``cross_entropy(net(x), y)`` is the language-modelling loss."""

    def __init__(self, lm: torch.nn.Module, vocabulary: int) -> None:
        super().__init__()
        self.lm, self.vocabulary = lm, vocabulary

    def forward(self, tokens):
        return self.lm(tokens).reshape(-1, self.vocabulary)


def build_model(name: str):
    torch.manual_seed(0)
    if name == "resnet18":
        return models.ResNet18(num_classes=10, channels=3), (3, 32, 32)
    if name == "cnn-wide":
        return models.WideCNN(channels=1), (1, 8, 8)
    if name == "lstm":
        return FlatLanguageModel(models.LSTMLanguageModel(LM_VOCABULARY), LM_VOCABULARY), None
    if name == "transformer":
        return FlatLanguageModel(models.TransformerLanguageModel(LM_VOCABULARY, context=LM_SEQ_LEN), LM_VOCABULARY), None
    if name == "gru":
        return FlatLanguageModel(models.GRULanguageModel(HELD_OUT_VOCABULARY), HELD_OUT_VOCABULARY), None
    raise ValueError(f"--model must be resnet18, cnn-wide, lstm, transformer or gru, got {name!r}")


def batches(shape, batch_size: int, count: int = 4, vocabulary: int = LM_VOCABULARY):
    """Synthetic batches: images of ``shape`` and 10 classes, or (shape None) token
    sequences and their next tokens, flattened."""
    gen = torch.Generator().manual_seed(1)
    if shape is None:
        tokens = [torch.randint(0, vocabulary, (batch_size, LM_SEQ_LEN + 1), generator=gen) for _ in range(count)]
        return [(t[:, :-1], t[:, 1:].reshape(-1)) for t in tokens]
    return [(torch.randn(batch_size, *shape, generator=gen), torch.randint(0, 10, (batch_size,), generator=gen))
            for _ in range(count)]


def worker_device(kind: str) -> torch.device:
    """This worker's device: the CPU, or (``cuda``) GPU local rank mod the GPU count (several
    workers share a GPU when there are fewer GPUs than workers)."""
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("step_worker: --device cuda: no CUDA GPU on this machine")
    local = int(os.environ.get("HOROVOD_LOCAL_RANK") or os.environ.get("LOCAL_RANK") or
                os.environ.get("ACCORDION_WORKER_INDEX") or 0)
    device = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


class PlainTopK:
    """TopK with error feedback the obvious way: per layer, torch ops and one allgather pair."""

    def __init__(self, model, ratio: float) -> None:
        import horovod.torch as hvd
        self.hvd, self.ratio = hvd, ratio
        self.params = [(n, p) for n, p in model.named_parameters()]
        self.residual = {n: torch.zeros_like(p) for n, p in self.params if p.dim() > 1}

    def exchange(self) -> None:
        hvd, handles = self.hvd, []
        for name, p in self.params:
            if name not in self.residual:
                handles.append((p, "dense", hvd.allreduce_async(p.grad, op=hvd.Average, name=f"d.{name}")))
                continue
            g = (p.grad + self.residual[name]).view(-1)
            k = max(1, int(self.ratio * g.numel()))
            idx = g.abs().topk(k, sorted=False).indices
            values = g[idx]
            g[idx] = 0
            self.residual[name] = g.view_as(p)
            handles.append((p, "sparse", (hvd.allgather_async(values, name=f"v.{name}"),
                                          hvd.allgather_async(idx, name=f"i.{name}"))))
        for p, kind, h in handles:
            if kind == "dense":
                p.grad.copy_(hvd.synchronize(h))
                continue
            values, idx = hvd.synchronize(h[0]), hvd.synchronize(h[1])
            dense = torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            dense.index_add_(0, idx, values)
            p.grad.copy_(dense.view_as(p) / hvd.size())


def our_compressor(kind: str):
    """AccordionCompressor as ``ours-KIND`` and ``ddp-ours-KIND`` configure it."""
    import accordion_hvd as acc
    return {
        "r1": lambda: acc.AccordionCompressor(acc.PowerSGD(rank=1), policy="static"),
        "r4": lambda: acc.AccordionCompressor(acc.PowerSGD(rank=4), policy="static"),
        "accordion": lambda: acc.AccordionCompressor(acc.PowerSGD(rank=1, critical_rank=4), interval=4),
        "network-aware": lambda: acc.AccordionCompressor(acc.PowerSGD(rank=1, critical_rank=4), interval=4,
                                                         policy="network-aware"),
        "network-aware-fp16": lambda: acc.AccordionCompressor(acc.PowerSGD(rank=1, critical_rank=4), interval=4,
                                                              policy=acc.policies.NetworkAware(dense="fp16")),
        "topk1": lambda: acc.AccordionCompressor(acc.TopK(0.01), policy="static"),
        "topk10": lambda: acc.AccordionCompressor(acc.TopK(0.1), policy="static"),
        "default": lambda: acc.AccordionCompressor(),
    }[kind]()


def keep_bucket(state, bucket):  # unannotated: DDP checks a hook's annotation, and this module's are strings
    """A DDP comm hook that communicates nothing: each rank keeps its own gradients."""
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def periodic(method: str, model, opt):
    """(the optimizer to step, what runs after it, rank, size) of a PERIODIC method."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if method == "localsgd-p4":
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer
        from torch.nn.parallel import DistributedDataParallel
        ddp = DistributedDataParallel(model)
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        state = PostLocalSGDState(process_group=None, subgroup=dist.new_subgroups(group_size=per_node)[0],
                                  start_localSGD_iter=0)
        ddp.register_comm_hook(state, post_localSGD_hook)
        opt = PostLocalSGDOptimizer(optim=opt, averager=PeriodicModelAverager(period=4, warmup_steps=0))
        return ddp, opt, None, dist.get_rank(), dist.get_world_size()
    h = int(method.rsplit("-h", 1)[1])
    if method.startswith("diloco-ours-"):
        import accordion_hvd as acc
        diloco = acc.DiLoCo(model, opt, sync_every=h, overlap="-overlap-" in method)
    else:
        from accordion_hvd.cli.baselines import Uncompressed
        from accordion_hvd.cli.periodic import PlainDiLoCo
        diloco = PlainDiLoCo(model, dist, Uncompressed("none"), h, 0.7, 0.9)
    return model, opt, diloco.step, dist.get_rank(), dist.get_world_size()


def setup(method: str, model, lr: float, optimizer: str = "sgd"):
    """The optimizer (and what the loop calls after backward; for a periodic method, after
    the optimizer's step) for METHOD; rank and size."""
    opt = (torch.optim.AdamW(model.parameters(), lr=lr) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    if method == "floor":
        return model, opt, None, 0, 1, None
    if method in PERIODIC:
        return (*periodic(method, model, opt), None)
    if method in DDP:
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as powersgd
        from torch.nn.parallel import DistributedDataParallel
        from ddp_train import gloo_options, group_per_bucket  # 8 Gloo threads: the hook blocks inside callbacks
        cuda = next(model.parameters()).is_cuda
        # NCCL needs a GPU per rank; with fewer GPUs than ranks DDP runs on Gloo (CUDA tensors)
        nccl = cuda and torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", "1"))
        dist.init_process_group("nccl" if nccl else "gloo", **({} if nccl else {"pg_options": gloo_options()}))
        ddp = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if cuda else None)  # default buckets
        if method == "ddp-idle":
            ddp.register_comm_hook(None, keep_bucket)
        elif method == "ddp-fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif method in ("ddp-r1", "ddp-r4", "ddp-pg-r1", "ddp-pg-r4"):
            state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=int(method[-1]),
                                           start_powerSGD_iter=2, min_compression_rate=2,
                                           use_error_feedback=True, warm_start=True, random_seed=0)
            hook = powersgd.powerSGD_hook
            ddp.register_comm_hook(state, group_per_bucket(hook, model) if "-pg-" in method else hook)
        elif method.startswith("ddp-ours-"):
            import accordion_hvd as acc
            compression = our_compressor(method[len("ddp-ours-"):])
            acc.register_ddp_hook(ddp, compression, optimizer=opt)
            return ddp, opt, None, dist.get_rank(), dist.get_world_size(), compression
        return ddp, opt, None, dist.get_rank(), dist.get_world_size(), None
    import horovod.torch as hvd
    if method.startswith("ours-"):  # our jobs run at our cycle; Horovod's own methods at its default
        from accordion_hvd import quiet_horovod_cycle
        quiet_horovod_cycle()
    hvd.init()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if method == "hvd-idle":
        return model, opt, None, hvd.rank(), hvd.size(), None
    if method == "plain-topk1":
        return model, opt, PlainTopK(model, 0.01).exchange, hvd.rank(), hvd.size(), None
    ours = method.startswith("ours-")
    compression = (our_compressor(method[len("ours-"):]) if ours
                   else {"hvd-fp32": hvd.Compression.none, "hvd-fp16": hvd.Compression.fp16}[method])
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    return model, opt, None, hvd.rank(), hvd.size(), compression if ours else None


def thread_cpu() -> dict[str, list]:
    """CPU seconds each thread of this process has used so far: {tid: [name, seconds]} (Linux)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after the name: state is field 3, utime 14, stime 15
        out[tid] = [stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / tick]
    return out


def cpu_use(first: tuple, last: tuple, steps: int) -> dict:
    """Per step between two ``(process_time, thread_time, thread_cpu(), perf_counter)``
    samples: the wall time, the main thread's CPU, every other thread's (what a background
    thread costs where the workers share cores), and the other threads by name (clock-tick
    resolution; threads that never named themselves go by their process's name)."""
    by_name: dict[str, float] = {}
    for tid, (name, seconds) in last[2].items():
        if int(tid) != os.getpid():
            by_name[name] = by_name.get(name, 0.0) + (seconds - first[2].get(tid, [name, 0.0])[1]) / steps
    return {"wall": (last[3] - first[3]) / steps, "main": (last[1] - first[1]) / steps,
            "others": (last[0] - first[0] - last[1] + first[1]) / steps,
            "others_by_name": {k: round(v, 4) for k, v in sorted(by_name.items()) if v > 0}}


def gather(method: str, mine: dict) -> list[dict] | None:
    """Every rank's ``mine``, on rank 0 (None for the floor, whose copies do not talk)."""
    if method == "floor":
        return None
    if method in DDP:
        import torch.distributed as dist
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return everyone
    import horovod.torch as hvd
    return hvd.allgather_object(mine, name="step_worker.ranks")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", choices=METHODS, required=True)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--steps", type=int, default=LAST + 2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                   help="the task's (evidence-v3: adamw for the transformer and the GRU)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: model and batches on GPU local rank mod the GPU count; every phase boundary "
                        "synchronizes the GPU, so the times are the device's")
    args = p.parse_args()
    torch.set_num_threads(1)
    device = worker_device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model, shape = build_model(args.model)
    net, opt, after_backward, rank, size, compression = setup(args.method, model.to(device), args.lr, args.optimizer)
    after_step = after_backward if args.method in PERIODIC else None  # a periodic method's round, when due
    after_backward = None if args.method in PERIODIC else after_backward
    vocabulary = model.vocabulary if isinstance(model, FlatLanguageModel) else LM_VOCABULARY
    data = [(x.to(device), y.to(device)) for x, y in batches(shape, args.batch_size, vocabulary=vocabulary)]
    walls, phases, ours_s, starts, levels, decisions, cpu_marks = [], [], [], [], [], [], []
    before = dict(compression.seconds) if compression is not None else None
    start = time.perf_counter()
    window_end = max(LAST, args.steps - 2)
    for step in range(args.steps):
        x, y = data[step % len(data)]
        sync()
        if step in (FIRST, window_end):  # what each thread of this process used in the median's window
            cpu_marks.append((time.process_time(), time.thread_time(), thread_cpu(), time.perf_counter()))
        t0 = time.perf_counter()
        starts.append(t0)
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        in_backward = compression.seconds["comm"] - before["comm"] if compression is not None else 0.0
        if after_backward is not None:
            after_backward()
        opt.step()
        if after_step is not None:
            after_step()
        sync()
        t3 = time.perf_counter()
        walls.append(t3 - t0)
        phases.append({"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2})
        if compression is not None:
            now = dict(compression.seconds)
            ours_s.append({**{k: now[k] - before[k] for k in now}, "comm_backward": in_backward})
            before = now
            counts: dict[str, int] = {}  # how many layers at each level for the next step
            for level in compression.controller.levels.values():
                counts[str(level)] = counts.get(str(level), 0) + 1
            levels.append(counts)
            decision = getattr(compression.policy, "last", None)  # NetworkAware's: its check against the clock
            if decision and (not decisions or decisions[-1][1] is not decision):
                decisions.append((step, decision))
    total = time.perf_counter() - start
    flush = getattr(getattr(after_step, "__self__", None), "flush", None)
    if flush is not None:  # DiLoCo: the round in flight (overlap) lands, none left at exit
        flush()
    if not torch.isfinite(loss.detach()):
        raise RuntimeError(f"{args.method}: loss is not finite")
    timed, link = [], None
    if compression is not None:  # the collectives' times (for the cost model), and the link fitted to them
        timed = [[t.lane, t.seq, t.name, t.kind, t.nbytes, t.issued, t.done]
                 for t in getattr(compression.channel, "timings", list)()]
        link = compression.measure_link()  # every rank: a control-plane collective
    cpu = cpu_use(*cpu_marks, window_end - FIRST) if len(cpu_marks) == 2 else None
    ranks = gather(args.method, {"walls": walls, "phases": phases, "ours": ours_s, "cpu": cpu})
    if rank == 0:
        window = walls[FIRST:window_end]  # the last steps wind down
        result = {"method": args.method, "model": args.model, "size": size, "batch_size": args.batch_size,
                  "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  "step_s": statistics.median(window), "walls": walls, "phases": phases, "ours": ours_s,
                  "total_s": total, "loss": loss.item(), "ranks": ranks, "cpu": cpu}
        if args.method in PERIODIC:  # whole periods after the first: a sync in each
            period = 4 if args.method == "localsgd-p4" else int(args.method.rsplit("-h", 1)[1])
            whole = (len(walls) - period) // period * period
            if whole < period:
                raise SystemExit(f"{args.method}: --steps {args.steps} holds no whole period after the first "
                                 f"({period} steps): give at least {2 * period}")
            result["period_step_s"] = sum(walls[period:period + whole]) / whole
        if compression is not None:
            result["floats_sent"] = compression.stats()["floats_sent"]
            result["step_starts"], result["collectives"] = starts, timed
            result["link"] = compression.stats()["link"] if link.link is not None else {"none": link.reason}
            result["levels"] = levels
            result["policy_last"] = getattr(compression.policy, "last", None)  # NetworkAware's last decision
            result["decisions"] = [{"after_step": k + 1, **d} for k, d in decisions]  # and each window's
        args.out.write_text(json.dumps(result))
    if args.method in DDP:
        # Every rank is past its last collective: leave without tearing the group down. On
        # this emulated cluster `destroy_process_group` hung now and then after the timed
        # steps (5 of 21 DDP runs in results/archive/step-time-ddp-hook-bucket.md, every hook alike).
        import torch.distributed as dist
        dist.barrier()
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
