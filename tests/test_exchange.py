"""The exchange engine's first round (accordion_hvd/exchange/buckets.py) on the simulated world."""

import pytest
import torch

from accordion_hvd.comm.channel import Channel
from accordion_hvd.comm.simulated import SimulatedWorld
from accordion_hvd.exchange import Round1, bytes_of, plan_buckets, split_bytes

SHAPES = {f"l{i}": (8, 4 * (i + 1)) for i in range(6)}  # 128 .. 768 bytes of float32 gradient


class Counting(Channel):
    """A channel that counts the collectives issued through it."""

    def __init__(self, channel):
        self.inner, self.issued = channel, 0
        self.rank, self.size, self.timeout = channel.rank, channel.size, channel.timeout

    def allreduce_mean_async(self, tensors, name):
        self.issued += 1
        return self.inner.allreduce_mean_async(tensors, name)

    def allgather_async(self, tensor, name):
        self.issued += 1
        return self.inner.allgather_async(tensor, name)

    def wait(self, handle):
        return self.inner.wait(handle)


def test_plan_buckets_cuts_like_ddp():
    nbytes = {"a": 600, "b": 600, "c": 300, "d": 900, "e": 100}
    assert plan_buckets(list(nbytes), nbytes, first_cap=500, cap=1000) == [("a",), ("b", "c", "d"), ("e",)]
    assert plan_buckets(["a"], {"a": 1}, first_cap=500, cap=1000) == [("a",)]
    # the last bucket's last layers, up to first_cap bytes of them, go in a bucket of their own
    nbytes = {"a": 600, "b": 800, "c": 300, "d": 200, "e": 100}
    assert plan_buckets(list(nbytes), nbytes, first_cap=500, cap=2000) == [("a",), ("b", "c"), ("d", "e")]
    nbytes["e"] = 501  # the very last layer alone is more than that: nothing to split off
    assert plan_buckets(list(nbytes), nbytes, first_cap=500, cap=2000) == [("a",), ("b", "c", "d", "e")]
    assert plan_buckets(["a", "b"], {"a": 10, "b": 10}, first_cap=500, cap=2000) == [("a", "b")]  # one small bucket
    assert plan_buckets([], {}) == []


def grads(rank, step):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def test_buckets_pair_whatever_each_ranks_order_and_issue_one_collective_each():
    def worker(rank, channel):
        counting = Counting(channel)
        round1 = Round1(counting, "allreduce", "acc.P", first_cap=256, cap=1024)
        per_step = []
        for step in range(4):
            before = counting.issued
            g = grads(rank, step)
            order = [list(SHAPES), list(reversed(SHAPES)), ["l3", "l0", "l5", "l1", "l4", "l2"]][rank]
            for name in order:
                round1.ready(name, [g[name]], g[name])
            out = round1.results()
            per_step.append(counting.issued - before)
            everyone = [grads(r, step) for r in range(channel.size)]
            for name in SHAPES:
                expected = torch.stack([e[name] for e in everyone]).sum(0) / channel.size
                assert torch.allclose(out[name][0], expected, atol=1e-6), (rank, step, name)
        return [b.names for b in round1.buckets], per_step
    results = SimulatedWorld(3).run(worker)
    layouts = [layout for layout, _ in results]
    assert layouts[0] == layouts[1] == layouts[2]
    assert [n for b in layouts[0] for n in b] == list(SHAPES)  # rank 0's ready order
    assert len(layouts[0]) > 1
    for _, per_step in results:  # the first step also agrees on the layout (two allgathers)
        assert per_step[0] == len(layouts[0]) + 2 and per_step[1:] == [len(layouts[0])] * 3, per_step


def test_a_layer_only_one_rank_has_is_named_on_every_rank():
    def worker(rank, channel):
        round1 = Round1(channel, "allreduce", "acc.P")
        names = list(SHAPES) if rank == 0 else list(SHAPES)[1:]
        for name in names:
            g = torch.ones(SHAPES[name])
            round1.ready(name, [g], g)
        try:
            round1.results()
        except ValueError as exc:
            return str(exc)
    messages = SimulatedWorld(2).run(worker)
    assert messages[0] == messages[1]
    assert messages[0].startswith("AccordionCompressor: ranks compress different layers")
    assert "'l0': shape [8, 4] on rank 0 vs not compressed on rank 1" in messages[0]


def test_a_step_with_other_layers_agrees_again_if_nothing_was_sent():
    def worker(rank, channel):
        round1 = Round1(channel, "allreduce", "acc.P", first_cap=1, cap=1)  # one layer a bucket
        for step, names in enumerate([["l0", "l1"], ["l1"], ["l2", "l0"]]):
            for name in names:
                g = torch.full(SHAPES[name], float(rank + step))
                round1.ready(name, [g], g)
            out = round1.results()
            assert sorted(out) == sorted(names)
        return [b.names for b in round1.buckets]
    assert SimulatedWorld(2).run(worker) == [[("l2",), ("l0",)]] * 2


