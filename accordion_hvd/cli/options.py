"""The training CLI's options: the parser, its checks, and the compression the options
describe (``make_compression``). cli/train.py runs the job they describe."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..codecs import PowerSGD, Quantize, TopK
from ..periodic.diloco import ROUND_WINDOW
from ..horovod.compressor import AccordionCompressor
from ..periodic import SyncInterval
from ..policies import Accordion, GraVAC, LinkGate, NetworkAware
from ..periodic.interval import LADDER
from .baselines import Uncompressed
from .frontends import LAUNCHERS
from .periodic import SYNCS
from .published import add_published_flags, check_published

CODECS = ("default", "none", "fp16", "bf16", "powersgd", "topk", "quantize")
OURS = ("powersgd", "topk", "quantize")  # codecs of ours chosen by flags (not "default")
POLICIES = ("accordion", "static", "gravac", "network-aware", "link-gate")
DATASETS = ("digits", "synthetic", "cifar10", "text", "torch-source")
MODELS = ("cnn", "cnn-wide", "resnet18", "lstm", "transformer", "gru")
LANGUAGE_MODELS = ("lstm", "transformer", "gru")
TEXTS = ("text", "torch-source")
OPTIMIZERS = ("sgd", "adamw")
DEVICES = ("auto", "cpu", "cuda")



def make_codec(args):
    """Our codec for --codec powersgd/topk (raises on bad levels), else None."""
    if args.codec == "powersgd":
        return PowerSGD(args.rank, args.critical_rank)
    if args.codec == "topk":
        return TopK(args.ratio, args.critical_ratio)
    if args.codec == "quantize":
        return Quantize(args.bits, args.critical_bits, skip_energy=args.skip_energy)
    return None


def make_compression(args):
    """Ours for --codec default/powersgd/topk, else Horovod's own in the same face (baselines.py)."""
    interval = None if args.interval == 0 else args.interval
    if args.codec == "default":  # what acc.AccordionCompressor() does, with the run's detection window
        return AccordionCompressor(eta=args.eta, interval=interval)
    codec = make_codec(args)
    if codec is None:
        return Uncompressed(args.codec)
    policy = low_rate_policy(args, args.policy)
    if policy == "gravac":
        policy = GraVAC(args.min_factor, args.max_factor, window=args.gravac_window, epsilon=args.epsilon)
    elif policy == "network-aware":
        policy = NetworkAware(args.eta, dense=args.dense)
    return AccordionCompressor(codec, policy=policy, eta=args.eta, interval=interval)


def low_rate_policy(args, name):
    """``name`` as AccordionCompressor takes it, or with --low-rate an instance holding it."""
    if args.low_rate is None:
        return name
    accordion = Accordion(args.eta, low_rate=args.low_rate or None)
    return LinkGate(accordion) if name == "link-gate" else accordion


