"""Data-parallel training: ``python -m accordion_hvd.train``, under horovodrun or torchrun.

    horovodrun -np 2 -H localhost:2 python -m accordion_hvd.train --codec powersgd --rank 1 --critical-rank 4
    torchrun --nproc_per_node 2 -m accordion_hvd.train --launcher ddp --codec powersgd --rank 1 --critical-rank 4

Every rank trains on its shard of the data with Horovod's DistributedOptimizer (or, with
``--launcher ddp``, PyTorch's DistributedDataParallel with our comm hook) and the chosen
gradient compression. Rank 0 shows a progress bar, logs each epoch's test accuracy
(over all ranks' shards of the test set), and with ``--logdir`` writes per-step metrics as
CSV and TensorBoard events and, at the end, PNG plots (accuracy vs floats sent and vs time,
and the per-layer regime timeline). ``--checkpoint`` saves every epoch (one file per rank:
error feedback is per rank), ``--resume`` continues such a run exactly.

``--device auto`` (the default) trains on the GPU when torch sees one, each rank on the GPU
of its local rank (modulo the GPUs there are), as Horovod's examples do; the compressor's
state lives with the gradients, on that GPU.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass

import torch

from ..batch_size import AccordionBatchSize
from ..comm.channel import CollectiveTimeout
from ..horovod.patches import install_polite_wait
from . import data, options
from .checkpoints import load_checkpoint, read_checkpoint, save_checkpoint
from .launchers import make_front_end
from .options import OURS, make_compression
from .task import Task, device_type, evaluate, load_data, loss_of, make_model, make_optimizer, pick_device
from .metrics import progress

log = logging.getLogger("accordion_hvd.train")

__all__ = ["main", "make_compression", "parse_args", "progress_total", "read_checkpoint"]


def parse_args(argv=None) -> argparse.Namespace:
    return options.parse_args(argv, description=__doc__)


@dataclass
class Run:
    """What one training run holds, on every rank."""
    args: argparse.Namespace
    front: object                # HorovodFrontEnd or DDPFrontEnd (frontends.py)
    device: torch.device
    task: Task
    model: torch.nn.Module       # the model itself: state, evaluation
    net: torch.nn.Module         # what training runs forward on (the DDP wrapper, under DDP)
    opt: torch.optim.Optimizer
    compression: object          # AccordionCompressor or Uncompressed: the same face
    batch: AccordionBatchSize | None
    base_lr: float
    epoch: int = 0               # epochs done
    step: int = 0                # optimizer steps done
    metrics: object = None       # MetricsLogger on rank 0 with --logdir
    started: float = 0.0
    seconds_before: dict | None = None
    bar_counts_steps: bool = False  # the progress bar counts optimizer steps, else micro-batches
    best: float | None = None    # the best validation score so far
    last_score: float = math.nan  # the last one
    scored: tuple[int, int] = (0, 0)  # (the compressor's steps, skipped steps) at the last evaluation
    stop: str | None = None      # why the run stops early (diverged, --time-cap), once it must
    syncs: int = 0               # a periodic front end's rounds by the last epoch's end


def run_cli(argv=None) -> None:
    """``python -m accordion_hvd.train``: ``main``, and when the world broke (a collective
    failed or timed out: a link went down, a worker froze or died), the error with the rank
    it blames on stderr and exit status 1 at once. A normal exit would first wait for
    Horovod's background thread, which may be blocked in the transport: for Gloo's own
    timeout (30 s), and under MPI, which has none, until the link comes back."""
    try:
        main(argv)
    except Exception as exc:  # noqa: BLE001 - anything else ends the ordinary way
        if not isinstance(exc, CollectiveTimeout) and type(exc).__name__ != "HorovodInternalError":
            raise
        traceback.print_exc()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def main(argv=None) -> float:
    args = parse_args(argv)
    front = make_front_end(args, device_type(args.device), ours=args.codec in (*OURS, "default"))
    rank0 = front.rank == 0
    logging.basicConfig(level=logging.INFO if rank0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    if args.launcher == "horovod":
        install_polite_wait()  # every method alike, the uncompressed baselines included
    run = set_up(args, front)
    micro_per_epoch = (len(run.task.train.y) // front.size) // args.batch_size
    if micro_per_epoch == 0:  # the same on every rank: the data and the world size are
        raise SystemExit(f"--batch-size {args.batch_size}: {len(run.task.train.y)} training samples over "
                         f"{front.size} ranks make no full batch (lower --batch-size, or raise --max-train-samples)")
    # The bar's total is what the run will do, --max-steps included, or its ETA is wrong
    # (a 30-step smoke run showed hours to go). In batch mode a step takes 1 to
    # --large-passes micro-batches, decided as it runs: with --max-steps the bar counts
    # steps then (exact when --max-steps stops the run), without it micro-batches (exact).
    run.bar_counts_steps = run.batch is not None and args.max_steps > 0
    total = progress_total(micro_per_epoch, args.epochs, run.epoch, run.step, args.max_steps)
    bar = progress(total, enabled=rank0 and not args.no_progress,
                   desc="training (micro-batches)" if run.batch and not run.bar_counts_steps else "training")
    run.metrics = _metrics_logger(args, run.model) if rank0 and args.logdir else None
    run.started, run.seconds_before = time.perf_counter(), dict(run.compression.seconds)
    acc = float("nan")
    epoch = run.epoch
    while epoch < args.epochs or go_on(run):
        loss = train_epoch(run, epoch, micro_per_epoch, bar)
        acc = end_epoch(run, epoch, loss, bar)
        epoch += 1
        if args.max_steps and run.step >= args.max_steps:
            log.info("stopped after %d optimizer steps (--max-steps)", run.step)
            break
        if run.stop is not None:
            log.info("stopped at epoch %d, step %d: %s", epoch, run.step, run.stop)
            break
    bar.close()
    if run.task.valid is not None:  # the epochs were scored on the validation split: now the test split
        with front.evaluating():
            acc = evaluate(front, run.model, run.task.test, run.task.metric)
    finish(run, acc)
    front.close()
    return acc


def reached(run: "Run", score: float) -> bool:
    """Whether ``score`` meets --target (perplexity: at most it; accuracy: at least it)."""
    target = run.args.target
    return target is not None and (score <= target if run.task.metric == "perplexity" else score >= target)


def go_on(run: "Run") -> bool:
    """After --epochs: whether to train another epoch at the final learning rate (--target not
    reached yet, the run neither stopped nor out of --time-cap)."""
    if run.args.target is None or run.stop is not None or run.best is None or reached(run, run.best):
        return False
    log.info("--target %g not reached after %d epochs (best %.4f): one more epoch at the final learning rate",
             run.args.target, run.epoch, run.best)
    return True


def progress_total(steps_per_epoch: int, epochs: int, start_epoch: int, start_step: int, max_steps: int) -> int:
    """The optimizer steps a run takes when each is one micro-batch: the epochs left after
    ``start_epoch``, cut at ``max_steps`` (0: no cut), which counts a resumed run's
    ``start_step`` earlier steps too. The loop checks --max-steps after a step, so a run
    resumed at or past it still takes one (if it has an epoch left)."""
    steps = steps_per_epoch * max(epochs - start_epoch, 0)
    if max_steps and steps:
        steps = min(steps, max(max_steps - start_step, 1))
    return steps


def set_up(args, front) -> Run:
    """Data, model, the front end's wrapping with the compression, batch-size mode, resume."""
    device = pick_device(args.device, front.local_rank)
    torch.manual_seed(args.seed)
    task = load_data(args)
    task = Task(*(None if s is None else data.Split(s.x.to(device), s.y.to(device)) for s in task[:3]), *task[3:])
    model = make_model(args, task).to(device)  # initialized on the CPU: the same weights on any device
    base_lr = args.lr * front.size
    opt = make_optimizer(args.optimizer, model, base_lr)
    compression = make_compression(args)
    net, opt = front.wrap(model, opt, compression, device)
    batch = (AccordionBatchSize(opt, small=1, large=args.large_passes, eta=args.eta,
                                interval=None if args.interval == 0 else args.interval)
             if args.batch_mode else None)
    run = Run(args, front, device, task, model, net, opt, compression, batch, base_lr)
    if args.resume is not None:
        run.epoch, run.step = load_checkpoint(args.resume, front, model, opt, compression, batch, device)
        run.syncs = front.record().get("syncs", 0)
        log.info("resumed from %s at epoch %d, step %d", args.resume, run.epoch, run.step)
    log.info("training %s (%s parameters) on %s, %s on %s (%s), compression %s, %d train / %d test samples",
             args.model, f"{sum(p.numel() for p in model.parameters()):,}", args.dataset, _count(front.size, "rank"),
             device.type, front.label, compression, len(task.train.y), len(task.test.y))
    if front.size == 1 and args.codec != "none" and front.name == "horovod":
        log.warning("1 rank: Horovod's DistributedOptimizer exchanges nothing and never calls the "
                    "compressor, so --codec %s has no effect (launch 2 or more ranks)", args.codec)
    return run


