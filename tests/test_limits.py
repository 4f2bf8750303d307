"""Tests of kvcached.limits: the revision rules and the split of a limit across pools."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcached.errors import KVCachedConfigError
from kvcached.limits import NO_LIMIT, classify_limit_request, split_limit


def test_classify_limit_request():
    assert classify_limit_request(100, 5, 50, 4) == "stale"
    assert classify_limit_request(100, 5, 50, 5) == "conflict"
    assert classify_limit_request(100, 5, 100, 5) == "same"
    assert classify_limit_request(100, 5, 0, 6) == "new"


def test_split_limit_examples():
    assert split_limit(10, [1, 1, 1]) == [4, 3, 3]
    assert split_limit(10 << 20, [3 << 30, 1 << 30], page_size_bytes=2 << 20) == [8 << 20,
                                                                                2 << 20]
    assert split_limit(7, [0, 5]) == [0, 7]
    assert split_limit(7, [0, 0]) == [4, 3]
    assert split_limit(NO_LIMIT, [1, 2]) == [NO_LIMIT, NO_LIMIT]
    assert split_limit(5, []) == []
    with pytest.raises(KVCachedConfigError):
        split_limit(-2, [1])


@settings(max_examples=200, deadline=None)
@given(limit=st.integers(0, 1 << 40), page=st.sampled_from([0, 1, 4096, 2 << 20]),
       capacities=st.lists(st.integers(0, 1 << 36), min_size=1, max_size=8))
def test_split_limit_properties(limit, page, capacities):
    shares = split_limit(limit, capacities, page)
    unit = page or 1
    assert sum(shares) == limit // unit * unit
    assert all(s % unit == 0 and s >= 0 for s in shares)
    weights = capacities if sum(capacities) else [1] * len(capacities)
    for share, weight in zip(shares, weights):
        exact = (limit // unit) * weight / sum(weights)
        assert abs(share // unit - exact) < 1 + 1e-6 * exact
