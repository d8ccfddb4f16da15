"""Quantize's sparse chunks (``skip_energy``; accordion_hvd/codecs/quantize_chunks.py): the
math step by step against the plain-torch reference (reference.quantize_chunks_ef), the count
of chunks agreed by every rank on simulated worlds of 2 and 3 ranks, bytes counted exactly,
checkpoints and bad input (non-finite gradients: test_quantize.py, with and without sparse
chunks). Under real horovodrun it runs against the NumPy reference in test_numpy_reference.py
(mode quantize-sparse)."""

import math

import pytest
import torch

import accordion_hvd as acc
from accordion_hvd import reference
from accordion_hvd.codecs import quantize_chunks
from accordion_hvd.comm import SimulatedWorld

TRUE = torch.tensor(True)


def skewed(numel, seed, hot=0.2):
    """A gradient whose first ``hot`` share of entries is 20x the rest: most chunks hold little."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(numel, generator=gen)
    g[:int(hot * numel)] *= 20
    return g[torch.randperm(numel, generator=gen)] if seed % 2 else g


@pytest.mark.parametrize("numel,chunk", [(1000, 64), (4096, 512), (513, 128)])
@pytest.mark.parametrize("skip", [0.01, 0.3])
def test_steps_are_the_reference_and_the_count_follows_the_energy(numel, chunk, skip):
    codec = acc.Quantize(8, chunk=chunk, min_numel=1, skip_energy=skip)
    state = codec.init_state("w", torch.zeros(numel))
    residual, k, counts = torch.zeros(numel), codec.chunks(numel), []
    for step in range(5):
        grad = skewed(numel, step)
        indices, q, scales, k_next, residual = reference.quantize_chunks_ef(grad, residual, 8, chunk, k, skip)
        payload = codec.encode(state, grad, TRUE)
        assert torch.equal(state.sent[0], indices) and torch.equal(state.sent[1], q) and torch.equal(state.sent[2], scales)
        assert payload.numel() == quantize_chunks.payload_bytes(k, chunk, 8) == codec.bytes_sent(state)
        mean = codec.decode(state, torch.stack([payload, payload]), torch.float32)
        assert torch.equal(mean, reference.quantized_chunks_average([(indices, q, scales)] * 2, numel, chunk))
        assert state.k == k_next  # both ranks needed the same
        codec.settle(state, TRUE)
        assert torch.equal(state.residual, residual)
        counts.append(k)
        k = k_next
    assert counts[0] == codec.chunks(numel)  # the first step sends every chunk
    if skip == 0.3:
        assert min(counts) < codec.chunks(numel)  # later steps fewer


def test_skip_zero_is_the_dense_layout_and_chunks_never_sent_wait_in_error_feedback():
    dense = acc.Quantize(8, chunk=4, min_numel=1)
    assert dense.wire((1000,), acc.levels.NORMAL) == (("allgather", dense.payload_bytes(1000, 8)),)
    codec = acc.Quantize(8, chunk=4, min_numel=1, skip_energy=0.5)
    grad = torch.tensor([0.0, 0.0, 0.1, 0.0, 5.0, -4.0, 3.0, 1.0, 0.2, 0.0, 0.0, 0.1])
    state = codec.init_state("w", grad)
    state.k = 1  # as if agreed: one chunk of three
    codec.encode(state, grad, TRUE)
    assert state.sent[0].tolist() == [1]
    codec.settle(state, TRUE)
    # the unsent chunks keep all of g; the sent one keeps only its rounding
    assert torch.equal(state.residual[:4], grad[:4]) and torch.equal(state.residual[8:], grad[8:])
    assert bool((state.residual[4:8].abs() <= 5.0 / 127 / 2 + 1e-7).all())


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_agrees_on_the_count_and_gets_the_mean_of_the_sent_chunks(world):
    shape, chunk, skip = (64, 48), 128, 0.2

    def worker(rank, channel):
        comp = acc.AccordionCompressor(acc.Quantize(8, chunk=chunk, skip_energy=skip), policy="static",
                                       channel=channel)
        out = []
        for step in range(4):
            out_, ctx = comp.compress_named("w", skewed(math.prod(shape), 10 * step + rank).view(shape))
            out.append(comp.decompress(channel.wait(channel.allreduce_mean_async([out_], "hvd.w"))[0], ctx))
        return out, comp.stats(), comp.engine.layers["w"].k

    results = SimulatedWorld(world).run(worker)
    numel, chunks = math.prod(shape), -(-math.prod(shape) // chunk)
    residuals, k, sent_bytes = [torch.zeros(numel) for _ in range(world)], chunks, 0
    for step in range(4):
        payloads, needs = [], []
        for r in range(world):
            indices, q, scales, k_next, residuals[r] = reference.quantize_chunks_ef(
                skewed(numel, 10 * step + r), residuals[r], 8, chunk, k, skip)
            payloads.append((indices, q, scales))
            needs.append(k_next)
        want = reference.quantized_chunks_average(payloads, numel, chunk).view(shape)
        for r in range(world):
            assert torch.equal(results[r][0][step], want), (step, r)
        sent_bytes += quantize_chunks.payload_bytes(k, chunk, 8)
        k = max(needs)
    for r in range(world):
        assert results[r][2] == k  # the count for the next step, the same on every rank
        assert results[r][1]["layers"]["w"]["bytes_sent"] == sent_bytes  # exactly, step by step
    assert k < chunks


def test_the_count_is_checkpointed_and_a_wrong_one_refused():
    codec = acc.Quantize(8, chunk=64, min_numel=1, skip_energy=0.3)
    state = codec.init_state("w", torch.zeros(1000))
    for step in range(2):
        payload = codec.encode(state, skewed(1000, step), TRUE)
        codec.decode(state, payload[None], torch.float32)
        codec.settle(state, TRUE)
    again = codec.state_from_dict("w", codec.state_to_dict(state))
    assert again.k == state.k < codec.chunks(1000) and torch.equal(again.residual, state.residual)
    for bad in (0, 17, "3"):
        with pytest.raises(ValueError, match="chunk count"):
            codec.state_from_dict("w", {**codec.state_to_dict(state), "k": bad})
    assert "skip_energy" in codec.config() and "skip_energy" not in acc.Quantize(8).config()


@pytest.mark.parametrize("value", [1.0, -0.1, "0.1", True, float("nan")])
def test_bad_skip_energy_is_named(value):
    with pytest.raises(ValueError, match="skip_energy must be a number in"):
        acc.Quantize(8, skip_energy=value)