def train_epoch(run: Run, epoch: int, micro_per_epoch: int, bar) -> torch.Tensor:
    """One epoch of this rank's shard; returns the last micro-batch's loss."""
    args, opt, batch = run.args, run.opt, run.batch
    lr = run.base_lr * args.lr_gamma ** sum(epoch >= m for m in args.lr_milestones)
    for group in opt.param_groups:  # with --batch-mode, times its current scale
        group["lr"] = lr * (batch.lr_scale if batch else 1.0)
    micro = 0
    # Where the evaluations inside the epoch fall (--evals-per-epoch): evenly spaced micro-batches.
    checkpoints = {round(micro_per_epoch * k / args.evals_per_epoch) for k in range(1, args.evals_per_epoch)}
    opt.zero_grad()
    for x, y in data.shard_batches(run.task.train, args.batch_size, run.front.rank, run.front.size, epoch, args.seed):
        loss = loss_of(run.net(x), y)
        if (run.step + 1, run.front.rank) in args.inject_nonfinite:
            loss = loss * float("nan")
        (loss if batch is None else loss / batch.passes).backward()  # batch mode: the mean over micro-batches
        micro += 1
        if not run.bar_counts_steps:
            bar.update()
        last = micro == micro_per_epoch  # every rank has the same count: a short last step is safe
        if batch is None or batch.micro_batch_done() or last:
            optimizer_step(run, epoch, loss)
            if run.bar_counts_steps:
                bar.update()
            if args.max_steps and run.step >= args.max_steps:
                break
            if not last and micro in checkpoints:  # an evaluation inside the epoch (--evals-per-epoch)
                score_now(run, epoch)
                if run.stop is not None:
                    break
    return loss


