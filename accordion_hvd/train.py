"""``python -m accordion_hvd.train``: the training CLI (accordion_hvd/cli/train.py)."""

from .cli.train import main

if __name__ == "__main__":
    main()
