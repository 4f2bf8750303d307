"""kvcached.core.freebuckets: pages filed by free count (the block allocator's best fit), driven
through PageBuckets against a plain model, its invariant checked after every step."""

import random

import pytest

from kvcached.core._probes import PageBuckets


def model_at_least(filed: dict[int, int], count: int) -> int:
    return min((c for c in filed.values() if c >= count), default=-1)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_count", [1, 63, 64, 200])
def test_random_steps_agree_with_a_model(seed, max_count):
    """Random inserts and removes over few and many buckets (one bitmap word and several): after
    every step the check passes and the scans answer what the model says."""
    rng = random.Random(seed * 1000 + max_count)
    num_pages = rng.randint(1, 40)
    b = PageBuckets(num_pages, max_count)
    filed: dict[int, int] = {}
    for _ in range(400):
        page = rng.randrange(num_pages)
        if page in filed:
            b.remove(page)
            del filed[page]
        else:
            filed[page] = rng.randint(1, max_count)
            b.insert(page, filed[page])
        assert b.check_invariants()
        probe = rng.randint(0, max_count + 1)
        assert b.at_least(probe) == model_at_least(filed, probe)
        assert b.highest() == max(filed.values(), default=-1)
        if filed:
            some = rng.choice(list(filed.values()))
            assert filed[b.first(some)] == some


def test_check_can_fail():
    """The check catches a page filed under another count than its owner's, and a page its
    owner counts as partly free that is in no bucket."""
    b = PageBuckets(4, 8)
    b.insert(1, 3)
    b.insert(2, 3)
    assert b.check_invariants([0, 3, 3, 0])
    with pytest.raises(AssertionError, match="page 1 with 5 free ids is in bucket 3"):
        b.check_invariants([0, 5, 3, 0])
    with pytest.raises(AssertionError, match="page 3 with 2 free ids is in no bucket"):
        b.check_invariants([0, 3, 3, 2])


def test_bad_arguments_raise_and_change_nothing():
    b = PageBuckets(3, 4)
    b.insert(0, 2)
    for call, match in ((lambda: b.insert(3, 1), "page id 3 is out of range"),
                        (lambda: b.insert(1, 5), "count 5 is out of range"),
                        (lambda: b.insert(0, 1), "page 0 is in bucket 2 already"),
                        (lambda: b.remove(1), "page 1 is in no bucket"),
                        (lambda: b.at_least(-1), "count -1 must be >= 0"),
                        (lambda: b.check_invariants([0, 0]), "one count per page")):
        with pytest.raises(ValueError, match=match):
            call()
    assert b.check_invariants() and b.highest() == 2 and b.first(2) == 0
    with pytest.raises(ValueError, match="max_count=0"):
        PageBuckets(3, 0)

