"""kvcached.shm.fairness: weighted max-min fair shares and work-conserving caps, checked against
their defining properties over generated holders (hypothesis), and on a few worked examples."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcached.shm.fairness import UNCAPPED, Claim, caps, fair_shares

claims_st = st.lists(
    st.builds(Claim, weight_milli=st.integers(1, 10_000), min_bytes=st.integers(0, 3000),
              held_bytes=st.integers(0, 3000), demand_bytes=st.integers(0, 3000)),
    max_size=8)
budget_st = st.integers(0, 12_000)


@settings(max_examples=400, deadline=None)
@given(budget_st, claims_st)
def test_shares_are_fair(budget, claims):
    shares = fair_shares(budget, claims)
    wants = [c.want for c in claims]
    floors = [min(c.min_bytes, c.want) for c in claims]
    assert len(shares) == len(claims) and all(s >= 0 for s in shares)
    assert sum(shares) <= budget
    # Nobody gets more than it wants.
    assert all(s <= w for s, w in zip(shares, wants))
    # Work conservation: the budget is spent whenever the holders want it all.
    assert sum(shares) == min(budget, sum(wants))
    if sum(floors) <= budget:
        # Minimums first.
        assert all(s >= f for s, f in zip(shares, floors))
        # Nobody with demand starves while the budget is not exhausted by minimums: each gets at
        # least its weighted slice of what the minimums leave (or what it wants).
        left, total_weight = budget - sum(floors), sum(c.weight_milli for c in claims)
        for c, s in zip(claims, shares):
            assert s >= min(c.want, left * c.weight_milli // total_weight)
    else:
        # Minimums beyond the budget are scaled down in proportion (within a rounding byte).
        for f, s in zip(floors, shares):
            assert abs(s - Fraction(f * budget, sum(floors))) < 1


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 10**12), st.integers(1, 100_000), st.integers(1, 100_000))
def test_two_holders_with_unmet_demand_split_by_weight(budget, w1, w2):
    a = Claim(w1, 0, budget, budget)       # each wants twice the budget
    b = Claim(w2, 0, 0, 2 * budget)
    s1, s2 = fair_shares(budget, [a, b])
    assert s1 + s2 == budget
    assert abs(s1 - Fraction(budget * w1, w1 + w2)) < 1
    assert abs(s2 - Fraction(budget * w2, w1 + w2)) < 1


@settings(max_examples=400, deadline=None)
@given(budget_st, claims_st)
def test_caps_bind_only_while_the_budget_is_short_and_another_holder_waits(budget, claims):
    """Uncapped while the wants fit the budget or nobody else is short; otherwise capped at no
    less than the share, and at no more than the share the holder would get if it wanted
    everything, so the caps never undo fairness."""
    shares = fair_shares(budget, claims)
    result = caps(budget, claims, shares)
    contended = sum(c.want for c in claims) > budget
    short = [c.held_bytes < s and c.demand_bytes > 0 for c, s in zip(claims, shares)]
    for i, cap in enumerate(result):
        others_short = any(short[j] for j in range(len(claims)) if j != i)
        if not (contended and others_short):
            assert cap == UNCAPPED
            continue
        assert cap >= shares[i]
        greedy = claims[:i] + [Claim(claims[i].weight_milli, claims[i].min_bytes, claims[i].held_bytes,
                                     2 * budget + claims[i].min_bytes + 1)] + claims[i + 1:]
        assert cap == max(shares[i], fair_shares(budget, greedy)[i])


def test_worked_examples():
    # 3:1 weights, both wanting everything: 75 / 25.
    assert fair_shares(100, [Claim(3000, 0, 100, 0), Claim(1000, 0, 0, 100)]) == [75, 25]
    # One wants little: it gets what it wants, the other the rest.
    assert fair_shares(100, [Claim(1000, 0, 100, 0), Claim(1000, 0, 0, 10)]) == [90, 10]
    # A minimum is a floor under the weighted share, not added to it.
    assert fair_shares(100, [Claim(1000, 40, 100, 0), Claim(1000, 0, 0, 100)]) == [50, 50]
    assert fair_shares(100, [Claim(1000, 70, 100, 0), Claim(1000, 0, 0, 100)]) == [70, 30]
    # Minimums beyond the budget: scaled down in proportion.
    assert fair_shares(100, [Claim(1000, 150, 200, 0), Claim(1000, 50, 0, 200)]) == [75, 25]
    # Everybody satisfied: shares are the wants.
    assert fair_shares(100, [Claim(1000, 0, 10, 5), Claim(1000, 0, 20, 0)]) == [15, 20]
    assert fair_shares(100, []) == []
    # The hog holding everything is capped at its share while the other waits; not once the
    # other has its share, nor when it asks for nothing.
    hog, waiting = Claim(1000, 0, 100, 0), Claim(1000, 0, 0, 60)
    assert caps(100, [hog, waiting], fair_shares(100, [hog, waiting])) == [50, UNCAPPED]
    satisfied = Claim(1000, 0, 50, 10)
    assert caps(100, [Claim(1000, 0, 50, 0), satisfied], [50, 50]) == [UNCAPPED, UNCAPPED]
    idle = Claim(1000, 0, 0, 0)
    assert caps(100, [hog, idle], fair_shares(100, [hog, idle])) == [UNCAPPED, UNCAPPED]
    # Someone waits, but what is free covers it: nobody is capped (a cap at 40 would stop the
    # first one's running requests from taking their next blocks).
    busy, queued = Claim(1000, 0, 40, 0), Claim(1000, 0, 20, 10)
    assert caps(100, [busy, queued], fair_shares(100, [busy, queued])) == [UNCAPPED, UNCAPPED]
    # Short of budget: the one wanting less than its half may still grow to its half.
    small, large = Claim(1000, 0, 30, 0), Claim(1000, 0, 40, 100)
    assert fair_shares(100, [small, large]) == [30, 70]
    assert caps(100, [small, large], [30, 70]) == [50, UNCAPPED]
    # The room to grow respects a minimum: the other's 70 leaves the hog 30, and no more.
    floored = Claim(1000, 70, 0, 100)
    assert caps(100, [hog, floored], fair_shares(100, [hog, floored])) == [30, UNCAPPED]


@pytest.mark.parametrize("claim", [Claim(0, 0, 0, 0), Claim(1000, -1, 0, 0), Claim(1000, 0, -1, 0),
                                   Claim(1000, 0, 0, -1)])
def test_invalid_claims_are_refused(claim):
    with pytest.raises(ValueError, match="invalid"):
        fair_shares(10, [claim])
    with pytest.raises(ValueError, match="budget_bytes"):
        fair_shares(-1, [])
