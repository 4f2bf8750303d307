"""PageAllocator on the host backend: pool, limits, resize, trim, gate, background thread."""

import time

import pytest

from kvcached.core import PageAllocator
from kvcached.errors import KVCachedConfigError, MappingError

from _stacks import GRANULARITY, make_table, state_of


def wait_for(cond, timeout=30.0):
    """Poll `cond` until true or a generous timeout (a loaded 2-core machine may starve threads)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.001)
    return cond()


def wait_rounds(pages, rounds=2):
    """Wait until the background thread has completed `rounds` more rounds (it wakes at least
    every 100 ms): what it would do on its own, it has done by then."""
    start = pages.stats()["num_bg_rounds"]
    assert wait_for(lambda: pages.stats()["num_bg_rounds"] >= start + rounds), "the background thread stalled"


def test_take_maps_lowest_ids_and_give_back_pools_then_unmaps(stack_factory):
    s = stack_factory(block_bytes=None, max_reserved=2)
    ids = s.pages.take(4)
    assert ids == [0, 1, 2, 3]
    assert s.table.mapped_page_ids() == [0, 1, 2, 3]
    s.pages.give_back(ids)
    st = s.pages.stats()
    assert st["reserved"] == 2 and st["in_use"] == 0 and st["pending_unmap"] == 0
    assert len(s.table.mapped_page_ids()) == 2
    s.pages.check_invariants()
    # the pool serves the next take without mapping
    maps = st["num_maps"]
    again = s.pages.take(2)
    assert sorted(again) == sorted(set(ids) & set(s.table.mapped_page_ids()))
    assert s.pages.stats()["num_maps"] == maps and s.pages.stats()["num_pool_hits"] >= 1
    s.pages.check_invariants()


def test_take_out_of_memory_changes_nothing(stack_factory):
    s = stack_factory(block_bytes=None, capacity_granules=5, max_reserved=2)
    first = s.pages.take(3)
    s.pages.give_back(first[:2])
    before = state_of(s)
    assert s.pages.take(5) is None        # 2 pooled + 2 physical left < 5
    assert state_of(s) == before
    assert s.pages.available_pages() == 4
    got = s.pages.take(4)
    assert got is not None and len(set(got)) == 4
    s.pages.check_invariants()


def test_limit_pages(stack_factory):
    s = stack_factory(block_bytes=None, capacity_granules=None, max_reserved=4)
    ids = s.pages.take(6)
    s.pages.give_back(ids[:3])
    s.pages.set_limit_pages(4)                 # in use 3 + pool 3 > 4: the pool shrinks to 1
    st = s.pages.stats()
    assert st["in_use"] == 3 and st["reserved"] == 1 and st["limit_pages"] == 4
    assert s.pages.available_pages() == 1      # the pooled one; no headroom for a new page
    assert s.pages.take(2) is None
    assert s.pages.take(1) is not None
    s.pages.set_limit_pages(6)
    assert s.pages.available_pages() == 2
    assert s.pages.take(2) is not None
    s.pages.set_limit_pages(2)                 # below the pages in use: no new page at all
    assert s.pages.take(1) is None
    assert s.pages.available_pages() == 0
    s.pages.set_limit_pages(0)
    assert s.pages.take(1) is None
    s.pages.set_limit_pages(-1)
    assert s.pages.take(1) is not None
    with pytest.raises(KVCachedConfigError):
        s.pages.set_limit_pages(-2)
    s.pages.check_invariants()


def test_resize_grow_shrink_and_refusal(stack_factory):
    s = stack_factory(block_bytes=None, capacity_granules=None, num_pages=16, capacity_pages=8, max_reserved=4)
    assert s.pages.stats()["capacity_pages"] == 8
    assert s.pages.take(9) is None
    ids = s.pages.take(8)
    assert sorted(ids) == list(range(8))
    before = state_of(s)
    assert s.pages.resize(4) is False          # pages 4..7 are in use
    assert state_of(s) == before
    s.pages.give_back([4, 5, 6, 7])            # into the pool (max 4)
    assert s.pages.resize(4) is True
    st = s.pages.stats()
    assert st["capacity_pages"] == 4 and st["reserved"] == 0 and st["free"] == 0
    assert s.table.mapped_page_ids() == [0, 1, 2, 3]
    assert s.pages.take(1) is None
    assert s.pages.resize(16) is True
    got = s.pages.take(12)
    assert sorted(got) == list(range(4, 16))
    with pytest.raises(KVCachedConfigError):
        s.pages.resize(17)
    with pytest.raises(KVCachedConfigError):
        s.pages.resize(-1)
    s.pages.check_invariants()


def test_shrink_then_grow_never_duplicates(stack_factory):
    s = stack_factory(block_bytes=None, capacity_granules=None, num_pages=8, max_reserved=8)
    ids = s.pages.take(8)
    s.pages.give_back(ids[4:])
    assert s.pages.resize(2) is False
    s.pages.give_back(ids[2:4])
    assert s.pages.resize(2) is True
    assert s.pages.resize(8) is True
    more = s.pages.take(6)
    live = ids[:2] + more
    assert len(set(live)) == 8
    s.pages.check_invariants()


def test_trim_unmaps_pool_and_releases_cached_handles(stack_factory):
    s = stack_factory(block_bytes=None, max_reserved=4)
    s.pages.give_back(s.pages.take(4))
    assert s.pages.stats()["reserved"] == 4
    s.pages.trim()
    assert s.pages.stats()["reserved"] == 0
    assert s.table.mapped_page_ids() == []
    assert s.backend.physical_bytes == 0 and s.backend.stats()["cached_handles"] == 0
    s.pages.check_invariants()


def test_budget_gate_batched_and_not_on_pool_path(stack_factory):
    s = stack_factory(block_bytes=None, capacity_granules=None, max_reserved=4)
    calls = []
    budget = {"left": 3 * GRANULARITY}

    def acquire(nbytes):
        calls.append(("acquire", nbytes))
        if nbytes > budget["left"]:
            return False
        budget["left"] -= nbytes
        return True

    def release(nbytes):
        calls.append(("release", nbytes))
        budget["left"] += nbytes

    s.pages.set_budget_gate(acquire, release)
    ids = s.pages.take(2)
    assert calls == [("acquire", 2 * GRANULARITY)]
    before = state_of(s)
    assert s.pages.take(2) is None                    # budget has 1 page left
    assert state_of(s) == before
    s.pages.give_back(ids)                            # into the pool: no release
    calls.clear()
    assert s.pages.take(2) is not None                # the pool path never asks
    assert calls == []
    s.pages.trim()                                    # pool is empty already
    got = s.pages.take(1)
    assert calls == [("acquire", GRANULARITY)]
    s.pages.set_pool_bounds(0, 0)
    s.pages.give_back(got)
    assert calls[-1] == ("release", GRANULARITY)
    with pytest.raises(KVCachedConfigError):
        s.pages.set_budget_gate(acquire, None)
    s.pages.set_budget_gate(None, None)
    s.pages.check_invariants()


def test_background_thread_refills_and_stops_promptly(stack_factory):
    s = stack_factory(block_bytes=None, capacity_granules=None, min_reserved=3, max_reserved=5)
    s.pages.start()
    assert wait_for(lambda: s.pages.stats()["reserved"] == 3)
    ids = s.pages.take(3)                             # empties the pool: the thread is woken
    assert ids is not None
    assert wait_for(lambda: s.pages.stats()["reserved"] == 3)
    s.pages.check_invariants()
    t0 = time.monotonic()
    s.pages.stop()
    assert time.monotonic() - t0 < 10.0               # woken, not waiting out its period (generous bound)
    assert not s.pages.running
    assert s.pages.last_error is None


def test_background_thread_respects_limit(stack_factory):
    s = stack_factory(block_bytes=None, capacity_granules=None, min_reserved=4, max_reserved=6)
    s.pages.set_limit_pages(2)
    s.pages.start()
    assert wait_for(lambda: s.pages.stats()["reserved"] == 2)
    wait_rounds(s.pages)                              # rounds that found nothing more to map
    assert s.pages.stats()["reserved"] == 2
    s.pages.set_limit_pages(-1)
    assert wait_for(lambda: s.pages.stats()["reserved"] == 4)
    s.pages.stop()
    s.pages.check_invariants()


def test_idle_trim(stack_factory):
    s = stack_factory(block_bytes=None, capacity_granules=None, min_reserved=2, max_reserved=4, idle_trim_s=0.05)
    s.pages.give_back(s.pages.take(4))
    s.pages.start()
    assert wait_for(lambda: s.pages.stats()["reserved"] == 0 and s.pages.stats()["num_idle_trims"] >= 1)
    wait_rounds(s.pages)
    assert s.pages.stats()["reserved"] == 0           # no refill while idle
    assert s.pages.take(1) is not None                # activity: refill again
    assert wait_for(lambda: s.pages.stats()["reserved"] == 2)
    s.pages.stop()


def test_slow_path_wakes_the_refill_thread(stack_factory):
    """A take that needs more pages than the pool holds empties the pool and maps the rest; it
    must wake the background thread, which otherwise sleeps out its 100 ms period (median gap
    ~50 ms). The bound is generous: a prompt wake-up takes well under a millisecond here."""
    import statistics

    s = stack_factory(block_bytes=None, capacity_granules=None, num_pages=64, min_reserved=2, max_reserved=3)
    s.pages.start()
    gaps = []
    for _ in range(21):
        assert wait_for(lambda: s.pages.stats()["reserved"] >= 2 and s.pages.stats()["transit"] == 0)
        wait_rounds(s.pages, 1)                       # the thread is asleep in its period now
        slow = s.pages.stats()["num_slow_path"]
        ids = s.pages.take(s.pages.max_reserved + 2)  # the whole pool and more: the slow path
        t0 = time.monotonic()
        assert ids is not None and s.pages.stats()["num_slow_path"] == slow + 1
        assert wait_for(lambda: s.pages.stats()["reserved"] >= 2)
        gaps.append(time.monotonic() - t0)
        s.pages.give_back(ids)
        s.pages.set_pool_bounds(2, 3)                 # back to the resting pool for the next round
    assert statistics.median(gaps) < 0.02, f"refill after a slow take: median {statistics.median(gaps) * 1e3:.1f} ms"
    s.pages.check_invariants()


def test_stats_keys_and_available_without_driver(stack_factory):
    s = stack_factory(block_bytes=None, capacity_granules=6)
    st = s.pages.stats()
    for key in ("capacity_pages", "free", "in_use", "reserved", "pending_unmap", "mapped", "limit_pages",
                "free_physical_bytes", "num_maps", "num_unmaps", "num_pool_hits", "num_slow_path"):
        assert key in st
    assert s.pages.available_pages() == 6             # physical memory bounds it, not the 16 ids


def test_bad_input(stack_factory, host_backend):
    s = stack_factory(block_bytes=None)
    with pytest.raises(ValueError):
        s.pages.take(-1)
    ids = s.pages.take(2)
    with pytest.raises(MappingError):
        s.pages.give_back([ids[0], ids[0]])
    with pytest.raises(MappingError):
        s.pages.give_back([5])
    with pytest.raises(MappingError):
        s.pages.give_back([99])
    assert s.pages.stats()["in_use"] == 2
    table, _ = make_table(host_backend, 4)
    with pytest.raises(KVCachedConfigError):
        PageAllocator(table, 5)
    with pytest.raises(KVCachedConfigError):
        PageAllocator(table, min_reserved=3, max_reserved=2)
    with pytest.raises(KVCachedConfigError):
        PageAllocator(table, idle_trim_s=-1)


@pytest.mark.parametrize("seed", range(3))
def test_random_operations_keep_every_set_and_state_consistent(stack_factory, seed):
    """Random takes, returns, limits, resizes, trims and drains, the free set, the pool and the
    pending ring each checked (and the states across them) after every step."""
    import random

    rng = random.Random(seed)
    s = stack_factory(block_bytes=None, capacity_granules=12, max_reserved=3)
    num_pages = s.pages.num_table_pages
    held: list[int] = []
    for _ in range(120):
        op = rng.choice(["take", "take", "give_back", "limit", "resize", "trim", "drain"])
        if op == "take":
            got = s.pages.take(rng.randint(1, 4))
            held += got or []
        elif op == "give_back" and held:
            rng.shuffle(held)
            n = rng.randint(1, len(held))
            s.pages.give_back(held[:n])
            held = held[n:]
        elif op == "limit":
            s.pages.set_limit_pages(rng.choice([-1, len(held) + rng.randint(0, 4)]))
        elif op == "resize":
            s.pages.resize(rng.randint(max(held, default=-1) + 1, num_pages))
        elif op == "trim":
            s.pages.trim()
        elif op == "drain":
            s.pages.drain(wait=True)
        assert s.pages.check_invariants()
        assert s.pages.stats()["in_use"] == len(held)
