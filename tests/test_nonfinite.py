"""Non-finite gradients: a NaN or Inf on one rank skips the step on every rank alike, and no
error-feedback buffer is ever poisoned (simulated channel; the horovodrun counterpart is in
test_reliability_horovod.py)."""

import math

import pytest
import torch

import accordion_hvd as acc
from accordion_hvd.comm import SimulatedWorld
from channels import Forwarding

SHAPES = {"conv.weight": (16, 8, 3, 3), "fc.weight": (40, 64), "fc.bias": (40,)}
COMPRESSED = ("conv.weight", "fc.weight")
WORLD, STEPS, FAULT_STEP, FAULT_RANK = 3, 5, 2, 1

CODECS = {
    "powersgd": lambda: acc.AccordionCompressor(acc.PowerSGD(rank=2), policy="static"),
    "topk": lambda: acc.AccordionCompressor(acc.TopK(ratio=0.05), policy="static"),
    # the first window is critical: 99% keeps so much that the layers go dense through Horovod
    "topk-dense-level": lambda: acc.AccordionCompressor(acc.TopK(ratio=0.05, critical_ratio=0.99), interval=100),
    "gravac": lambda: acc.AccordionCompressor(acc.TopK(ratio=0.05), policy=acc.policies.GraVAC(window=2)),
}


def clean_grads(rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def faulty_grads(rank, step, layer, value):
    grads = clean_grads(rank, step)
    if rank == FAULT_RANK and step == FAULT_STEP:
        grads[layer].view(-1)[7] = value
    return grads


def run(make, layer, value):
    """Every rank runs STEPS steps; rank FAULT_RANK's gradient of ``layer`` has one entry
    ``value`` at step FAULT_STEP. Returns per rank (results per step, skipped flags, comp)."""
    def worker(rank, channel):
        comp = make()
        comp.engine.use_planes(channel)
        history, skipped = [], []
        for step in range(STEPS):
            grads = faulty_grads(rank, step, layer, value)
            sent = {n: comp.compress_named(n, grads[n]) for n in grads}
            reduced = {n: channel.wait(channel.allreduce_mean_async([sent[n][0]], f"hvd.{n}"))[0] for n in sorted(sent)}
            history.append({n: comp.decompress(reduced[n].clone(), sent[n][1]) for n in sorted(sent)})
            skipped.append(comp.step_skipped)
        return history, skipped, comp
    return SimulatedWorld(WORLD).run(worker)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("layer", ["fc.weight", "fc.bias"], ids=["compressed-layer", "dense-layer"])
@pytest.mark.parametrize("codec", CODECS)
def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank(codec, layer, value):
    out = run(CODECS[codec], layer, value)
    for rank, (history, skipped, comp) in enumerate(out):
        assert skipped == [step == FAULT_STEP for step in range(STEPS)], rank
        assert comp.skipped_steps == 1 and comp.stats()["skipped_steps"] == 1
        for name, result in history[FAULT_STEP].items():
            assert torch.count_nonzero(result) == 0, (rank, name)
        for step in range(STEPS):  # every rank the same result, every result finite
            for name, result in history[step].items():
                assert torch.isfinite(result).all(), (rank, step, name)
                assert torch.equal(result, out[0][0][step][name]), (rank, step, name)
        for name, state in comp.engine.layers.items():
            assert torch.isfinite(state.residual).all(), (rank, name)


@pytest.mark.parametrize("layer", ["fc.weight", "fc.bias"], ids=["compressed-layer", "dense-layer"])
@pytest.mark.parametrize("codec", CODECS)
def test_the_skipped_steps_gradient_stays_in_error_feedback(codec, layer):
    """sum_t result_t + mean_i(e_i) == sum_t mean_i(g_i,t) over the gradients that were
    finite: the skipped step's gradients are carried, not lost, and the faulty one is dropped
    (its rank's e was not touched by it). Fails if e is poisoned, reset or left half-updated."""
    out = run(CODECS[codec], layer, float("nan"))
    for name in COMPRESSED:
        applied = sum(out[0][0][t][name].double() for t in range(STEPS))
        mean_residual = sum(comp.engine.layers[name].residual.double().reshape(SHAPES[name]) for _, _, comp in out) / WORLD
        total = torch.zeros(SHAPES[name], dtype=torch.float64)
        for t in range(STEPS):
            for r in range(WORLD):
                g = faulty_grads(r, t, layer, float("nan"))[name].double()
                total += g if torch.isfinite(g).all() else 0
        torch.testing.assert_close(applied + mean_residual, total / WORLD, rtol=1e-5, atol=1e-5)


def test_the_dense_level_case_does_go_dense():
    _, _, comp = run(CODECS["topk-dense-level"], "fc.weight", float("nan"))[0]
    assert comp.stats()["floats_sent"] == comp.stats()["floats_dense"]


def test_gravac_never_sees_the_non_finite_gains():
    """GraVAC's inputs of a skipped step are not finite: they must not reach its state."""
    for _, _, comp in run(CODECS["gravac"], "fc.weight", float("nan")):
        state = comp.policy.state_dict()
        numbers = [state["candidate"], state["window_seconds"], *state["gains"].values()]
        assert all(v is None or not math.isnan(float(v)) for v in numbers), state


def test_the_skip_is_checkpointed():
    _, _, comp = run(CODECS["topk"], "fc.weight", float("nan"))[0]
    fresh = CODECS["topk"]()
    fresh.load_state_dict(comp.state_dict())
    assert fresh.skipped_steps == 1


class CorruptIndices(Forwarding):
    """The simulated channel, except that at step ``at`` the TopK allgather's last index (the
    last layer's, in every rank's row) arrives outside its layer, as corrupted data would."""

    def __init__(self, channel, at: int) -> None:
        super().__init__(channel)
        self.at, self.step = at, 0

    def wait(self, handle):
        out = self.inner.wait(handle)
        if self.step == self.at and handle[0] == "allgather" and handle[2].startswith("acc.topk"):
            rows = out.view(self.inner.size, -1)
            rows[:, -4:] = torch.tensor([2**31 - 1], dtype=torch.int32).view(torch.uint8)
        return out


def test_topk_indices_outside_their_layer_skip_the_step_and_stop_every_rank():
    """Corrupted indices never write outside a layer: the step is skipped (results zero,
    error feedback kept) and every rank raises, naming the layers, when the step's outcome is
    read (at its end on the CPU)."""
    def worker(rank, channel):
        comp = CODECS["topk"]()
        comp.engine.use_planes(wrapped := CorruptIndices(channel, at=FAULT_STEP))
        for step in range(STEPS):
            wrapped.step = step
            grads = clean_grads(rank, step)
            e_before = {n: s.residual.clone() for n, s in comp.engine.layers.items()}
            try:
                sent = {n: comp.compress_named(n, grads[n]) for n in grads}
                for n in sorted(sent):
                    reduced = channel.wait(channel.allreduce_mean_async([sent[n][0]], f"hvd.{n}"))[0]
                    comp.decompress(reduced.clone(), sent[n][1])
            except RuntimeError as exc:
                kept = all(torch.equal(comp.engine.layers[n].residual, e_before[n] + grads[n].reshape(-1))
                           for n in e_before)
                return step, str(exc), kept
        return None
    for result in SimulatedWorld(WORLD).run(worker):
        assert result is not None, "no rank stopped"
        step, message, kept = result
        assert step == FAULT_STEP and "TopK indices outside their layer" in message and "fc.weight" in message
        assert kept  # the skipped step's gradient went into the error feedback, nothing lost
