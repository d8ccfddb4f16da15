"""``acc.SyncInterval`` (accordion_hvd/periodic/interval.py), the interval rule of
``DiLoCo(sync_every="auto")``, on its own: the ladder climbed while calm, the first rung in a
critical window, checked arguments, its state. (Under torchrun, step by step against a plain
DiLoCo: tests/test_diloco.py's "auto".)"""

import math

import pytest

import accordion_hvd as acc
from accordion_hvd.periodic import IntervalReport


def window(norm, decreased=False, step_s=None, round_s=None):
    return IntervalReport(norm=norm, steps=64, lr_decreased=decreased, step_s=step_s, round_s=round_s)


def test_the_ladder_is_climbed_while_calm_and_left_at_once_when_critical():
    policy = acc.SyncInterval()
    assert policy.interval == 1 and policy.window == 64
    got = [policy.end_window(window(n)) for n in (10.0, 9.0, 8.5, 8.0, 7.9, 7.8)]
    assert got == [1, 4, 16, 64, 64, 64]  # the first window has nothing to compare with: critical
    assert policy.end_window(window(3.0)) == 1  # moved by more than eta = 0.5
    assert policy.end_window(window(2.9)) == 4
    assert policy.end_window(window(2.9, decreased=True)) == 1  # a learning-rate decay


def test_a_non_finite_norm_goes_to_the_first_rung_and_keeps_the_reference_norm():
    policy = acc.SyncInterval((1, 8))
    for n in (5.0, 5.0):
        policy.end_window(window(n))
    assert policy.interval == 8
    assert policy.end_window(window(math.nan)) == 1
    assert policy.end_window(window(5.1)) == 8  # compared with 5.0, not with NaN


def test_the_floor_is_the_first_rung_whose_rounds_cost_at_most_the_overhead_of_a_step():
    policy = acc.SyncInterval(overhead=0.1)
    # a round as long as 1/3 of a step: 0.1 / 1 > 0.03, 0.1 / 4 <= 0.03: the floor is 4
    assert policy.end_window(window(5.0, step_s=0.3, round_s=0.1)) == 4 and policy.floor == 4
    assert policy.end_window(window(5.0, step_s=0.3, round_s=0.1)) == 16  # calm: up from 4
    assert policy.end_window(window(1.0, step_s=0.3, round_s=0.1)) == 4  # critical: down to the floor, not to 1
    assert policy.end_window(window(1.0, step_s=0.3)) == 16 and policy.floor == 4  # no round timed: floor kept
    # a slow link: a round of 10 steps' time fits no rung's budget: the top rung, even when critical
    assert policy.end_window(window(1.0, decreased=True, step_s=0.3, round_s=3.0)) == 64
    # a fast one: the first rung again
    assert policy.end_window(window(1.0, decreased=True, step_s=0.3, round_s=0.01)) == 1
    free = acc.SyncInterval()  # the default: no link term (the rule evidence-v3 measured)
    assert free.overhead is None and free.end_window(window(1.0, step_s=0.3, round_s=3.0)) == 1


def test_the_ceiling_keeps_calm_windows_at_the_first_rung_the_link_affords():
    policy = acc.SyncInterval(budget=0.1)
    # a round of a third of a step: 0.1 / 4 <= 0.03 (the budget): calm climbs to 4 and stays
    got = [policy.end_window(window(5.0, step_s=0.3, round_s=0.1)) for _ in range(4)]
    assert got == [1, 4, 4, 4]
    assert policy.end_window(window(1.0, step_s=0.3, round_s=0.1)) == 1  # critical: the floor, as without it
    assert policy.end_window(window(1.0, step_s=0.3)) == 4  # no round timed: no ceiling this window, one rung up
    assert policy.end_window(window(1.0, step_s=0.3)) == 16
    # the link got faster: a calm window above the ceiling comes down to it
    assert policy.end_window(window(1.0, step_s=0.3, round_s=0.01)) == 1
    # a slow link: no rung within the budget, the top rung is the ceiling: the ladder as without one
    slow = acc.SyncInterval(budget=0.1)
    assert [slow.end_window(window(5.0, step_s=0.3, round_s=3.0)) for _ in range(5)] == [1, 4, 16, 64, 64]
    assert acc.SyncInterval().budget is None  # the default: no ceiling (what evidence-v3 and -v4 score)


def test_with_both_link_terms_the_floor_wins_over_the_ceiling():
    policy = acc.SyncInterval(overhead=0.01, budget=0.1)
    # round 0.1 s, step 0.3 s: overhead 0.01 -> 0.1 / r <= 0.003 needs r >= 34: 64; budget 0.1 -> 4
    assert policy.end_window(window(5.0, step_s=0.3, round_s=0.1)) == 64
    assert policy.end_window(window(5.0, step_s=0.3, round_s=0.1)) == 64  # calm: min(up, 4) but never below the floor


def test_a_non_positive_overhead_or_budget_is_refused_naming_it():
    with pytest.raises(ValueError, match="overhead"):
        acc.SyncInterval(overhead=0)
    with pytest.raises(ValueError, match="budget"):
        acc.SyncInterval(budget=-1)


@pytest.mark.parametrize("ladder", [(), (0, 4), (4, 1), (1, 3, 4), (1, 1, 4), (1, 2.5), "auto", (True, 2)])
def test_a_bad_ladder_is_refused_naming_it(ladder):
    with pytest.raises(ValueError, match="ladder must be increasing positive integers"):
        acc.SyncInterval(ladder)


def test_state_round_trips_and_a_foreign_ladder_is_refused():
    policy = acc.SyncInterval((1, 2, 4))
    for n in (3.0, 3.0, 3.0):
        policy.end_window(window(n))
    again = acc.SyncInterval((1, 2, 4))
    again.load_state_dict(policy.state_dict())
    assert again.end_window(window(3.0)) == policy.end_window(window(3.0)) == 4
    other = acc.SyncInterval((1, 8))
    with pytest.raises(ValueError, match="not on this ladder"):
        other.load_state_dict(policy.state_dict())