def _ladder(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(rung) for rung in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers of steps such as 1,4,16, got {text!r}") from None


def _interval(text: str):
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be auto or a positive number of steps, got {text!r}")
    return value


# The flags of --sync's periodic modes: (default, the --sync values they belong to).
PERIODIC_FLAGS = {"sync_every": (None, "diloco or torch-localsgd or sparseloco or signloco"),
                  "outer_lr": (0.7, "diloco or sparseloco or signloco"),
                  "outer_momentum": (0.9, "diloco"), "overlap": (False, "diloco"), "reset_momentum": (None, "diloco"),
                  "sync_ladder": (None, "diloco"), "sync_budget": (None, "diloco"), "plain_below": (None, "diloco"),
                  "localsgd_warmup": (100, "torch-localsgd"), "topk_density": (0.03125, "sparseloco"),
                  "topk_chunk": (4096, "sparseloco"), "value_bits": (2, "sparseloco"),
                  "ef_decay": (None, "sparseloco or signloco"), "freeze_step": (None, "onebit-adam or ours-onebit-adam"),
                  "variance_every": (None, "onebit-adam"), "warmup_bits": (16, "onebit-adam"),
                  "max_update": (3.0, "ours-onebit-adam")}

def _check_sync(p, args) -> None:
    """--sync and its flags: refused where they do not apply, defaults resolved."""
    given = [n for n, (default, owners) in PERIODIC_FLAGS.items()
             if getattr(args, n) != default and args.sync not in owners.split(" or ")]
    if given:
        whose = PERIODIC_FLAGS[given[0]][1]
        p.error(f"--{given[0].replace('_', '-')} is for --sync {whose}"
                f"{'' if args.sync == 'every-step' else f', not --sync {args.sync}'}")
    if args.sync == "every-step":
        return
    if args.launcher == "horovod" or (args.launcher == "fsdp" and args.sync != "diloco"):
        p.error(f"--sync {args.sync} runs under torchrun: add --launcher ddp"
                + (" (or --launcher fsdp, for --sync diloco)" if args.sync == "diloco" else ""))
    if args.batch_mode:
        p.error(f"--batch-mode and --sync {args.sync} do not go together (one sets the batch, one the interval)")
    if args.sync == "torch-localsgd":
        if args.codec != "none" or args.sync_every == "auto":
            p.error("--sync torch-localsgd is PyTorch's local SGD: --codec none, --sync-every a number of steps")
        args.sync_every = args.sync_every or 4
        if args.localsgd_warmup < 0:
            p.error(f"--localsgd-warmup must be at least 0, got {args.localsgd_warmup}")
        return
    if args.sync in ("sparseloco", "signloco", "onebit-adam", "ours-onebit-adam"):
        check_published(p, args, PERIODIC_FLAGS)
        return
    if args.codec not in (*OURS, "default", "none"):
        p.error(f"--sync diloco takes --codec none (DiLoCo as published) or ours (default, {', '.join(OURS)}), "
                f"got --codec {args.codec}")
    args.sync_every = args.sync_every or "auto"
    if args.launcher == "fsdp" and args.codec == "none":
        p.error("--launcher fsdp --sync diloco runs our DiLoCo across the nodes: --codec default or one of ours "
                f"({', '.join(OURS)}); DiLoCo as published (--codec none) runs under --launcher ddp")
    for flag, name in (("overlap", "overlap=True"), ("plain_below", "plain_below=N")):
        if args.codec == "none" and getattr(args, flag) not in (False, None):
            p.error(f"--{flag.replace('_', '-')} is our DiLoCo's (acc.DiLoCo({name})), with our compression: not with "
                    "--codec none (DiLoCo as published)")
    if args.codec != "none" and args.interval == 0:  # the compressor steps once a round: acc.DiLoCo's windows
        args.interval = ROUND_WINDOW
    if args.plain_below is not None and args.plain_below < 1:
        p.error(f"--plain-below must be a positive number of inner steps, got {args.plain_below}")
    if args.reset_momentum and args.sync_every != "auto":
        p.error(f"--reset-momentum is for --sync-every auto (the interval falls only there), got --sync-every "
                f"{args.sync_every}")
    if args.codec == "none" and args.sync_every == "auto":
        p.error("--sync-every auto is our interval policy, with our compression: with --codec none (DiLoCo as "
                "published) give --sync-every N")
    for flag in ("sync_ladder", "sync_budget"):
        if getattr(args, flag) is not None and args.sync_every != "auto":
            p.error(f"--{flag.replace('_', '-')} is for --sync-every auto (the interval policy), got --sync-every "
                    f"{args.sync_every}")
    if args.sync_ladder is not None or args.sync_budget is not None:
        try:
            args.sync_every = SyncInterval(ladder=args.sync_ladder or LADDER, budget=args.sync_budget)
        except ValueError as exc:
            p.error(f"--sync-{'ladder' if 'ladder' in str(exc) else 'budget'}: {exc}")
    if not args.outer_lr > 0 or not 0 <= args.outer_momentum < 1:
        p.error(f"--outer-lr must be positive and --outer-momentum in [0, 1), got {args.outer_lr} and "
                f"{args.outer_momentum}")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and every option's default after its help, so that
    ``--help`` alone says what a bare run does. As argparse.ArgumentDefaultsHelpFormatter,
    except that a help which states its default itself (one that depends on other options,
    like --policy's) is left alone, and an unset default reads "none" (a flag's: "off")
    rather than Python's None, [] or False."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or "(default" in text:
            return text
        default = action.default
        shown = ("off" if default is False else
                 "none" if default is None or (isinstance(default, (str, list)) and not default) else "%(default)s")
        return f"{text} (default: {shown})"


def diloco_options(args) -> dict:
    """``acc.DiLoCo``'s keyword arguments from the checked flags of ``--sync diloco``."""
    return {"sync_every": args.sync_every, "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum,
            "overlap": args.overlap, "reset_momentum": args.reset_momentum, "plain_below": args.plain_below}


def parse_args(argv=None, description: str | None = None) -> argparse.Namespace:
    # Every option needs a help text: argparse prints no default for one without.
    p = argparse.ArgumentParser(prog="python -m accordion_hvd.train", description=description,
                                formatter_class=_HelpFormatter)
    p.add_argument("--launcher", choices=LAUNCHERS, default="horovod",
                   help="horovod (start with horovodrun), ddp (start with torchrun: DistributedDataParallel with "
                        "our comm hook) or fsdp (start with torchrun: FSDP2 as HSDP, sharded within a node, our "
                        "compressed all-reduce across nodes: acc.compress_hsdp)")
    p.add_argument("--nodes", type=int, default=None,
                   help="--launcher fsdp: the nodes (the mesh's replicate dimension; the ranks per node shard) "
                        "(default: torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE)")
    p.add_argument("--reduce-dtype", choices=("float32", "bfloat16"), default=None,
                   help="--launcher fsdp with our compression: the dtype of FSDP's reduce-scatter inside a node "
                        "(MixedPrecisionPolicy(reduce_dtype=...)); bfloat16 sends half the bytes there, and ours "
                        "writes its results into the float32 gradients (default: float32; --codec bf16 is FSDP's own "
                        "all-reduce in bfloat16)")
    p.add_argument("--sync", choices=SYNCS, default="every-step",
                   help="how often the ranks meet (--launcher ddp, under torchrun): every step, or periodically: "
                        "diloco (acc.DiLoCo with our compression; with --codec none DiLoCo as published, float32; "
                        "ours also under --launcher fsdp: FSDP2 inside each node every step, the rounds across the "
                        "nodes) or torch-localsgd (PyTorch's PostLocalSGDOptimizer, --codec none); ours-onebit-adam "
                        "(acc.OneBitAdam, every step); sparseloco, signloco, onebit-adam (published, in plain torch)")
    p.add_argument("--sync-every", type=_interval, default=None,
                   help="--sync diloco: inner steps per round, or auto (our interval policy, acc.SyncInterval); "
                        "--sync torch-localsgd: PeriodicModelAverager's period (default: auto for diloco, 4 for "
                        "torch-localsgd, as PyTorch's documentation example)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="--sync diloco: the outer optimizer's learning rate")
    p.add_argument("--outer-momentum", type=float, default=0.9,
                   help="--sync diloco: the outer optimizer's Nesterov momentum (0: none; with --outer-lr 1 plain "
                        "model averaging)")
    p.add_argument("--overlap", action="store_true",
                   help="--sync diloco (ours): overlap each round of more than one inner step with the next round's "
                        "inner steps; it lands one round late (acc.DiLoCo(overlap=True), Streaming DiLoCo's overlap)")
    p.add_argument("--reset-momentum", action=argparse.BooleanOptionalAction, default=None,
                   help="--sync diloco --sync-every auto: zero the outer momentum when a critical window lowers the "
                        "interval (acc.DiLoCo(reset_momentum=...); default: on with --sync-every auto)")
    p.add_argument("--plain-below", type=int, default=None,
                   help="--sync diloco (ours): rounds of fewer inner steps than this are plain averages, the outer "
                        "momentum kept for longer ones (acc.DiLoCo(plain_below=N); default 64; 1: every round the "
                        "outer step, as published)")
    p.add_argument("--sync-budget", type=float, default=None,
                   help="--sync diloco --sync-every auto: calm windows go no higher than the first rung whose round "
                        "costs at most this fraction of an inner step (acc.SyncInterval(budget=...); default: none)")
    p.add_argument("--sync-ladder", type=_ladder, default=None,
                   help="--sync diloco --sync-every auto: the intervals it chooses from, comma-separated, each "
                        "dividing the last (default: 1,4,16,64; acc.SyncInterval(ladder=...))")
    add_published_flags(p)
    p.add_argument("--localsgd-warmup", type=int, default=100,
                   help="--sync torch-localsgd: steps averaged every step before local SGD starts")
    p.add_argument("--codec", choices=CODECS, default="default",
                   help="gradient compression: default (the default; acc.AccordionCompressor()'s codec and policy: the codec and "
                        "policy flags are then ignored), none, 16-bit (Horovod's fp16 or DDP's fp16 hook; under --launcher "
                        "fsdp: bf16, FSDP's reduce in bfloat16), or ours")
    p.add_argument("--rank", type=int, default=1, help="PowerSGD rank in normal regimes")
    p.add_argument("--critical-rank", type=int, default=None,
                   help="PowerSGD rank in critical regimes (default: none: --rank in every regime)")
    p.add_argument("--ratio", type=float, default=0.05, help="TopK fraction kept in normal regimes")
    p.add_argument("--critical-ratio", type=float, default=None,
                   help="TopK fraction kept in critical regimes (default: none: --ratio in every regime)")
    p.add_argument("--bits", type=int, default=8, help="Quantize: bits per entry in normal regimes (8 or 16)")
    p.add_argument("--critical-bits", type=int, default=None,
                   help="Quantize: bits in critical regimes (default: none: --bits in every regime)")
    p.add_argument("--skip-energy", type=float, default=0.0,
                   help="Quantize: the share of a step's energy that may wait in error feedback, whole chunks at a "
                        "time (sparse chunks; default 0: every chunk is sent)")
    p.add_argument("--policy", choices=POLICIES, default=None,
                   help="level policy (default: accordion when a critical level is given, else static)")
    p.add_argument("--eta", type=float, default=0.5, help="Accordion threshold on the relative norm change")
    p.add_argument("--low-rate", type=float, default=None,
                   help="Accordion: every layer critical while the learning rate is at or below this fraction of "
                        "its peak; 0: the paper's rule alone, as without the flag")
    p.add_argument("--interval", type=int, default=0,
                   help="detection window in optimizer steps; 0: one window per epoch")
    p.add_argument("--dense", choices=("fp32", "fp16"), default="fp32",
                   help="network-aware: how a layer goes when it goes whole, in the gradient's dtype (fp32) or "
                        "in float16 through Horovod (half the bytes; the rounding error kept in error feedback)")
    p.add_argument("--min-factor", type=float, default=10.0, help="GraVAC: smallest compression factor")
    p.add_argument("--max-factor", type=float, default=1000.0, help="GraVAC: largest compression factor")
    p.add_argument("--gravac-window", type=int, default=100, help="GraVAC: steps between candidate growths")
    p.add_argument("--epsilon", type=float, default=0.7, help="GraVAC: the gain a factor must keep")
    p.add_argument("--batch-mode", action="store_true",
                   help="Accordion drives the batch size: --batch-size per step in critical regimes, "
                        "--large-passes times that (gradient accumulation, lr scaled alike) otherwise")
    p.add_argument("--large-passes", type=int, default=8,
                   help="micro-batches per step in normal regimes with --batch-mode (8 at --batch-size 32: 256 "
                        "samples a step)")
    p.add_argument("--dataset", choices=DATASETS, default="digits",
                   help="what to train on: digits, synthetic (generated), cifar10 (from --data-dir) or text "
                        "(Python's standard library, for --model lstm, transformer or gru) or torch-source (the "
                        "installed torch package's source: protocol evidence-v3's held-out corpus)")
    p.add_argument("--data-dir", type=Path, default=None, help="where cifar10 is (never downloaded)")
    p.add_argument("--model", choices=MODELS, default=None,
                   help="the network; cnn-wide: 2.2 M parameters, for bandwidth-bound runs; transformer: a small "
                        "decoder-only language model (default: cnn, resnet18 for cifar10, lstm for text)")
    p.add_argument("--seq-len", type=int, default=35,
                   help="--dataset text: tokens per training sequence (the transformer's context)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                   help="sgd (momentum 0.9) or adamw (weight decay 0.01 on matrices), at --lr")
    p.add_argument("--folds", type=int, default=5, help="--dataset digits: cross-validation folds")
    p.add_argument("--fold", type=int, default=0, help="--dataset digits: the fold that is the test set")
    p.add_argument("--evals-per-epoch", type=int, default=1,
                   help="score the validation split this many times per epoch, evenly spaced (the last at the "
                        "epoch's end): finer time-to-quality curves")
    p.add_argument("--target", type=float, default=None,
                   help="a quality to reach (perplexity: at most; accuracy: at least): if the validation score "
                        "has not reached it after --epochs, training goes on at the final learning rate, epoch "
                        "after epoch, until it does or --time-cap (time-to-quality runs)")
    p.add_argument("--time-cap", type=float, default=None,
                   help="stop at the first evaluation after this many seconds of training (time-to-quality runs)")
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop after this many optimizer steps (0: run every epoch), then evaluate; for smoke runs")
    p.add_argument("--max-train-samples", type=int, default=0,
                   help="train on the training split's first N samples only (0: all), every epoch: quick runs "
                        "and tests (as Hugging Face's example scripts spell it)")
    p.add_argument("--max-eval-samples", type=int, default=0,
                   help="score the validation and test splits' first N samples only (0: all)")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where to train: cuda if torch sees a GPU (auto), or the one named")
    p.add_argument("--epochs", type=int, default=15,
                   help="epochs to train (in all: a resumed run's earlier epochs count)")
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.02,
                   help="learning rate per rank (scaled by world size, as for the average of every rank's batch; "
                        "with --sync diloco or torch-localsgd the local steps take the scaled rate too, though each "
                        "sees one rank's batch); 0.02 keeps the last epochs of a compressed run on digits steady, "
                        "higher rates make them swing by several points")
    p.add_argument("--lr-milestones", default="", help="epochs at which the lr is multiplied by --lr-gamma, "
                                                       "comma-separated (e.g. 10,15)")
    p.add_argument("--lr-gamma", type=float, default=0.1, help="the lr's factor at each of --lr-milestones")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights, the data's folds and shuffling")
    p.add_argument("--logdir", type=Path, default=None, help="write steps.csv, eval.csv, TensorBoard events, PNGs")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="save here every epoch (PATH.rank<r> per rank; under --launcher fsdp a "
                        "torch.distributed.checkpoint directory PATH)")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="with --checkpoint PATH: also keep each epoch's checkpoint as PATH.epoch<E> (resume from "
                        "one with --resume PATH.epoch<E>)")
    p.add_argument("--resume", type=Path, default=None, help="continue from this --checkpoint PATH")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--inject-nonfinite", type=_fault, action="append", default=[], metavar="STEP@RANK",
                   help="fault injection (reliability tests): rank RANK's loss is NaN in optimizer step STEP "
                        "(1-based), so all its gradients are; the step is skipped on every rank. Repeatable")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.lr <= 0:
        p.error(f"--lr must be positive, got {args.lr}")
    if args.keep_checkpoints and args.checkpoint is None:
        p.error("--keep-checkpoints keeps each epoch's --checkpoint PATH as PATH.epoch<E>: give --checkpoint PATH")
    if args.large_passes < 1:
        p.error(f"--large-passes must be at least 1, got {args.large_passes}")
    if (args.codec == "bf16") != (args.launcher == "fsdp" and args.codec in ("bf16", "fp16")):
        p.error("--codec bf16 is FSDP's reduce in bfloat16 (--launcher fsdp only); --codec fp16 is Horovod's or "
                "DDP's (under --launcher fsdp use bf16)")
    if args.reduce_dtype is not None and (args.launcher != "fsdp" or args.codec not in (*OURS, "default")):
        p.error(f"--reduce-dtype is for --launcher fsdp with our compression (--codec default, {', '.join(OURS)}); "
                f"FSDP's own all-reduce in bfloat16 is --codec bf16")
    if args.nodes is not None and (args.launcher != "fsdp" or args.nodes < 1):
        p.error(f"--nodes is for --launcher fsdp and at least 1, got {args.nodes}")
    _check_sync(p, args)
    if args.batch_mode and args.launcher != "horovod":
        p.error("--batch-mode needs --launcher horovod (it sets Horovod's backward_passes_per_step)")
    if args.interval < 0:
        p.error(f"--interval must be 0 (per epoch) or a positive number of steps, got {args.interval}")
    for flags, codec in ((("rank", "critical_rank"), "powersgd"), (("ratio", "critical_ratio"), "topk"),
                         (("bits", "critical_bits", "skip_energy"), "quantize")):
        given = [f"--{f.replace('_', '-')}" for f in flags if getattr(args, f) != p.get_default(f)]
        if given and args.codec != codec:  # say so rather than ignore them (--codec default is the default)
            p.error(f"{' and '.join(given)} {'are' if len(given) > 1 else 'is'} {codec}'s: add --codec {codec} "
                    f"(this run's --codec is {args.codec})")
    if args.low_rate is not None and not 0 <= args.low_rate < 1:
        p.error(f"--low-rate must be 0 (off) or a fraction in (0, 1) of the peak learning rate, got {args.low_rate}")
    if args.low_rate is not None and (args.codec not in OURS or args.policy not in ("accordion", "link-gate")):
        p.error("--low-rate needs one of our codecs (powersgd, topk, quantize) with a critical level and --policy "
                "accordion or link-gate")
    try:
        args.lr_milestones = sorted(int(m) for m in args.lr_milestones.split(",") if m.strip())
    except ValueError:
        p.error(f"--lr-milestones must be comma-separated epoch numbers, got {args.lr_milestones!r}")
    if args.dataset == "cifar10" and args.data_dir is None:
        p.error("--dataset cifar10 needs --data-dir (it is never downloaded)")
    args.model = args.model or {"cifar10": "resnet18", "text": "lstm", "torch-source": "gru"}.get(args.dataset, "cnn")
    if (args.dataset in TEXTS) != (args.model in LANGUAGE_MODELS):
        p.error(f"--model lstm, transformer and gru go with --dataset text or torch-source and only with them, got "
                f"--dataset {args.dataset} --model {args.model}")
    if args.folds < 2 or not 0 <= args.fold < args.folds:
        p.error(f"--fold must be in [0, --folds) with --folds >= 2, got --fold {args.fold} --folds {args.folds}")
    if args.evals_per_epoch < 1 or (args.time_cap is not None and not args.time_cap > 0):
        p.error(f"--evals-per-epoch must be at least 1 and --time-cap positive, got {args.evals_per_epoch} and "
                f"{args.time_cap}")
    if args.seq_len < 1 or args.max_steps < 0:
        p.error(f"--seq-len must be at least 1 and --max-steps at least 0, got {args.seq_len} and {args.max_steps}")
    if args.max_train_samples < 0 or args.max_eval_samples < 0:
        p.error(f"--max-train-samples and --max-eval-samples must be at least 0 (0: all), got "
                f"{args.max_train_samples} and {args.max_eval_samples}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda: torch {torch.__version__} sees no GPU (use --device cpu or auto)")
    try:
        make_codec(args)
        if args.codec in OURS:
            make_compression(args)
    except (TypeError, ValueError) as exc:
        p.error(str(exc))
    return args


def _fault(text: str) -> tuple[int, int]:
    try:
        step, rank = (int(part) for part in text.split("@"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected STEP@RANK (e.g. 30@1), got {text!r}") from None
    if step < 1 or rank < 0:
        raise argparse.ArgumentTypeError(f"STEP must be >= 1 and RANK >= 0, got {text!r}")
    return step, rank
