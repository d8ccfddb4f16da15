"""``python -m accordion_hvd.train``: the training CLI (accordion_hvd/cli/train.py)."""

from .cli.train import run_cli

if __name__ == "__main__":
    run_cli()
