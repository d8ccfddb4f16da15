"""Models for the training CLI."""

from __future__ import annotations

from torch import nn


class SmallCNN(nn.Module):
    """A small CNN for 8x8 single-channel images (digits): 2 conv layers, 2 linear layers.

    Its 4-D conv weights and 2-D linear weights are what a compressor compresses; the
    biases go through the ordinary dense allreduce.
    """

    def __init__(self, num_classes: int = 10, channels: int = 1) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.features(x))
