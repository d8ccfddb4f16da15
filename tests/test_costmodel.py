"""The step-time cost model (accordion_hvd/costmodel.py): collectives, the alpha-beta fit,
the two-resource simulation of a step, and bad input."""

from __future__ import annotations

import math
import random

import pytest

from accordion_hvd.costmodel import Bucket, Link, LinkFit, Round, coefficients, step_s

MBIT = 1e6


def test_ring_collectives_follow_the_alpha_beta_model():
    link = Link(alpha=1e-4, beta=8 / (100 * MBIT))
    # 4 ranks, 1 MB allreduce: 6 messages, 2 * 3/4 MB each way
    assert link.collective_s("allreduce", 1e6, 4) == pytest.approx(6e-4 + 1.5e6 * 8e-8)
    assert link.collective_s("allgather", 1e6, 4) == pytest.approx(3e-4 + 3e6 * 8e-8)
    assert link.collective_s("allreduce", 1e6, 1) == 0.0  # one rank moves nothing
    # the ring's bandwidth term tends to 2n as the world grows
    assert coefficients("allreduce", 1.0, 256)[1] == pytest.approx(2 * 255 / 256)
    assert Link.from_rate(1e9, 5e-5) == Link(alpha=5e-5, beta=8e-9)


def test_the_fit_recovers_alpha_and_beta_from_noisy_timings():
    truth, rng, fit = Link(alpha=2e-4, beta=8e-8), random.Random(0), LinkFit()
    for _ in range(200):
        kind, n, p = rng.choice(["allreduce", "allgather"]), 10 ** rng.uniform(2, 6.5), rng.choice([2, 3, 4])
        assert fit.observe(kind, n, p, truth.collective_s(kind, n, p) * rng.uniform(0.95, 1.05)) is None
    got = fit.link()
    assert got.alpha == pytest.approx(truth.alpha, rel=0.1)
    assert got.beta == pytest.approx(truth.beta, rel=0.05)


def test_ranks_that_sum_their_stats_fit_the_same_link_as_one_fit_of_everything():
    truth, whole, parts = Link(alpha=1e-4, beta=1e-8), LinkFit(), [LinkFit(), LinkFit()]
    for i, n in enumerate([1e3, 1e5, 1e6, 3e6]):
        for fit in (whole, parts[i % 2]):
            fit.observe("allreduce", n, 2, truth.collective_s("allreduce", n, 2))
    summed = LinkFit.from_stats([a + b for a, b in zip(parts[0].stats(), parts[1].stats())])
    assert (summed.link().alpha, summed.link().beta) == pytest.approx((whole.link().alpha, whole.link().beta))
    assert (summed.link().alpha, summed.link().beta) == pytest.approx((truth.alpha, truth.beta))


def test_one_size_or_a_zero_bandwidth_determines_no_link():
    fit = LinkFit()
    assert fit.link() is None
    for _ in range(5):
        fit.observe("allreduce", 1e6, 2, 0.1)
    assert fit.link() is None  # latency and bandwidth are not separable from one size
    flat = LinkFit()
    for n in (1e3, 1e6):
        flat.observe("allreduce", n, 2, 0.0)
    assert flat.link() is None  # infinitely fast: not a link


@pytest.mark.parametrize("seconds", [-1.0, math.nan, math.inf])
def test_a_bad_timing_is_refused_and_changes_nothing(seconds):
    fit = LinkFit()
    fit.observe("allreduce", 1e3, 2, 0.01)
    before = fit.stats()
    assert "seconds" in fit.observe("allreduce", 1e6, 2, seconds)
    assert "world" in fit.observe("allreduce", 1e6, 0, 0.01)
    assert "kind" in fit.observe("broadcast", 1e6, 2, 0.01)
    assert fit.stats() == before


def test_without_communication_a_step_is_its_compute_and_kernels():
    buckets = [Bucket(0.2, [Round("allreduce", 1e6, prepare_s=0.01)], finish_s=0.02),
               Bucket(0.5, [Round("allreduce", 1e6, prepare_s=0.03)], finish_s=0.04)]
    assert step_s(0.3, 0.6, buckets, Link(0, 0), 2, optimizer_s=0.05) == pytest.approx(
        0.3 + 0.6 + 0.01 + 0.03 + 0.02 + 0.04 + 0.05)


def test_communication_hides_under_backward_until_the_link_is_slow():
    bucket = Bucket(0.1, [Round("allreduce", 1e6)])  # ready early: 0.9 s of backward to hide under
    fast = step_s(0.0, 1.0, [bucket], Link.from_rate(1e9), 2)  # 8 ms on the wire
    slow = step_s(0.0, 1.0, [bucket], Link.from_rate(1e6), 2)  # 8 s
    assert fast == pytest.approx(1.0)
    assert slow == pytest.approx(0.1 + 8.0)


def test_a_second_round_is_issued_by_the_first_hook_that_finds_the_first_back():
    link = Link(alpha=0.0, beta=1e-7)  # 1 MB allreduce over 2 ranks: 0.1 s
    two_rounds = lambda ready: Bucket(ready, [Round("allreduce", 1e6), Round("allreduce", 1e6, prepare_s=0.01)])
    # bucket 0 ready at 0.1, its P on the wire 0.1-0.2; the hook of bucket 1 at 0.5 finds it
    # back, prepares (0.01) and issues bucket 0's Q (0.51-0.61); bucket 1's P waits for the
    # network (0.61-0.71); backward ends at 1.01; bucket 1's Q is prepared then (0.01) and
    # travels 1.02-1.12
    assert step_s(0.0, 1.0, [two_rounds(0.1), two_rounds(0.5)], link, 2) == pytest.approx(1.12)
    # with the first bucket late too, both Q rounds are issued by the last hook (1.01-1.11,
    # then 1.11-1.21 behind it on the wire)
    assert step_s(0.0, 1.0, [two_rounds(0.45), two_rounds(0.5)], link, 2) == pytest.approx(1.21)


def test_bad_arguments_name_what_was_expected():
    with pytest.raises(ValueError, match="ready order"):
        step_s(0, 1, [Bucket(0.5), Bucket(0.2)], Link(0, 0), 2)
    with pytest.raises(ValueError, match="after the end"):
        step_s(0, 1, [Bucket(2.0)], Link(0, 0), 2)
    with pytest.raises(ValueError, match="world"):
        step_s(0, 1, [], Link(0, 0), 0)
    with pytest.raises(ValueError, match="Link.beta"):
        Link(0.0, math.inf)
    with pytest.raises(ValueError, match="bits_per_s"):
        Link.from_rate(0)
    with pytest.raises(ValueError, match="kind"):
        Round("reduce_scatter", 10)
    with pytest.raises(ValueError, match="6 finite"):
        LinkFit.from_stats([1.0, 2.0])