def test_a_bucket_at_a_dense_level_issues_nothing_and_allgather_rows_are_per_rank():
    def worker(rank, channel):
        counting = Counting(channel)
        round1 = Round1(counting, "allgather", "acc.topk", first_cap=1, cap=1)
        values, indices = torch.tensor([float(rank), 2.0]), torch.tensor([rank, 5], dtype=torch.int32)
        for step in range(2):
            before = counting.issued
            round1.ready("l0", bytes_of(values, indices), torch.zeros(8))
            round1.ready("l1", None, torch.zeros(8))  # dense this step: not in round 1
            out = round1.results()
            assert "l1" not in out
            got_values, got_indices = split_bytes(out["l0"], torch.float32, 2)
            assert got_values.tolist() == [v for r in range(channel.size) for v in (float(r), 2.0)]
            assert got_indices.tolist() == [v for r in range(channel.size) for v in (r, 5)]
            if step:
                assert counting.issued - before == 1
        return True
    assert SimulatedWorld(2).run(worker) == [True, True]


def test_round1_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="kind must be 'allreduce' or 'allgather'"):
        Round1(None, "broadcast", "x")


class Eager(Counting):
    """A channel that reports every collective as arrived, and logs issues: the exchange then
    starts each bucket's Q round as soon as its P round is issued, while layers still come."""

    def __init__(self, channel, log):
        super().__init__(channel)
        self.log = log

    def allreduce_mean_async(self, tensors, name):
        self.log.append(("issue", name))
        return super().allreduce_mean_async(tensors, name)

    def test(self, handle):
        return True


def run_powersgd_steps(rank, channel, steps=3):
    """Three steps of PowerSGDExchange on SHAPES, one layer per bucket; returns the results."""
    import accordion_hvd as acc
    from accordion_hvd.exchange import PowerSGDExchange

    codec = acc.PowerSGD(rank=2)
    exchange = PowerSGDExchange(codec, channel, first_cap=1, cap=1)
    states, out = {}, []
    for step in range(steps):
        g = grads(rank, step)
        for name in reversed(SHAPES) if rank else SHAPES:  # another hook order on rank 1
            states.setdefault(name, codec.init_state(name, g[name]))
            exchange.add(name, states[name], g[name].clone(), torch.tensor(True))
            if hasattr(channel, "log"):
                channel.log.append(("added", name))
        out.append({n: t.clone() for n, t in exchange.results().items()})
        exchange.end_step(skipped=torch.tensor(False))
    return out


def test_powersgd_starts_q_rounds_during_backward_and_gets_the_same_results():
    plain = SimulatedWorld(2).run(run_powersgd_steps)
    logs = [[], []]
    eager = SimulatedWorld(2).run(lambda rank, channel: run_powersgd_steps(rank, Eager(channel, logs[rank])))
    for a, b in zip(plain, eager):
        for step_a, step_b in zip(a, b):
            assert step_a.keys() == step_b.keys() == set(SHAPES)
            for n in SHAPES:
                assert torch.equal(step_a[n], step_b[n]), n
    assert torch.allclose(plain[0][-1]["l0"], plain[1][-1]["l0"])  # every rank the same average
    # From the second step on (the layout is agreed at the end of the first), Q rounds are
    # issued before the step's last layer is added, and a step issues 2 per bucket.
    starts = [i for i, e in enumerate(logs[0]) if e == ("added", "l0")]  # rank 0 adds l0 first
    step2 = logs[0][starts[1]:starts[2]]
    last_added = step2.index(("added", "l5"))
    q_before_last = [e for e in step2[:last_added] if e[0] == "issue" and e[1].startswith("acc.Q.")]
    assert len(q_before_last) == len(SHAPES) - 1, step2
    assert sum(1 for e in step2 if e[0] == "issue") == 2 * len(SHAPES), step2


@pytest.mark.parametrize("cap", [1, 1 << 30], ids=["a-bucket-per-layer", "one-bucket"])
def test_powersgd_writes_a_result_into_another_buffer_when_asked_and_refuses_a_wrong_one(cap):
    """``write_into`` (the DDP front end's bucket view): the result lands in the new buffer,
    equal to what the gradient's own buffer would have got, whatever the buffer held (NaN
    here: it is never read) and whatever the buckets; a buffer of another shape is refused
    naming the layer; a layer the exchange does not hold is reported, not changed."""
    import accordion_hvd as acc
    from accordion_hvd.exchange import PowerSGDExchange

    def worker(rank, channel):
        codec = acc.PowerSGD(rank=2)
        exchange = PowerSGDExchange(codec, channel, first_cap=cap, cap=cap)
        g = grads(rank, 0)
        states = {n: codec.init_state(n, g[n]) for n in SHAPES}
        targets = {}
        for name in SHAPES:
            exchange.add(name, states[name], g[name].clone(), torch.tensor(True))
            if name == "l1":
                with pytest.raises(ValueError, match="'l1' has a gradient of"):
                    exchange.write_into(name, torch.empty(3))
                targets[name] = torch.full_like(g[name], float("nan"))  # never read
                assert exchange.write_into(name, targets[name])
        assert not exchange.write_into("not-a-layer", torch.empty(3))
        out = exchange.results()
        return out["l1"].data_ptr() == targets["l1"].data_ptr(), out["l1"].clone()

    moved = SimulatedWorld(2).run(worker)
    plain = SimulatedWorld(2).run(lambda rank, channel: run_powersgd_steps(rank, channel, steps=1))
    for (same_buffer, result), reference in zip(moved, plain):
        assert same_buffer
        assert torch.equal(result, reference[0]["l1"])
