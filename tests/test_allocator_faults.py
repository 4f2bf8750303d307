"""Out of memory at every handle acquisition of a multi-page alloc: alloc returns None, the state
is exactly as before, and the next alloc succeeds once memory returns."""

import time

import pytest

from _stacks import state_of

KIB = 1 << 10


@pytest.mark.parametrize("segments", [1, 3])
@pytest.mark.parametrize("pooled", [0, 2])
def test_oom_at_every_acquisition(stack_factory, segments, pooled):
    s = stack_factory(num_pages=12, capacity_granules=None, segments=segments, block_bytes=16 * KIB,
                      max_reserved=4)                            # 4 blocks per page
    keep = s.blocks.alloc(3)                                     # page 0, 1 free slot
    if pooled:
        s.blocks.free(s.blocks.alloc(1 + 4 * pooled))            # leaves `pooled` pages in the pool
        keep2 = s.blocks.alloc(1)
        keep += keep2
    n = 1 + 4 * 5 if not pooled else 4 * 5                       # needs 5 new pages beyond the pool
    new_pages = 5 - pooled if pooled else 5
    acquisitions = new_pages * segments
    for k in range(acquisitions):
        before = state_of(s)
        s.backend.inject_out_of_memory(k)
        assert s.blocks.alloc(n) is None, f"OOM at acquisition {k} was not reported"
        s.backend.inject_out_of_memory(-1)
        assert state_of(s) == before, f"state changed after OOM at acquisition {k}"
        s.blocks.check_invariants()
        s.table.check_invariants()
    # try_to_reserve takes the same path
    before = state_of(s)
    s.backend.inject_out_of_memory(acquisitions - 1)
    assert s.blocks.try_to_reserve(n) is False
    s.backend.inject_out_of_memory(-1)
    assert state_of(s) == before
    got = s.blocks.alloc(n)
    assert got is not None and len(set(got) | set(keep)) == n + len(keep)
    s.blocks.check_invariants()


def test_real_oom_from_small_capacity(stack_factory):
    s = stack_factory(num_pages=16, capacity_granules=5, segments=1, block_bytes=16 * KIB, max_reserved=1)
    a = s.blocks.alloc(18)                                       # 5 pages: every granule
    assert a is not None
    before = state_of(s)
    assert s.blocks.alloc(3) is None                             # 2 free slots, no memory for a page
    assert state_of(s) == before
    assert s.blocks.available_blocks() == 2
    s.blocks.free(a[:8])
    got = s.blocks.alloc(8)
    assert got is not None
    s.blocks.check_invariants()


def test_oom_in_background_refill_backs_off(stack_factory):
    s = stack_factory(num_pages=16, capacity_granules=None, block_bytes=16 * KIB, min_reserved=3, max_reserved=4)
    s.backend.inject_out_of_memory(1)
    s.pages.start()
    time.sleep(0.15)
    st = s.pages.stats()
    # the refill maps one page at a time (Note [Proactive refill]): the page mapped before the
    # failure stays pooled, the failed one is rolled back, nothing is left in transit
    assert st["reserved"] == 1 and st["transit"] == 0 and s.pages.last_error is None
    s.pages.check_invariants()
    s.backend.inject_out_of_memory(-1)
    assert s.blocks.alloc(1) is not None                        # activity wakes the refill again
    end = time.monotonic() + 3
    while s.pages.stats()["reserved"] < 3 and time.monotonic() < end:
        time.sleep(0.005)
    assert s.pages.stats()["reserved"] == 3
    s.pages.stop()
    s.blocks.check_invariants()
