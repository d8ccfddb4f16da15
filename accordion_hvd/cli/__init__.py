"""The training CLI's wing: ``python -m accordion_hvd.train`` and what it needs that the
library does not (datasets, models, metrics files, plots, checkpoints, the uncompressed
baselines). Nothing in the library imports it (tests/test_architecture.py checks)."""
