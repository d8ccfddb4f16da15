"""The Horovod Elastic handler's parts that need no cluster: what ``sync`` shares and keeps,
and ``abort_step`` + ``load_state_dict`` after an interrupted step. (Workers failing and
joining under horovodrun --min-np/--max-np on the emulated cluster: benchmarks/reliability.py.)"""

import pickle

import torch

import accordion_hvd as acc
from accordion_hvd.comm import SimulatedWorld
from accordion_hvd.elastic import merge, shared_part

SHAPES = {"w": (64, 48), "v": (32, 40), "b": (64,)}


def trained(rank, steps=3, world=2):
    """Rank ``rank``'s compressor of a 2-rank simulated run (Accordion, switching levels)."""
    def worker(r, channel):
        comp = acc.AccordionCompressor(acc.PowerSGD(1, critical_rank=4), interval=2, channel=channel)
        for t in range(steps):
            gen = torch.Generator().manual_seed(100 * t + r)
            sent = {n: comp.compress_named(n, torch.randn(s, generator=gen)) for n, s in SHAPES.items()}
            for n, (out, ctx) in sent.items():
                comp.decompress(channel.wait(channel.allreduce_mean_async([out], f"hvd.{n}"))[0], ctx)
        return comp
    return SimulatedWorld(world).run(worker)[rank]


def fresh():
    return acc.AccordionCompressor(acc.PowerSGD(1, critical_rank=4), interval=2,
                                   channel=SimulatedWorld(1).channel(0))


def test_sync_takes_shared_state_from_rank_0_and_keeps_local_error_feedback():
    rank0, rank1 = trained(0), trained(1)
    shared = shared_part(rank0.state_dict())
    assert len(pickle.dumps(shared)) < 20_000  # no gradient-sized tensor goes over the wire
    mine = rank1.state_dict()
    rank1.load_state_dict(merge(shared, mine))
    after = rank1.state_dict()
    for n in ("w", "v"):
        assert torch.equal(after["layers"][n]["residual"], mine["layers"][n]["residual"])
        assert torch.equal(after["layers"][n]["qt"], rank0.state_dict()["layers"][n]["qt"])
        assert torch.equal(after["controller"]["sums"][n], mine["controller"]["sums"][n])
    assert after["controller"]["levels"] == rank0.state_dict()["controller"]["levels"]
    assert after["steps"] == rank0.steps


def test_a_worker_that_joins_starts_its_error_feedback_at_zero():
    rank0, joined = trained(0), fresh()
    joined.load_state_dict(merge(shared_part(rank0.state_dict()), joined.state_dict()))
    state = joined.state_dict()
    assert set(state["layers"]) == {"w", "v"}
    for n in ("w", "v"):
        assert torch.count_nonzero(state["layers"][n]["residual"]) == 0
        assert torch.equal(state["layers"][n]["qt"], rank0.state_dict()["layers"][n]["qt"])
    assert joined.steps == rank0.steps and joined.controller.levels == rank0.controller.levels


def test_an_interrupted_step_is_dropped_and_the_commit_restored():
    comp = fresh()
    gen = torch.Generator().manual_seed(0)
    for n, s in SHAPES.items():
        out, ctx = comp.compress_named(n, torch.randn(s, generator=gen))
        comp.decompress(out, ctx)
    committed = comp.state_dict()
    comp.compress_named("w", torch.randn(64, 48, generator=gen))  # the step a failure interrupts
    comp.abort_step()
    comp.load_state_dict(committed)
    again = comp.state_dict()
    assert torch.equal(again["layers"]["w"]["residual"], committed["layers"]["w"]["residual"])
    out, ctx = comp.compress_named("w", torch.randn(64, 48, generator=gen))  # and steps go on
    assert comp.decompress(out, ctx).shape == (64, 48)
