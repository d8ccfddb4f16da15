"""The CLI's models in one process: shapes, causality, tied weights, what a compressor sees."""

import torch

import accordion_hvd as acc
from accordion_hvd.cli.models import TransformerLanguageModel


def test_transformer_is_causal_tied_and_predicts_every_position():
    torch.manual_seed(0)
    model = TransformerLanguageModel(vocabulary=50, context=12, dim=32, layers=2, heads=4).eval()
    tokens = torch.randint(0, 50, (3, 12))
    logits = model(tokens)
    assert logits.shape == (3, 12, 50)
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 50  # the future changes: the past's predictions do not
    assert torch.allclose(model(changed)[:, :7], logits[:, :7], atol=1e-6)
    assert not torch.allclose(model(changed)[:, 7:], logits[:, 7:])
    assert model.decoder.weight is model.embedding.weight
    assert model(tokens[:, :5]).shape == (3, 5, 50)  # shorter than the context: fine


def test_transformer_layers_are_what_the_codecs_compress_and_the_rest_goes_dense():
    model = TransformerLanguageModel(vocabulary=7783, context=35)
    codec = acc.PowerSGD(rank=1)
    compressed = {n for n, p in model.named_parameters() if codec.compressible(p.shape)}
    assert compressed == {"embedding.weight", "positions.weight"} | {
        f"blocks.{i}.{m}.weight" for i in range(2) for m in ("qkv", "proj", "fc1", "fc2")}
    assert 1_300_000 < sum(p.numel() for p in model.parameters()) < 1_500_000


def test_the_held_out_gru_is_tied_two_layers_and_predicts_every_position():
    from accordion_hvd.cli.models import GRULanguageModel

    torch.manual_seed(0)
    model = GRULanguageModel(100)
    assert model.decoder.weight is model.embedding.weight and model.gru.num_layers == 2
    assert model.gru.hidden_size == 192
    logits = model(torch.randint(0, 100, (3, 7)))
    assert logits.shape == (3, 7, 100)
