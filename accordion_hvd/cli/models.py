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
    end-to-end benchmark's model, where the network decides the step time (a dense allreduce
    of 8.6 MB over 100 Mbit/s takes about 0.7 s by the link's rate alone, far longer than the
    step's compute; measured: docs/design.md, "Measured reasons")."""

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

    cell, cell_name = nn.LSTM, "lstm"  # the recurrent cell, and the attribute (its parameters' names) it is under

    def __init__(self, vocabulary: int, dim: int = 128, layers: int = 2, dropout: float = 0.2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, dim)
        setattr(self, self.cell_name, self.cell(dim, dim, num_layers=layers, dropout=dropout, batch_first=True))
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(dim, vocabulary)
        self.decoder.weight = self.embedding.weight  # tied
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, tokens):
        """(batch, time) token ids -> (batch, time, vocabulary) logits of the next token."""
        hidden, _ = getattr(self, self.cell_name)(self.drop(self.embedding(tokens)))
        return self.decoder(self.drop(hidden))


class GRULanguageModel(LSTMLanguageModel):
    """A 2-layer GRU language model, 192 wide, tied embeddings: protocol evidence-v3's held-out
    model (a recurrent cell the project never trained before, on text it never used)."""

    cell, cell_name = nn.GRU, "gru"

    def __init__(self, vocabulary: int, dim: int = 192, layers: int = 2, dropout: float = 0.2) -> None:
        super().__init__(vocabulary, dim, layers, dropout)


class _DecoderBlock(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.drop.p if self.training else 0.0)
        x = x + self.drop(self.proj(attended.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.fc2(nn.functional.gelu(self.fc1(self.norm2(x)))))


class TransformerLanguageModel(nn.Module):
    """A small decoder-only transformer language model (GPT-2's layout, smaller for CPUs):
    token embedding plus learned positions, ``layers`` pre-norm blocks (causal multi-head
    attention, a 4x MLP), a final LayerNorm, and a decoder that shares the embedding's weight
    (tied embeddings).

    What it gives a compressor, unlike the LSTM: the (vocabulary x dim) embedding/decoder,
    the positions (context x dim), and per block four matrices of three shapes (the fused
    q/k/v projection 3 dim x dim, the output projection dim x dim, the MLP's 4 dim x dim and
    dim x 4 dim); LayerNorm weights and all biases go dense. GPT-2's initialization: normal
    with std 0.02, the residual projections scaled by 1/sqrt(2 layers).
    """

    def __init__(self, vocabulary: int, context: int, dim: int = 128, layers: int = 2, heads: int = 4,
                 dropout: float = 0.1) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads})")
        self.context = context
        self.embedding = nn.Embedding(vocabulary, dim)
        self.positions = nn.Embedding(context, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_DecoderBlock(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.decoder = nn.Linear(dim, vocabulary)
        self.decoder.weight = self.embedding.weight  # tied
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                scaled = name.endswith(("proj.weight", "fc2.weight"))
                nn.init.normal_(p, std=0.02 / (2 * layers) ** 0.5 if scaled else 0.02)

    def forward(self, tokens):
        """(batch, time) token ids, time <= context -> (batch, time, vocabulary) logits of the next token."""
        t = tokens.shape[1]
        if t > self.context:
            raise ValueError(f"sequences of {t} tokens, but the model's context is {self.context}")
        x = self.drop(self.embedding(tokens) + self.positions.weight[:t])
        for block in self.blocks:
            x = block(x)
        return self.decoder(self.norm(x))
