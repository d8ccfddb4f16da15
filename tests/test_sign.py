"""Sign (codecs/sign.py, 1 bit per entry with error feedback on both sides): its compiled CPU
kernels (csrc/cpu/sign.cpp) and its torch-op path against the plain-torch reference
(reference.sign_ef / sign_average); opcheck; bad arguments named; and the codec through the
engine on simulated ranks against the reference of both compressions, a skipped step, the
wire counted and a checkpoint round trip."""

import math

import pytest
import torch
from torch.library import opcheck

import accordion_hvd as acc
from accordion_hvd import ops, reference
from accordion_hvd.codecs import sign as sign_codec
from accordion_hvd.comm import SimulatedWorld
from accordion_hvd.levels import DENSE16

TRUE, FALSE = torch.tensor(True), torch.tensor(False)


def scale_of(payload):
    return payload[:4].view(torch.float32)


@pytest.mark.parametrize("numel", [1, 7, 8, 31, 32, 1000, 8192, 20001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sign_ef_is_the_reference(numel, dtype):
    torch.manual_seed(numel)
    x = (torch.randn(numel) * 3).to(dtype)
    residual = torch.randn(numel) * 0.1
    residual[: numel // 3] = -x[: numel // 3].float()  # g exactly 0 there: sent as +1
    want, want_g = reference.sign_ef(x, residual.clone())
    e = residual.clone()
    payload = ops.sign_ef_(x, e, TRUE)
    assert payload.dtype == torch.uint8 and payload.numel() == acc.Sign.payload_bytes(numel) == want.numel()
    assert torch.equal(e, want_g)  # g = x + e, kept until the step settles
    assert torch.equal(payload[4:], want[4:])  # every bit, and the padding zero
    torch.testing.assert_close(scale_of(payload), scale_of(want), rtol=1e-6, atol=0)  # (its order of addition)


@pytest.mark.parametrize("numel", [5, 1000, 20001])
def test_the_torch_path_is_the_reference(numel, monkeypatch):
    torch.manual_seed(numel + 1)
    x, residual = torch.randn(numel), torch.randn(numel)
    monkeypatch.setattr(sign_codec.ops, "has_kernel", lambda t, op=None: False)
    want, want_g = reference.sign_ef(x, residual.clone())
    e = residual.clone()
    payload = sign_codec.encode_sign(x, e, TRUE)
    assert torch.equal(e, want_g) and torch.equal(payload[4:], want[4:])
    torch.testing.assert_close(scale_of(payload), scale_of(want), rtol=1e-6, atol=0)
    rows = torch.stack([payload, reference.sign_ef(torch.randn(numel), torch.zeros(numel))[0]])
    assert torch.equal(sign_codec.average_signs(rows, numel), reference.sign_average(rows, numel))


def test_zero_is_plus_one_and_the_scale_is_the_rms():
    g = torch.tensor([3.0, 0.0, -4.0, -0.0, 1.0, -1.0, 2.0, -2.0, 5.0])
    payload = ops.sign_ef_(torch.zeros(9), g.clone())
    assert payload.numel() == 8 and payload[4].item() == 0b01011011 and payload[5].item() == 1
    assert scale_of(payload).item() == pytest.approx(math.sqrt(float(g.square().sum()) / 9))
    out = ops.sign_average(payload.unsqueeze(0), 9, torch.float32)
    s = scale_of(payload).item()
    assert out.tolist() == pytest.approx([s, s, -s, s, s, -s, s, -s, s])


@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
@pytest.mark.parametrize("numel", [9, 4096, 20001])
def test_sign_average_is_the_reference_bit_for_bit(ranks, numel):
    torch.manual_seed(ranks * numel)
    rows = torch.stack([reference.sign_ef(torch.randn(numel) * (1 + r), torch.zeros(numel))[0] for r in range(ranks)])
    want = reference.sign_average(rows, numel)
    assert torch.equal(ops.sign_average(rows, numel, torch.float32), want)
    assert torch.equal(ops.sign_average(rows, numel, torch.float16), want.half())
    wide = torch.zeros(ranks, rows.shape[1] + 12, dtype=torch.uint8)  # rows of a gathered bucket
    wide[:, 8:8 + rows.shape[1]] = rows
    assert torch.equal(ops.sign_average(wide[:, 8:8 + rows.shape[1]], numel, torch.float32), want)


def test_a_non_finite_gradient_leaves_e_and_sends_a_nan_scale():
    x, residual = torch.randn(300), torch.randn(300)
    x[5] = float("nan")
    e = residual.clone()
    payload = ops.sign_ef_(x, e, FALSE)
    assert torch.equal(e, residual) and math.isnan(scale_of(payload).item())
    assert torch.equal(payload[4:], reference.sign_ef(torch.zeros(300), residual)[0][4:])  # e's own signs


def test_opcheck():
    x, residual = torch.randn(1000), torch.randn(1000)
    opcheck(torch.ops.accordion.sign_ef_.default, (x, residual.clone(), TRUE))
    rows = torch.stack([ops.sign_ef_(torch.randn(1000), torch.zeros(1000)) for _ in range(3)])
    opcheck(torch.ops.accordion.sign_average.default, (rows, 1000, torch.float32))


def test_bad_arguments_are_named():
    with pytest.raises(RuntimeError, match="residual must be a contiguous 1-d float32"):
        ops.sign_ef_(torch.randn(4, 4, dtype=torch.float64), torch.zeros(4, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="same shape"):
        ops.sign_ef_(torch.randn(5), torch.zeros(6))
    with pytest.raises(RuntimeError, match="each row must be a payload of 8 bytes for 9 entries"):
        ops.sign_average(torch.zeros(2, 12, dtype=torch.uint8), 9, torch.float32)
    with pytest.raises(RuntimeError, match="rows must be a 2-d uint8"):
        ops.sign_average(torch.zeros(2, 8), 9, torch.float32)
    with pytest.raises(ValueError, match="min_numel"):
        acc.codecs.Sign(min_numel=0)


SHAPES = {"a.weight": (64, 48), "b.weight": (96, 40), "b.bias": (96,)}


def grads_of(rank, step):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return {n: torch.randn(s, generator=gen) * (1 + rank) for n, s in SHAPES.items()}


def reference_steps(world, steps):
    """Both compressions with error feedback, from reference.sign_ef / sign_average alone."""
    worker = {(r, n): torch.zeros(math.prod(s)) for r in range(world) for n, s in SHAPES.items()}
    server = {n: torch.zeros(math.prod(s)) for n, s in SHAPES.items()}
    out = []
    for step in range(steps):
        got = {}
        for n in ("a.weight", "b.weight"):
            rows = []
            for r in range(world):
                payload, g = reference.sign_ef(grads_of(r, step)[n], worker[r, n])
                worker[r, n] = g - reference.sign_average(payload.unsqueeze(0), g.numel())
                rows.append(payload)
            mean = reference.sign_average(torch.stack(rows), math.prod(SHAPES[n]))
            payload, z = reference.sign_ef(mean, server[n])
            result = reference.sign_average(payload.unsqueeze(0), mean.numel())
            server[n] = z - result
            got[n] = result.view(SHAPES[n])
        out.append(got)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_server_side_message_of_the_mean(world):
    def worker(rank, channel):
        comp = acc.AccordionCompressor(acc.codecs.Sign(), policy="static", channel=channel)
        out = []
        for step in range(4):
            g = grads_of(rank, step)
            sent = {n: comp.compress_named(n, g[n]) for n in sorted(g)}
            out.append({n: comp.decompress(channel.wait(channel.allreduce_mean_async([sent[n][0]], f"hvd.{n}"))[0],
                                           sent[n][1]) for n in sorted(sent)})
        return out, comp.stats(), comp.state_dict()

    results = SimulatedWorld(world).run(worker)
    want = reference_steps(world, 4)
    for step in range(4):
        for n in ("a.weight", "b.weight"):
            for r in range(world):  # (the scales may differ in their last bit from the reference's)
                torch.testing.assert_close(results[r][0][step][n], want[step][n], rtol=1e-5, atol=1e-6)
            assert torch.equal(results[0][0][step][n], results[-1][0][step][n])  # alike on every rank
        bias = torch.stack([grads_of(r, step)["b.bias"] for r in range(world)]).mean(0)
        torch.testing.assert_close(results[0][0][step]["b.bias"], bias)  # 1-d: sent as it is
    stats = results[0][1]["layers"]
    assert stats["a.weight"]["bytes_sent"] == 4 * (4 + 64 * 48 // 8)  # a scale and a bit per entry, 4 steps
    assert stats["a.weight"]["bytes_dense"] == 4 * 4 * 64 * 48
    # the server side's error feedback is the same on every rank; the worker's is each rank's own
    layers = [r[2]["layers"]["a.weight"] for r in results]
    assert all(torch.equal(layer["server"], layers[0]["server"]) for layer in layers)
    assert not torch.equal(layers[0]["residual"], layers[1]["residual"])
    codec = acc.codecs.Sign()
    assert codec.compressible(torch.Size([64, 48])) and not codec.compressible(torch.Size([4096]))


def test_a_non_finite_gradient_on_one_rank_skips_the_step_everywhere_and_loses_nothing():
    def worker(rank, channel):
        comp = acc.AccordionCompressor(acc.codecs.Sign(), policy="static", channel=channel)
        g = torch.randn(64, 48, generator=torch.Generator().manual_seed(rank))
        if rank == 1:
            g[3, 3] = math.nan
        out, ctx = comp.compress_named("w", g)
        got = comp.decompress(channel.wait(channel.allreduce_mean_async([out], "hvd.w"))[0], ctx)
        layer = comp.engine.layers["w"]
        return got, comp.skipped_steps, layer.residual.clone(), layer.server.clone(), g

    for rank, (got, skipped, residual, server, g) in enumerate(SimulatedWorld(2).run(worker)):
        assert skipped == 1 and torch.equal(got, torch.zeros_like(got))
        assert torch.equal(residual, g.reshape(-1) if rank == 0 else torch.zeros_like(residual))
        assert torch.equal(server, torch.zeros_like(server))  # the server side untouched


def test_dense16_and_a_checkpoint_round_trip():
    codec = acc.codecs.Sign(min_numel=1)
    grad = torch.randn(30, 100)
    state = codec.init_state("w", grad)
    payload = codec.encode(state, grad, TRUE)
    other = reference.sign_ef(torch.randn(3000), torch.zeros(3000))[0]  # another rank's message
    codec.decode(state, torch.stack([payload, other]), torch.float32)
    codec.settle(state, TRUE)
    assert state.server.abs().sum() > 0 and state.residual.abs().sum() > 0
    again = codec.state_from_dict("w", codec.state_to_dict(state))
    assert torch.equal(again.residual, state.residual) and torch.equal(again.server, state.server)
    with pytest.raises(ValueError, match="does not fit"):
        codec.state_from_dict("w", {**codec.state_to_dict(state), "server": torch.zeros(5)})
    codec.set_level(state, DENSE16)
    assert codec.sends_dense(state) and codec.floats_sent(state) == 3000
    assert codec.flush_dense(state, grad, TRUE).dtype == torch.float16
