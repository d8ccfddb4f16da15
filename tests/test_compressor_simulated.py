"""AccordionCompressor and its codecs on an in-process simulated N-rank channel."""

import pytest
import torch

import accordion_hvd as acc
from accordion_hvd import reference
from accordion_hvd.comm import SimulatedWorld

SHAPES = {"conv.weight": (16, 8, 3, 3), "fc.weight": (40, 64), "fc.bias": (40,), "tiny.weight": (2, 2)}


def grads_for(rank, step, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return {n: torch.randn(s, generator=gen).to(dtype) for n, s in SHAPES.items()}


def run_steps(world_size, make_codec, steps, order=lambda rank, names: names, dtype=torch.float32, grads=None):
    """Every simulated rank compresses its gradients (``grads(rank, step)``, default
    ``grads_for`` in ``dtype``; in the given order) and decompresses; returns per rank: the
    list of per-step results and the compressor."""
    grads = grads or (lambda rank, step: grads_for(rank, step, dtype))

    def worker(rank, channel):
        comp = acc.AccordionCompressor(make_codec(), channel=channel)
        history = []
        for step in range(steps):
            grads_now = grads(rank, step)
            sent = {n: comp.compress_named(n, grads_now[n]) for n in order(rank, list(grads_now))}
            # What Horovod does in between: allreduce (average) whatever compress returned.
            # (Horovod negotiates the order across ranks; the simulation uses name order.)
            reduced = {n: channel.wait(channel.allreduce_mean_async([sent[n][0]], f"hvd.{n}"))[0]
                       for n in sorted(sent)}
            history.append({n: comp.decompress(reduced[n], sent[n][1]) for n in sorted(sent)})
        return history, comp
    return SimulatedWorld(world_size).run(worker)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("make_codec", [lambda: acc.PowerSGD(rank=2), lambda: acc.TopK(ratio=0.05)],
                         ids=["powersgd", "topk"])
def test_all_ranks_get_identical_results(world_size, make_codec):
    results = run_steps(world_size, make_codec, steps=3)
    for step in range(3):
        for name in SHAPES:
            for rank in range(1, world_size):
                assert torch.equal(results[0][0][step][name], results[rank][0][step][name]), (step, name)


@pytest.mark.parametrize("make_codec", [lambda: acc.PowerSGD(rank=2), lambda: acc.TopK(ratio=0.05)],
                         ids=["powersgd", "topk"])
def test_error_feedback_conserves_the_gradient(make_codec):
    """sum_t decoded_t + mean_i(e_i) == sum_t mean_i(g_i,t): nothing is lost or double counted.
    Fails if error feedback is not updated, or if results are summed instead of averaged."""
    world, steps = 3, 4
    results = run_steps(world, make_codec, steps)
    comps = [c for _, c in results]
    for name in ("conv.weight", "fc.weight"):
        sent = sum(results[0][0][t][name].double() for t in range(steps))
        mean_residual = sum(c.engine.layers[name].residual.double().reshape(SHAPES[name]) for c in comps) / world
        true_mean = sum(sum(grads_for(r, t)[name].double() for r in range(world)) / world for t in range(steps))
        torch.testing.assert_close(sent + mean_residual, true_mean, rtol=1e-5, atol=1e-5)


def test_powersgd_at_full_rank_is_the_exact_average():
    results = run_steps(2, lambda: acc.PowerSGD(rank=40, min_compression_rate=0.01), steps=1)
    expected = (grads_for(0, 0)["fc.weight"] + grads_for(1, 0)["fc.weight"]) / 2
    torch.testing.assert_close(results[0][0][0]["fc.weight"], expected, rtol=1e-4, atol=1e-5)


def test_powersgd_matches_a_by_hand_computation():
    world = 2
    results = run_steps(world, lambda: acc.PowerSGD(rank=2), steps=1)
    comp = results[0][1]
    name = "fc.weight"
    q0 = comp.codec._fresh_columns(name, 64, 0, 2, torch.float32, "cpu")
    ms = [grads_for(r, 0)[name] for r in range(world)]
    p = reference.orthogonalize_(sum(m @ q0 for m in ms) / world)
    q = sum(m.t() @ p for m in ms) / world
    torch.testing.assert_close(results[0][0][0][name], p @ q.t(), rtol=1e-5, atol=1e-6)


def test_topk_averages_each_ranks_largest_entries():
    world, ratio = 2, 0.05
    results = run_steps(world, lambda: acc.TopK(ratio=ratio), steps=1)
    name = "fc.weight"
    k = acc.TopK(ratio).level_k(acc.levels.NORMAL, 40 * 64)
    expected = torch.zeros(40 * 64)
    for r in range(world):
        g = grads_for(r, 0)[name].reshape(-1)
        idx = g.abs().topk(k).indices
        expected[idx] += g[idx] / world
    torch.testing.assert_close(results[0][0][0][name].reshape(-1), expected)


def test_hook_order_may_differ_between_ranks():
    reverse_on_odd = lambda rank, names: names[::-1] if rank % 2 else names  # noqa: E731
    for make in (lambda: acc.PowerSGD(rank=2), lambda: acc.TopK(ratio=0.05)):
        a = run_steps(3, make, steps=2)
        b = run_steps(3, make, steps=2, order=reverse_on_odd)
        for rank in range(3):
            for t in range(2):
                for name in SHAPES:
                    assert torch.equal(a[rank][0][t][name], b[rank][0][t][name])


def test_small_and_1d_tensors_go_dense_and_floats_are_counted_exactly():
    steps = 3
    results = run_steps(2, lambda: acc.PowerSGD(rank=2), steps)
    stats = results[0][1].stats()
    layers = stats["layers"]
    assert layers["fc.bias"] == {"floats_sent": 40 * steps, "floats_dense": 40 * steps, "level": "dense",
                                 "bytes_sent": 4 * 40 * steps, "bytes_dense": 4 * 40 * steps, "unused": False}
    assert layers["tiny.weight"]["level"] == "dense"
    # PowerSGD rank 2: P (40 x 2) and Q (64 x 2) in float32, every step
    assert layers["fc.weight"] == {"floats_sent": (40 + 64) * 2 * steps, "floats_dense": 40 * 64 * steps,
                                   "bytes_sent": 4 * (40 + 64) * 2 * steps, "bytes_dense": 4 * 40 * 64 * steps,
                                   "level": "normal", "unused": False}
    assert layers["conv.weight"]["floats_sent"] == (16 + 72) * 2 * steps
    for counter in ("floats_sent", "floats_dense", "bytes_sent", "bytes_dense"):
        assert stats[counter] == sum(v[counter] for v in layers.values())
    assert results[1][1].stats() == stats


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("make", [lambda: acc.PowerSGD(rank=2), lambda: acc.TopK(ratio=0.05)], ids=["powersgd", "topk"])
def test_half_precision_gradients_are_the_float32_computation_rounded(dtype, make):
    """16-bit gradients keep float32 error feedback and compute in float32: every result is
    the float32 run's (on the same, 16-bit-valued, gradients) rounded to the 16-bit type,
    within one unit in the last place of that type (plus 1e-6 absolute for the smallest
    entries), step after step."""
    half = run_steps(2, make, steps=3, dtype=dtype)
    full = run_steps(2, make, steps=3, grads=lambda rank, step: {n: g.float() for n, g in
                                                                   grads_for(rank, step, dtype).items()})
    ulp = torch.finfo(dtype).eps
    for rank in range(2):
        assert half[rank][1].engine.layers["fc.weight"].residual.dtype == torch.float32
        for step in range(3):
            for name, out in half[rank][0][step].items():
                assert out.dtype == dtype, name
                torch.testing.assert_close(out.float(), full[rank][0][step][name], rtol=ulp, atol=1e-6,
                                           msg=lambda m: f"rank {rank} step {step} {name}: {m}")


def test_powersgd_level_change_keeps_q_columns_and_is_rank_independent():
    codec = acc.PowerSGD(rank=1, critical_rank=4)
    grad = torch.randn(40, 64)
    a, b = codec.init_state("w", grad), codec.init_state("w", grad)
    a.q.add_(1.0)  # pretend training moved Q
    before = a.q.clone()
    codec.set_level(a, acc.levels.CRITICAL)
    codec.set_level(b, acc.levels.CRITICAL)
    assert a.q.shape == (64, 4) and a.rank == 4
    assert torch.equal(a.q[:, :1], before)
    assert torch.equal(a.q[:, 1:], b.q[:, 1:])  # fresh columns depend only on (seed, name, column)
    codec.set_level(a, acc.levels.NORMAL)
    assert torch.equal(a.q, before)


def test_the_class_itself_works_as_horovod_compression():
    cls = acc.AccordionCompressor
    assert cls.default_instance() is cls.default_instance()
    assert repr(cls.default_instance()) == "AccordionCompressor(Quantize(bits=8, critical_bits=8, skip_energy=0.05), policy=LinkGate(Static(), pays=1.05), interval=100)"
    with pytest.raises(RuntimeError, match="must be called by horovod.torch.DistributedOptimizer"):
        cls.compress(torch.randn(4, 4))


@pytest.mark.parametrize("call,message", [
    (lambda: acc.PowerSGD(rank=0), "rank must be positive, got 0"),
    (lambda: acc.PowerSGD(rank=1.5), "rank must be an int, got float"),
    (lambda: acc.PowerSGD(rank=2, critical_rank=-1), "critical_rank must be positive"),
    (lambda: acc.TopK(ratio=0), r"ratio must be in \(0, 1.0\], got 0"),
    (lambda: acc.TopK(ratio=1.5), r"ratio must be in \(0, 1.0\], got 1.5"),
    (lambda: acc.TopK(ratio="0.1"), "ratio must be a number, got str"),
    (lambda: acc.AccordionCompressor("powersgd"), "codec must be acc.PowerSGD"),
    (lambda: acc.AccordionCompressor(eta=-0.5), "eta must be positive"),
    (lambda: acc.AccordionCompressor(interval=0), "interval must be positive"),
])
def test_bad_arguments_are_named(call, message):
    with pytest.raises((TypeError, ValueError), match=message):
        call()


@pytest.mark.parametrize("make_codec", [lambda: acc.PowerSGD(rank=2), lambda: acc.TopK(ratio=0.05)],
                         ids=["powersgd", "topk"])
@pytest.mark.parametrize("tensor", [torch.zeros(0, 5), torch.zeros(7, 0, 3), torch.ones(40, 64, dtype=torch.int64),
                                    torch.ones(40, 64, dtype=torch.complex64)],
                         ids=["empty", "empty-3d", "integer", "complex"])
def test_empty_integer_and_complex_gradients_pass_through_uncompressed(make_codec, tensor):
    comp = acc.AccordionCompressor(make_codec(), channel=SimulatedWorld(1).channel(0))
    sent, ctx = comp.compress_named("w", tensor)
    assert sent is tensor
    assert comp.decompress(sent, ctx) is tensor
    assert comp.stats()["layers"]["w"]["level"] == "dense"


def test_it_is_a_horovod_compressor():
    """Code that checks for a Horovod Compressor accepts ours, the instance and the class."""
    compression = pytest.importorskip("horovod.torch.compression")
    assert isinstance(acc.AccordionCompressor(), compression.Compressor)
    assert issubclass(acc.AccordionCompressor, compression.Compressor)
    # compress/decompress are ours, bound to the instance (not Horovod's static no-ops)
    comp = acc.AccordionCompressor()
    assert comp.compress.__self__ is comp and comp.decompress.__self__ is comp


def test_loading_without_error_feedback_keeps_everything_else():
    """What resuming with another number of ranks uses: levels, warm-start Q, controller and
    counters come back; the error feedback starts from zero."""
    history, comp = run_steps(1, lambda: acc.PowerSGD(rank=2, critical_rank=4), steps=3)[0]
    state = comp.state_dict()
    assert any(layer["residual"].abs().sum() > 0 for layer in state["layers"].values())
    fresh = acc.AccordionCompressor(acc.PowerSGD(rank=2, critical_rank=4), channel=SimulatedWorld(1).channel(0))
    fresh.load_state_dict(state, error_feedback=False)
    again = fresh.state_dict()
    assert again["steps"] == state["steps"] == 3
    for key in ("levels", "window_steps", "windows", "policy"):
        assert again["controller"][key] == state["controller"][key], key
    for name, total in state["controller"]["sums"].items():
        assert torch.equal(again["controller"]["sums"][name], total), name
    for name, layer in state["layers"].items():
        assert torch.equal(again["layers"][name]["qt"], layer["qt"]) and again["layers"][name]["level"] == layer["level"]
        assert not again["layers"][name]["residual"].any(), name


# --- the codec protocol (accordion_hvd/codecs/base.py) and the exchange registry --------------
def test_a_codec_missing_part_of_the_protocol_is_refused_naming_what_it_lacks():
    class Half(acc.codecs.Codec):
        levels = (acc.levels.NORMAL,)

        def compressible(self, shape):
            return True

    with pytest.raises(TypeError, match="Half lacks init_state, set_level, floats_sent, wire, state_to_dict, "
                                        "state_from_dict, config"):
        acc.AccordionCompressor(Half())


def test_a_codec_of_the_protocol_without_a_registered_exchange_is_refused_at_construction():
    class Unpaired(acc.codecs.Codec):  # every method of the protocol filled in
        levels, adaptive = (acc.levels.NORMAL,), False

        def compressible(self, shape): return True
        def init_state(self, name, grad, level): return None
        def set_level(self, state, level): pass
        def floats_sent(self, state): return 0
        def wire(self, shape, level, itemsize=4): return ()
        def state_to_dict(self, state): return {}
        def state_from_dict(self, name, d): return None
        def config(self): return {"codec": "unpaired"}

    with pytest.raises(TypeError, match="no exchange is registered for codec Unpaired"):
        acc.AccordionCompressor(Unpaired(), policy="static")


def test_an_exchange_outside_the_written_contract_is_refused_at_registration():
    from accordion_hvd.exchange import register

    class Loose:  # the four calls, but not an Exchange
        def add(self, name, state, grad, finite): return None
        def results(self, choice=None): return {}
        def end_step(self, skipped): pass
        def abort(self): pass

    with pytest.raises(TypeError, match="Loose must subclass accordion_hvd.exchange.Exchange"):
        register(acc.codecs.Codec, Loose)


def test_a_subclass_of_a_codec_is_carried_by_its_bases_exchange():
    from accordion_hvd.exchange import PowerSGDExchange, exchange_for

    class Mine(acc.PowerSGD):
        pass

    assert exchange_for(Mine(rank=2)) is PowerSGDExchange
    assert isinstance(acc.AccordionCompressor(Mine(rank=2)).codec, Mine)
