"""Models for the training CLI."""

from __future__ import annotations

from torch import nn


class SmallCNN(nn.Module):
    """A small CNN for 8x8 images (digits): 2 conv layers (``widths`` channels), 2 linear
    layers (``hidden`` units between them).

    Its 4-D conv weights and 2-D linear weights are what a compressor compresses; the
    biases go through the ordinary dense allreduce.
    """

    def __init__(self, num_classes: int = 10, channels: int = 1, *, widths: tuple[int, int] = (16, 32),
                 hidden: int = 64) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, widths[0], 3, padding=1), nn.ReLU(),
            nn.Conv2d(widths[0], widths[1], 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(widths[1] * 4 * 4, hidden), nn.ReLU(), nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.features(x))


class WideCNN(SmallCNN):
    """SmallCNN with a wide classifier: 2.2 M parameters, 8.6 MB of float32 gradient per
    step, almost all in one 1024 x 2048 matrix. Cheap to compute, expensive to send: the
    end-to-end benchmark's model, where the network decides the step time (0.7 s for a dense
    allreduce over 100 Mbit/s, against ~20 ms of compute)."""

    def __init__(self, num_classes: int = 10, channels: int = 1) -> None:
        super().__init__(num_classes, channels, widths=(32, 64), hidden=2048)


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.bn1(self.conv1(x)).relu()
        return (self.bn2(self.conv2(out)) + self.shortcut(x)).relu()


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 images (the CIFAR variant the Accordion paper trains: 3x3 stem,
    no max-pool), 11.2M parameters; ``width`` scales every layer (64 = the standard one)."""

    def __init__(self, num_classes: int = 10, channels: int = 3, width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for i, stride in enumerate((1, 2, 2, 2)):
            cout = width * 2 ** i
            layers += [_BasicBlock(cin, cout, stride), _BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x):
        return self.head(self.layers(self.stem(x)).mean(dim=(2, 3)))


class LSTMLanguageModel(nn.Module):
    """A 2-layer LSTM language model (the Accordion and PowerSGD papers' LSTM on WikiText-2,
    smaller for CPUs): embedding, LSTM, dropout, and a decoder that shares the embedding's
    weight (tied embeddings, Press & Wolf 2017: fewer parameters, usually lower perplexity).

    Its compressed matrices are the (vocabulary x dim) embedding/decoder weight and the LSTM's
    (4 dim x dim) input and recurrent weights; the biases go dense.
    """

    def __init__(self, vocabulary: int, dim: int = 128, layers: int = 2, dropout: float = 0.2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, dim)
        self.lstm = nn.LSTM(dim, dim, num_layers=layers, dropout=dropout, batch_first=True)
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(dim, vocabulary)
        self.decoder.weight = self.embedding.weight  # tied
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, tokens):
        """(batch, time) token ids -> (batch, time, vocabulary) logits of the next token."""
        hidden, _ = self.lstm(self.drop(self.embedding(tokens)))
        return self.decoder(self.drop(hidden))
