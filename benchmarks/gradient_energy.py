"""How much of a step's gradient each compression level can keep, per layer of the language
models: the share of the gradient's energy (squared Frobenius norm) left out by the best
rank-r approximation (the floor PowerSGD's subspace iteration approaches from above) and by
keeping the largest k entries (TopK, exactly). No error feedback: one step's gradient alone.

    .venv/bin/python benchmarks/gradient_energy.py          # benchmarks/results/gradient-energy.md

One process, 64 sequences of 35 tokens per step (the protocol's 2 ranks x 32), the
protocol's optimizers (transformer: AdamW at 0.002, the per-rank 0.001 times 2 ranks; LSTM:
SGD with momentum 0.9 at 1.0); the gradient is measured at the start and after 100 and 300 steps, on a
batch of its own. It tells which layers a codec suits: a layer whose gradient is sparse (the
tied embedding: only the rows of tokens in the batch carry much) loses little to TopK and
much to a low rank; a dense layer the other way round (docs/time-to-quality.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from accordion_hvd.cli import data, models  # noqa: E402

RANKS = (1, 4, 16, 32)
RATIOS = (0.01, 0.1)
AT_STEPS = (0, 100, 300)


def left_out(grad: torch.Tensor) -> dict[str, float]:
    """Share of the energy each level leaves out, for one gradient (viewed as a matrix)."""
    m = grad.reshape(grad.shape[0], -1).double()
    s2 = torch.linalg.svdvals(m).square()
    total = float(s2.sum())
    out = {f"rank {r}": float(s2[r:].sum()) / total for r in RANKS}
    top = m.abs().flatten().sort(descending=True).values.square()
    for ratio in RATIOS:
        out[f"top {ratio:.0%}"] = 1 - float(top[:max(1, int(ratio * top.numel()))].sum()) / total
    return out


def build(name: str, vocabulary: int) -> torch.nn.Module:
    if name == "transformer":
        return models.TransformerLanguageModel(vocabulary, context=35)
    return models.LSTMLanguageModel(vocabulary)


def measure(name: str, corpus) -> list[str]:
    torch.manual_seed(0)
    vocabulary = len(corpus.vocabulary)
    model = build(name, vocabulary)
    lstm = name == "lstm"
    opt = (torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9) if lstm
           else torch.optim.AdamW(model.parameters(), lr=0.002, weight_decay=0.01))
    x, y = corpus.train.x, corpus.train.y
    loss_fn = torch.nn.CrossEntropyLoss()

    def loss_of(idx):
        out = model(x[idx])
        out = out[0] if isinstance(out, tuple) else out
        return loss_fn(out.reshape(-1, vocabulary), y[idx].reshape(-1))

    keys = [f"rank {r}" for r in RANKS] + [f"top {r:.0%}" for r in RATIOS]
    lines = [f"## {name}", "", "Share of each layer's gradient energy left out (lower is better); "
             "`share` is the layer's part of the model's gradient energy.", ""]
    for step in range(max(AT_STEPS) + 1):
        if step in AT_STEPS:
            model.zero_grad()
            loss_of(torch.randint(0, len(x), (64,))).backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.dim() >= 2 and p.grad is not None}
            total = sum(float(g.double().square().sum()) for g in grads.values())
            lines += [f"After {step} steps:", "", "| layer | shape | share | " + " | ".join(keys) + " |",
                      "|---|---|---:|" + "---:|" * len(keys)]
            whole = dict.fromkeys(keys, 0.0)
            for n, g in grads.items():
                share = float(g.double().square().sum()) / total
                lost = left_out(g)
                for k in keys:
                    whole[k] += lost[k] * share
                lines.append(f"| {n} | {tuple(g.shape)} | {share:.2f} | " + " | ".join(f"{lost[k]:.2f}" for k in keys)
                             + " |")
            lines += ["| **all matrices** | | 1.00 | " + " | ".join(f"**{whole[k]:.2f}**" for k in keys) + " |", ""]
        model.zero_grad()
        loss_of(torch.randint(0, len(x), (64,))).backward()
        opt.step()
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="transformer,lstm")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gradient-energy.md"))
    args = p.parse_args()
    torch.set_num_threads(1)
    corpus = data.load_text()
    lines = ["# Gradient energy each compression level leaves out", "",
             f"`.venv/bin/python benchmarks/gradient_energy.py` (one thread; torch {torch.__version__}). "
             "See the script's docstring for what is measured.", ""]
    for name in args.models.split(","):
        lines += measure(name, corpus)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