def score_now(run: Run, epoch: int) -> float:
    """Score the validation split (else the test split) now, record it, and decide whether
    the run must stop: diverged (a non-finite score or non-finite parameters; not a skipped
    step's non-finite loss) or --time-cap passed. Every rank reaches the same decision: the
    score is reduced over ranks, the parameters are the same on every rank, and the clock
    is rank 0's."""
    metric, split = run.task.metric, run.task.valid if run.task.valid is not None else run.task.test
    with run.front.evaluating():  # periodic synchronisation: one model, the same on every rank
        score = evaluate(run.front, run.model, split, metric)
        finite_model = all(bool(torch.isfinite(p).all()) for p in run.model.parameters())
    wall = time.perf_counter() - run.started
    elapsed = float(run.front.sum(torch.tensor([wall if run.front.rank == 0 else 0.0], dtype=torch.float64),
                                  name="eval.clock")[0])
    # Our compressor skips a step with a non-finite gradient (the same verdict on every rank),
    # so a diverged run keeps finite parameters: it shows as every step skipped. Its steps are
    # the compressor's own (DiLoCo's: its rounds, fewer than the optimizer's steps).
    stats = run.compression.stats()
    steps, skipped = stats.get("steps", run.step), stats.get("skipped_steps", 0)
    all_skipped = steps > run.scored[0] and skipped - run.scored[1] >= steps - run.scored[0]
    run.scored = (steps, skipped)
    if run.metrics is not None:
        recorded = score if math.isfinite(score) or metric != "perplexity" else math.inf  # NaN: diverged, as inf
        run.metrics.log_eval(run.step, epoch=epoch, wall_s=wall, floats_sent=run.compression.stats()["floats_sent"],
                             **{metric: recorded})
    run.last_score = score
    if math.isfinite(score):
        better = run.best is None or (score < run.best if metric == "perplexity" else score > run.best)
        run.best = score if better else run.best
    if not math.isfinite(score) or not finite_model or all_skipped:
        run.stop = (f"diverged (validation {metric} {score}, parameters {'' if finite_model else 'not '}finite"
                    f"{', every step since the last evaluation skipped: non-finite gradients' if all_skipped else ''})")
    elif run.args.time_cap is not None and elapsed > run.args.time_cap:
        run.stop = f"--time-cap {run.args.time_cap:g} s passed ({elapsed:.0f} s)"
    return score


def optimizer_step(run: Run, epoch: int, loss: torch.Tensor) -> None:
    """Average the gradients, step (unless a gradient was not finite: then skip exactly),
    let batch-size mode see the step, record it."""
    opt, batch = run.opt, run.batch
    run.front.step(opt, run.compression)
    used = {"lr": opt.param_groups[0]["lr"], **({"passes": batch.passes} if batch else {})}
    if batch is not None:
        batch.step()  # reads the step's averaged gradient: before zero_grad
    opt.zero_grad()
    run.step += 1
    if run.metrics is not None:
        run.seconds_before = _log_step(run, epoch, loss, **used)


def end_epoch(run: Run, epoch: int, loss: torch.Tensor, bar) -> float:
    """Detection point, the epoch's evaluation (validation split, else test), eval row,
    checkpoint; returns the score."""
    run.epoch = epoch + 1
    # A detection point only with --interval 0 (windows are epochs): with a window of N steps
    # the controller ignores epoch_end() and warns, on every rank, as it must for a user who
    # calls it by mistake; the CLI chose the windows itself, so it has nothing to say.
    if run.args.interval == 0:
        run.front.settle()  # (DiLoCo --overlap: the compressor's step in flight, the round, lands first)
        run.compression.epoch_end()
        if run.batch is not None:
            run.batch.epoch_end()
    metric = run.task.metric
    # A run stopped inside the epoch (--time-cap, diverged) was scored just then, at this step.
    score = run.last_score if run.stop is not None else score_now(run, epoch + 1)
    bar.set_postfix(loss=f"{loss.item():.3f}", **{{"perplexity": "ppl"}.get(metric, metric[:3]): f"{score:.4f}"})
    log.info("epoch %d/%d  loss %.4f  %s %s %.4f", epoch + 1, run.args.epochs, loss.item(),
             "test" if run.task.valid is None else "validation", metric, score)
    periodic = run.front.record()  # --sync diloco / torch-localsgd: the rounds this epoch
    if "syncs" in periodic:
        log.info("epoch %d/%d  %d rounds (%d in all)%s", epoch + 1, run.args.epochs, periodic["syncs"] - run.syncs,
                 periodic["syncs"], f", now every {periodic['sync_interval']} inner steps"
                 if "sync_interval" in periodic else "")
        run.syncs = periodic["syncs"]
    if run.args.checkpoint is not None:
        path = run.args.checkpoint
        kept = [path.with_name(f"{path.name}.epoch{epoch + 1}")] if run.args.keep_checkpoints else []
        for target in (path, *kept):
            save_checkpoint(target, run.front, epoch + 1, run.step, run.model, run.opt, run.compression, run.batch)
    return score


def finish(run: Run, acc: float) -> None:
    """The final lines on rank 0, and the plots."""
    if run.front.rank == 0:
        print(f"final test {run.task.metric}: {acc:.4f} ({_count(run.front.size, 'rank')}, {_count(run.epoch, 'epoch')}, {_count(run.step, 'step')}, "
              f"{time.perf_counter() - run.started:.1f} s)", flush=True)
        stats = run.compression.stats()
        if not stats["floats_sent"]:
            print("sent by rank 0: nothing (nothing was exchanged)", flush=True)
        else:  # bytes first: a 16-bit step sends every float at half the bytes
            print(f"sent by rank 0: {stats['bytes_sent'] / 1e6:,.2f} MB of {stats['bytes_dense'] / 1e6:,.2f} MB dense "
                  f"({stats['bytes_dense'] / max(stats['bytes_sent'], 1):.1f}x less on the wire); floats "
                  f"{stats['floats_sent']:,} of {stats['floats_dense']:,}", flush=True)
    if run.metrics is not None:
        run.metrics.close()
        from .plots import plot_run
        plot_run(run.args.logdir)  # logs "wrote PATH" for each figure itself


def _metrics_logger(args, model):
    from .metrics import MetricsLogger
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if (args.logdir / "steps.csv").exists():
        log.warning("--logdir %s: replacing the run recorded there", args.logdir)
    return MetricsLogger(args.logdir, layers=names, overwrite=True)


def _log_step(run: Run, epoch: int, loss: torch.Tensor, *, lr: float, **extra) -> dict:
    """One steps.csv row: cumulative floats and bytes on the wire, this step's seconds in
    compression and in communication (waiting on our collectives), every layer's level (for
    the next step), the learning rate (and, in batch mode, the micro-batches) this step used."""
    stats, now, before = run.compression.stats(), dict(run.compression.seconds), run.seconds_before
    run.metrics.log_step(run.step, epoch=epoch + 1, loss=loss.item(), lr=lr, floats_sent=stats["floats_sent"],
                         floats_dense=stats["floats_dense"],
                         levels={n: layer["level"] for n, layer in stats["layers"].items()},
                         compress_s=now["compress"] - before.get("compress", 0.0),
                         comm_s=now["comm"] - before.get("comm", 0.0), wall_s=time.perf_counter() - run.started,
                         bytes_sent=stats["bytes_sent"], **extra, **run.front.record())
    return now


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


if __name__ == "__main__":
    run_cli()
