"""KVCacheManager's contract (its docstrings) on the host backend, for every layout.

Real mappings, small pages (64 KiB per buffer) and tiny pool bounds so that pages are mapped,
pooled and unmapped within a few steps. Most exact checks run with KVCACHED_MIN_RESERVED_PAGES=0,
so that no background refill maps pages between two reads of the counters; available_size()
itself stays exact while a refill is mapping (test_available_size_counts_pages_in_refill).
"""

from __future__ import annotations

import itertools
import random
import re
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcached import KVCacheManager, alloc_kv_cache, init_kvcached, shutdown_kvcached
from kvcached import runtime as runtime_module
from kvcached.errors import BlockStateError, KVCachedConfigError
from kvcached.runtime import get_kv_cache_manager

from _stacks import KV_PAGE_BYTES, POOL_EXITS, take_out_of_the_pool

LAYOUTS = ("per_layer", "interleaved", "page_grouped")
DTYPE = torch.float16


def make(kv_env, layout="interleaved", num_blocks=200, block_size=16, heads=2, head_dim=32, num_layers=2,
         min_reserved=0, max_reserved=2, reserve_null_block=False, **env):
    """init on the host backend, the group's tensors (FlashAttention shape) and its manager."""
    kv_env(LAYOUT=layout, MIN_RESERVED_PAGES=min_reserved, MAX_RESERVED_PAGES=max_reserved, **env)
    init_kvcached(device="cpu", page_size_bytes=KV_PAGE_BYTES)
    kv = alloc_kv_cache((2, num_blocks, block_size, heads, head_dim), block_size, DTYPE, "cpu", num_layers)
    cell_size = heads * head_dim * DTYPE.itemsize
    m = KVCacheManager(num_blocks, block_size, cell_size, num_layers, reserve_null_block=reserve_null_block)
    return m, kv


def snapshot(m) -> dict:
    """What a refused call must leave as it was."""
    s = m.stats()
    p = s["pages"]
    return {"states": m._blocks.block_states().tolist(), "allocated": s["allocated"], "held": s["held"],
            "available": m.available_size(), "in_use": p["in_use"], "reserved": p["reserved"],
            "free": p["free"], "mapped": m.get_mapped_memory_size()}


def check_ids(m, kv, ids) -> None:
    """Distinct ids, each a usable row of every tensor; dense layouts keep them below num_blocks."""
    assert len(set(ids)) == len(ids)
    rows = kv[0].shape[1]
    for b in ids:
        assert 0 <= b < rows
        if m.layout == "page_grouped":
            layout = m._group.layout
            assert b % layout.ids_per_page < layout.blocks_per_page, b
        else:
            assert b < m.num_blocks


def usable_ids(m) -> int:
    """Blocks the manager can hand out: num_blocks, less the ids below it that straddle two pages
    (dense layouts with a block size that does not divide the page never hand those out)."""
    if m.layout == "page_grouped":
        return m.num_blocks
    return int((m._group.layout.block_ids() < m.num_blocks).sum())


def check_exact(m, kv, live: list) -> list:
    """alloc(available + 1) is None and changes nothing; alloc(available) succeeds. Returns the
    new ids (appended to live)."""
    a = m.available_size()
    before = snapshot(m)
    assert m.alloc(a + 1) is None
    assert snapshot(m) == before
    ids = m.alloc(a)
    assert ids is not None and len(ids) == a
    check_ids(m, kv, live + ids)
    assert m.available_size() == 0
    assert m.alloc(1) is None
    m.check_invariants()
    return ids


# -- alloc / available_size ---------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_alloc_available_exact(kv_env, layout, data):
    dividing = layout == "page_grouped" or data.draw(st.booleans(), label="dividing")
    if dividing:
        block_size = data.draw(st.sampled_from([1, 2, 4, 8, 16, 32]), label="block_size")
        heads = data.draw(st.sampled_from([1, 2, 4]), label="heads")
        head_dim = data.draw(st.sampled_from([16, 32, 64]), label="head_dim")
    else:
        block_size = data.draw(st.sampled_from([3, 5, 7, 16]), label="block_size")
        heads = data.draw(st.sampled_from([3, 5]), label="heads")
        head_dim = data.draw(st.sampled_from([24, 40]), label="head_dim")
    block_bytes = block_size * heads * head_dim * 2
    if KV_PAGE_BYTES % block_bytes == 0:
        assert dividing or layout != "page_grouped"
    num_blocks = data.draw(st.integers(1, 300), label="num_blocks")
    max_reserved = data.draw(st.integers(0, 3), label="max_reserved")
    limit_pages = data.draw(st.none() | st.integers(0, 6), label="limit_pages")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    rng = random.Random(seed)
    try:
        m, kv = make(kv_env, layout, num_blocks=num_blocks, block_size=block_size, heads=heads, head_dim=head_dim,
                     max_reserved=max_reserved)
        if limit_pages is not None:
            assert m.set_memory_limit(limit_pages * m.page_bytes, revision=1)["status"] == "applied"
        live = []
        for _ in range(3):
            live += check_exact(m, kv, live)
            if limit_pages is None:
                assert len(live) == usable_ids(m)
            rng.shuffle(live)
            k = rng.randint(0, len(live))
            m.free(live[:k])
            live = live[k:]
            m.check_invariants()
        m.free(live)
        assert m.stats()["allocated"] == 0
    finally:
        shutdown_kvcached()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_alloc_never_partial(kv_env, layout):
    m, kv = make(kv_env, layout, num_blocks=100)
    assert m.alloc(0) == []
    with pytest.raises(ValueError):
        m.alloc(-1)
    before = snapshot(m)
    for not_a_count in (1.5, "2", None):
        with pytest.raises(TypeError):
            m.alloc(not_a_count)
        with pytest.raises(TypeError):
            m.try_to_reserve(not_a_count)
    assert snapshot(m) == before
    assert len(m.alloc(n=2)) == 2 and m.try_to_reserve(n=1)        # the documented keyword
    m.free_reserved()
    m.clear()
    before = snapshot(m)
    assert m.alloc(101) is None
    assert m.alloc(10**6) is None
    assert snapshot(m) == before
    ids = m.alloc(60)
    check_ids(m, kv, ids)
    before = snapshot(m)
    assert m.alloc(41) is None
    assert snapshot(m) == before
    rest = m.alloc(40)
    check_ids(m, kv, ids + rest)
    m.check_invariants()


def release_when_blocked(native_id: int, release: threading.Event, timeout_s: float = 30) -> None:
    """Set `release` once the thread `native_id` sleeps in the kernel (an alloc waiting for the
    refill), or after timeout_s: the answer is the same either way, only what is tested differs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "S":
                break
        time.sleep(0.001)
    release.set()


def test_available_size_counts_pages_in_refill(kv_env):
    m, kv = make(kv_env, "interleaved", num_blocks=300, min_reserved=2, max_reserved=3)
    m._pages.stop()
    m.trim()
    entered, release = threading.Event(), threading.Event()

    def acquire(nbytes):                     # the refill's budget gate: hold the pages in transit
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            release.wait(5)
        return True

    m._pages.set_budget_gate(acquire, lambda nbytes: None)
    try:
        m._pages.start()
        m.free(m.alloc(1))                   # activity: the background thread refills the pool
        assert entered.wait(5)
        during = m.available_size()
        releaser = threading.Thread(target=release_when_blocked, args=(threading.get_native_id(), release))
        releaser.start()
        got = m.alloc(during + 1)
        releaser.join()
        if got is not None:
            m.free(got)
        assert got is None, f"available_size()={during} during a refill, yet alloc({during + 1}) succeeded"
    finally:
        release.set()
        m._pages.set_budget_gate(None, None)


# -- free ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_free_errors_change_nothing(kv_env, layout):
    m, kv = make(kv_env, layout, num_blocks=100)
    ids = m.alloc(10)
    m.free(ids[5:])
    live = ids[:5]
    free_id = ids[7]
    never = next(b for b in range(kv[0].shape[1]) if b not in ids and (
        m.layout != "page_grouped" or b % m._group.layout.ids_per_page < m._group.layout.blocks_per_page))
    before = snapshot(m)
    for bad in ([free_id], [live[0], free_id], [live[0], live[0]], [live[1], live[2], live[1]],
                [never], [-1], [live[0], -5], [10**9], [live[0], 2**31 - 1]):
        with pytest.raises(BlockStateError):
            m.free(bad)
        assert snapshot(m) == before, bad
    if m.layout == "page_grouped":           # an alias row (slot past the page's blocks) is no id
        with pytest.raises(BlockStateError):
            m.free([m._group.layout.blocks_per_page])
        assert snapshot(m) == before
    m.free(live)
    with pytest.raises(BlockStateError):
        m.free(live[:1])
    assert m.stats()["allocated"] == 0
    m.check_invariants()


# -- alloc_into / free_from --------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_alloc_into_free_from(kv_env, layout, kind):
    m, kv = make(kv_env, layout, num_blocks=100)

    def buf(n, dtype=np.int32):
        return np.zeros(n, dtype) if kind == "numpy" else torch.zeros(n, dtype=getattr(torch, np.dtype(dtype).name))

    b = buf(30)
    assert m.alloc_into(b) is True
    ids = [int(x) for x in b]
    check_ids(m, kv, ids)
    assert m.stats()["allocated"] == 30
    before = snapshot(m)
    big = buf(71)
    assert m.alloc_into(big) is False
    assert snapshot(m) == before
    bad_buffers = [buf(4, np.int64), buf(8)[::2], [0, 1], buf(4, np.int16)]
    bad_buffers.append(np.zeros((2, 2), np.int32) if kind == "numpy" else torch.zeros(2, 2, dtype=torch.int32))
    for bad in bad_buffers:
        with pytest.raises((ValueError, TypeError)):
            m.alloc_into(bad)
        assert snapshot(m) == before
    for bad in (b.astype(np.int64) if kind == "numpy" else b.to(torch.int64), buf(60)[::2]):
        with pytest.raises((ValueError, TypeError)):
            m.free_from(bad)
        assert snapshot(m) == before
    dup = buf(2)
    dup[0] = dup[1] = ids[0]
    with pytest.raises(BlockStateError):
        m.free_from(dup)
    assert snapshot(m) == before
    m.free_from(b[:10])
    assert m.stats()["allocated"] == 20
    m.free_from(b[10:])
    assert m.stats()["allocated"] == 0
    with pytest.raises(BlockStateError):
        m.free_from(b[:1])
    m.check_invariants()


# -- try_to_reserve / resize / trim / clear / null block -----------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_try_to_reserve(kv_env, layout):
    m, kv = make(kv_env, layout, num_blocks=100)
    assert m.try_to_reserve(0) is True
    with pytest.raises(ValueError):
        m.try_to_reserve(-1)
    before = snapshot(m)
    assert m.try_to_reserve(101) is False
    assert snapshot(m) == before
    assert m.try_to_reserve(40) is True
    assert m.stats()["held"] == 40
    assert m.available_size() == 100            # held blocks go to the next allocs
    ids = m.alloc(30)
    assert m.stats()["held"] == 10 and m.stats()["allocated"] == 30
    check_ids(m, kv, ids)
    m.free_reserved()
    assert m.stats()["held"] == 0 and m.stats()["allocated"] == 30
    assert m.available_size() == 70
    assert m.try_to_reserve(70) is True and m.try_to_reserve(1) is False
    m.free_reserved()
    m.free(ids)
    m.check_invariants()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_resize(kv_env, layout):
    m, kv = make(kv_env, layout, num_blocks=200)
    P, pb = m.num_pages, m.page_bytes
    assert P >= 4
    with pytest.raises(ValueError):
        m.resize(-1)
    with pytest.raises(ValueError):
        m.resize(1.5)
    before = snapshot(m)
    assert m.resize((P + 1) * pb) is False          # past the reservation
    assert snapshot(m) == before
    assert m.resize(2 * pb) is True
    cap = m.available_size()
    live = check_exact(m, kv, [])
    assert max(m._group.layout.page_of(b) for b in live) < 2
    before = snapshot(m)
    assert m.resize(1 * pb) is False                # page 1 holds live blocks
    assert snapshot(m) == before
    m.free([b for b in live if m._group.layout.page_of(b) == 1])
    live = [b for b in live if m._group.layout.page_of(b) == 0]
    assert m.resize(pb + pb // 2) is True           # rounds down to one page
    assert m.available_size() == 0
    assert m.resize(P * pb) is True                 # grow back
    live += check_exact(m, kv, live)
    assert m.available_size() == 0 and len(live) == 200 and cap < 200
    m.free(live)
    assert m.resize(0) is True and m.available_size() == 0 and m.alloc(1) is None
    assert m.resize(P * pb) is True and m.available_size() == 200
    m.check_invariants()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trim_and_mapped_size(kv_env, layout):
    m, kv = make(kv_env, layout, num_blocks=200, max_reserved=3)
    pb = m.page_bytes
    assert pb == KV_PAGE_BYTES * 2 * 2               # one page id backs 2 layers x K/V
    assert m.get_mapped_memory_size() == 0
    ids = m.alloc(200)
    pages = m.stats()["pages"]["in_use"]
    assert pages == m.num_pages
    assert m.get_mapped_memory_size() == pages * pb
    assert m.get_mapped_memory_size("kb") == pages * pb / 1024
    assert m.get_mapped_memory_size("MB") == pages * pb / (1 << 20)
    assert m.get_mapped_memory_size("GB") == pages * pb / (1 << 30)
    assert m.get_mapped_memory_size("b") == pages * pb
    with pytest.raises(ValueError, match="tb"):
        m.get_mapped_memory_size("tb")
    m.free(ids)
    assert m.stats()["pages"]["reserved"] == min(3, pages)   # emptied pages: pool up to max
    assert m.get_mapped_memory_size() == min(3, pages) * pb
    m.trim()
    assert m.get_mapped_memory_size() == 0
    assert m._group.page_table.mapped_page_ids() == []
    assert m.available_size() == 200
    m.check_invariants()


@pytest.mark.parametrize("path", POOL_EXITS)
def test_pages_leave_the_pool_behind_a_fence(kv_env, path):
    """A page freed into the pool got no fence; each path that unmaps pool pages records one
    (kernels queued before the free may still read it: Note [Deferred unmap]). The CUDA variant
    in test_kv_cache_manager_cuda runs a kernel over the page; here the host's fence is done at once."""
    env = {"IDLE_TRIM_S": 0.05} if path == "idle_trim" else {}
    m, kv = make(kv_env, num_blocks=200, max_reserved=4, **env)
    ids = m.alloc(int(m._group.layout.page_num_blocks[0]))     # exactly page 0
    m.free(ids)
    before = m.stats()["pages"]
    assert before["reserved"] == 1 and before["mapped"] == 1, before
    take_out_of_the_pool(m, path)
    after = m.stats()["pages"]
    assert after["num_fences"] == before["num_fences"] + 1, f"{path}: pool pages unmapped with no fence"
    assert after["reserved"] == after["mapped"] == after["pending_unmap"] == 0, after
    m.check_invariants()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_page_occupancy(kv_env, layout):
    m, kv = make(kv_env, layout, num_blocks=100)
    assert m.get_page_occupancy() == {}
    ids = m.alloc(40)
    per_page = {}
    for b in ids:
        p = m._group.layout.page_of(b)
        per_page[p] = per_page.get(p, 0) + 1
    occ = m.get_page_occupancy()
    assert {p: live for p, (live, _) in occ.items()} == per_page
    for p, (live, total) in occ.items():
        assert total == int(m._group.layout.page_num_blocks[p]) or p == m.num_pages - 1
    assert set(m.get_page_occupancy([0])) == {0}
    with pytest.raises(ValueError):
        m.get_page_occupancy([m.num_pages])
    with pytest.raises(ValueError):
        m.get_page_occupancy([-1])
    m.free(ids)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_clear(kv_env, layout):
    m, kv = make(kv_env, layout, num_blocks=100)
    ids = m.alloc(70)
    assert m.try_to_reserve(20)
    m.clear()
    s = m.stats()
    assert s["allocated"] == 0 and s["held"] == 0 and m.available_size() == 100
    with pytest.raises(BlockStateError):
        m.free(ids[:1])
    check_exact(m, kv, [])
    m.clear()
    m.check_invariants()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_null_block(kv_env, layout):
    rng = random.Random(7)
    m, kv = make(kv_env, layout, num_blocks=100, reserve_null_block=True)
    assert m.null_block == 0
    assert m.available_size() == 99 and m.stats()["allocated"] == 1
    for round_ in range(3):
        ids = check_exact(m, kv, [0])
        assert 0 not in ids and len(ids) == 99
        rng.shuffle(ids)
        m.free(ids[:50])
        if round_ == 1:
            assert m.try_to_reserve(10)
        m.clear()
        s = m.stats()
        assert s["allocated"] == 1 and s["held"] == 0, s
        assert m._blocks.block_states()[0] == 1, "clear() dropped the null block"
        assert m.available_size() == 99
        m.check_invariants()


# -- limits ------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tracker", [0, 1])
def test_memory_limit_lifecycle(kv_env, layout, tracker):
    m, kv = make(kv_env, layout, num_blocks=320, min_reserved=1, max_reserved=2, TRACKER=tracker)
    pb = m.page_bytes
    assert (m.ipc_name is None) == (not tracker)

    def wait_for(predicate, what):
        deadline = time.monotonic() + 5
        while not predicate():
            assert time.monotonic() < deadline, what
            time.sleep(0.01)

    wait_for(lambda: m.stats()["pages"]["reserved"] == 1, "pool refilled to its minimum")
    # 0 drains an idle manager: the pool is unmapped, nothing can be allocated
    st0 = m.set_memory_limit(0, revision=1)
    assert st0["status"] == "applied" and st0["limit_bytes"] == 0 and st0["revision"] == 1
    assert m.get_mapped_memory_size() == 0 and m.available_size() == 0 and m.alloc(1) is None
    assert m.set_memory_limit(0, revision=1)["status"] == "applied"        # repeated: same answer
    assert m.set_memory_limit(pb, revision=1)["status"] == "conflict"
    assert m.set_memory_limit(pb, revision=0)["status"] == "stale"
    assert m.memory_limit()["limit_bytes"] == 0
    # -1 removes it, and the pool grows back to its minimum
    assert m.set_memory_limit(-1, revision=2)["status"] == "applied"
    wait_for(lambda: m.stats()["pages"]["reserved"] == 1, "pool grows back after the limit is removed")
    ids = m.alloc(m.available_size())
    assert len(ids) == 320
    # a limit below the live pages is deferred, and applied once enough pages emptied
    st = m.set_memory_limit(3 * pb + pb // 2, revision=3)
    assert st["status"] == "deferred" and st["mapped_bytes"] > 3 * pb
    assert m.alloc(1) is None
    by_page = {}
    for b in ids:
        by_page.setdefault(m._group.layout.page_of(b), []).append(b)
    pages = sorted(by_page)
    for p in pages[3:]:
        m.free(by_page[p])
    assert m.memory_limit()["status"] == "applied"
    assert m.get_mapped_memory_size() <= 3 * pb
    assert m.available_size() == 0 and m.alloc(1) is None
    if tracker:
        from kvcached.shm.owner import MemInfoTracker  # noqa: F401  (segment visible to kvctl)
        wait_for(lambda: m._tracker.recorded_limit()[2] == "applied", "segment records applied")
    with pytest.raises(ValueError):
        m.set_memory_limit(-2, revision=4)
    with pytest.raises(ValueError):
        m.set_memory_limit(pb, revision=-1)
    assert m.memory_limit()["revision"] == 3
    # raising the limit lets allocs map again
    assert m.set_memory_limit(5 * pb, revision=4)["status"] == "applied"
    # (let the refill finish first: see test_available_size_counts_pages_in_refill)
    wait_for(lambda: m.stats()["pages"]["reserved"] == 1, "pool refilled under the raised limit")
    more = m.alloc(m.available_size())
    assert m.get_mapped_memory_size() <= 5 * pb
    assert m.alloc(1) is None
    m.free(more)
    for p in pages[:3]:
        m.free(by_page[p])
    m.check_invariants()


def brute_over_limit_blocks(states: np.ndarray, page_of: np.ndarray, limit_pages: int) -> int:
    """over_limit_blocks by its definition, trying every choice of limit_pages pages to keep among
    those holding live blocks: the blocks on the other pages move into the free slots of the kept
    ones, and what does not fit must be freed; the fewest over all choices."""
    live, usable = (states == 1) | (states == 3), states != 2
    holding = sorted(set(page_of[live].tolist()))
    if len(holding) <= limit_pages:
        return 0
    count = {p: int((live & (page_of == p)).sum()) for p in holding}
    free = {p: int((usable & (page_of == p)).sum()) - count[p] for p in holding}
    return min(max(0, sum(count[p] for p in holding if p not in kept) - sum(free[p] for p in kept))
               for kept in itertools.combinations(holding, limit_pages))


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_over_limit_blocks_is_the_fewest_blocks_to_free(kv_env, layout, data):
    """Random occupancies (which blocks of which pages live, held ones included), geometries whose
    pages hold unequal numbers of blocks (the last one partial) and limits: over_limit_blocks is
    the brute-force count, and over_limit_pages the pages beyond the limit. It was the live blocks
    less limit x the average blocks per page, so blocks that fit their pages were counted."""
    dividing = [(16, 2, 32), (16, 4, 32), (8, 4, 64), (16, 4, 64)]      # 32, 16, 16 and 8 blocks a page
    straddling = [(16, 3, 24), (16, 5, 40), (5, 5, 40), (7, 3, 40)]     # 28.4, 10.2, 32.8 and 39.0
    block_size, heads, head_dim = data.draw(st.sampled_from(
        dividing + ([] if layout == "page_grouped" else straddling)), label="block_size, heads, head_dim")
    num_blocks = data.draw(st.integers(1, 120), label="num_blocks")
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    try:
        m, kv = make(kv_env, layout, num_blocks=num_blocks, block_size=block_size, heads=heads, head_dim=head_dim)
        if m.num_pages > 12:        # the brute force tries every choice of pages
            return
        ids = m.alloc(m.available_size())
        keep = [rng.random() for _ in range(m.num_pages)]       # each page's share of live blocks
        m.free([b for b, p in zip(ids, m.pages_of(ids)) if rng.random() > keep[p]])
        held = data.draw(st.integers(0, 3), label="held")
        assert m.try_to_reserve(min(held, m.available_size()))
        owned = m.stats()["owned_pages"]
        limit_pages = data.draw(st.integers(0, owned + 1), label="limit_pages")
        extra = data.draw(st.integers(0, m.page_bytes - 1), label="extra bytes")
        m.set_memory_limit(limit_pages * m.page_bytes + extra, revision=1)
        states = m._blocks.block_states()
        page_of = np.array(m.pages_of(range(len(states))))
        assert m.over_limit_blocks() == brute_over_limit_blocks(states, page_of, limit_pages)
        assert m.over_limit_pages() == max(0, owned - limit_pages)
        m.check_invariants()
    finally:
        shutdown_kvcached()


# -- constructor and registry -------------------------------------------------------------------

def test_constructor_validation(kv_env):
    kv_env(LAYOUT="interleaved", MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=2)
    init_kvcached(device="cpu", page_size_bytes=KV_PAGE_BYTES)
    alloc_kv_cache((2, 100, 16, 2, 32), 16, DTYPE, "cpu", 2)
    good = dict(num_blocks=100, block_size=16, cell_size=128, num_layers=2)
    for name, bad in [("num_blocks", 0), ("num_blocks", -3), ("num_blocks", 10.0), ("num_blocks", True),
                      ("block_size", 0), ("cell_size", -128), ("num_layers", 0), ("num_layers", "2"),
                      ("num_kv_buffers", 0), ("group_id", -1), ("group_id", "a")]:
        with pytest.raises(KVCachedConfigError, match=name):
            KVCacheManager(**{**good, name: bad})
    with pytest.raises(KVCachedConfigError, match="world_size=2: kvcached was initialised with world_size=1"):
        KVCacheManager(**good, world_size=2)
    m = KVCacheManager(**good, world_size=1)
    assert (m.world_size, m.page_bytes) == (1, m._group.page_table.page_bytes)   # one rank: its own bytes
    m.close()
    with pytest.raises(KVCachedConfigError, match="num_layers, num_kv_buffers, block_bytes"):
        KVCacheManager(**{**good, "num_layers": 3})
    with pytest.raises(KVCachedConfigError, match="block_bytes"):
        KVCacheManager(**{**good, "cell_size": 64})
    with pytest.raises(KVCachedConfigError, match="num_kv_buffers"):
        KVCacheManager(**good, num_kv_buffers=1)
    with pytest.raises(KVCachedConfigError, match="num_blocks=1000"):
        KVCacheManager(**{**good, "num_blocks": 1000})
    m = KVCacheManager(np.int64(100), np.int32(16), 128, 2)      # engines pass numpy ints
    assert type(m.num_blocks) is int and m.available_size() == 100


@pytest.mark.parametrize("pool_name", ["pool", "a/b", "a\x85"])
def test_a_pool_name_that_spoils_the_segment_name_names_the_variable(kv_env, pool_name):
    """KVCACHED_IPC_NAME suffixed with pool_name must still name a segment; the error was the
    segment's, naming neither. Nothing is left behind: the same group takes a good pool_name."""
    base = "x" * 196
    kv_env(TRACKER=1, IPC_NAME=base, MIN_RESERVED_PAGES=0)
    init_kvcached(device="cpu", page_size_bytes=KV_PAGE_BYTES)
    with pytest.raises(KVCachedConfigError, match=re.escape(f"KVCACHED_IPC_NAME='{base}' with pool_name={pool_name!r} "
                                                            f"names no valid segment")):
        KVCacheManager(64, 16, 128, 2, pool_name=pool_name)
    assert runtime_module.managers() == []
    m = KVCacheManager(64, 16, 128, 2, pool_name="p")
    assert m.ipc_name == f"{base}.p"
    m.close()


def test_more_blocks_than_the_tensors_is_refused(kv_env):
    """KVCacheManager(128) over tensors of 64 blocks whose one page has room for 128 ids: ids
    64..127 are no rows of kv[l], so the constructor refuses, naming both numbers."""
    kv_env(LAYOUT="per_layer", MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=2)
    init_kvcached(device="cpu", page_size_bytes=4 * KV_PAGE_BYTES)
    kv = alloc_kv_cache((2, 64, 16, 2, 32), 16, DTYPE, "cpu", 2)
    assert kv[0].shape[1] == 64 and runtime_module.runtime().groups[0].layout.max_block_id >= 128
    with pytest.raises(KVCachedConfigError, match=r"KVCacheManager\(num_blocks=128\): .* hold 64 blocks; pass "
                                                  r"num_blocks <= 64 or allocate tensors with 128 blocks"):
        KVCacheManager(128, 16, 128, 2)
    assert runtime_module.managers() == []
    m = KVCacheManager(64, 16, 128, 2)
    check_ids(m, kv, m.alloc(64))


def test_tensors_made_after_the_manager_hold_its_blocks(kv_env):
    """The manager first (it makes the group, 128 blocks), then alloc_kv_cache of 64 blocks:
    before, the tensors were cut to 64 rows while the manager handed out ids up to 127."""
    kv_env(LAYOUT="per_layer", MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=2)
    init_kvcached(device="cpu", page_size_bytes=4 * KV_PAGE_BYTES)
    m = KVCacheManager(128, 16, 128, 2)
    with pytest.raises(KVCachedConfigError, match=r"kvcache_shape has 64 blocks, but the manager .* hands out 128"):
        alloc_kv_cache((2, 64, 16, 2, 32), 16, DTYPE, "cpu", 2)
    assert runtime_module.runtime().groups[0].tensors is None
    kv = alloc_kv_cache((2, 128, 16, 2, 32), 16, DTYPE, "cpu", 2)
    check_ids(m, kv, m.alloc(128))


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_manager_fits_its_tensors(kv_env, layout, data):
    """Over tensors of N blocks a manager of more than N blocks is refused wherever the group's
    pages have room for its ids, leaving the group without a manager; one of at most N blocks
    hands out rows of the tensors only."""
    tensor_blocks = data.draw(st.integers(1, 150), label="tensor_blocks")
    kv_env(LAYOUT=layout, MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=2)
    try:
        init_kvcached(device="cpu", page_size_bytes=KV_PAGE_BYTES)
        kv = alloc_kv_cache((2, tensor_blocks, 16, 2, 32), 16, DTYPE, "cpu", 2)
        capacity = runtime_module.runtime().groups[0].layout.max_block_id
        if capacity > tensor_blocks:
            too_many = data.draw(st.integers(tensor_blocks + 1, capacity), label="too_many")
            with pytest.raises(KVCachedConfigError, match=rf"num_blocks={too_many}\): .* hold {tensor_blocks} "):
                KVCacheManager(too_many, 16, 128, 2)
            assert runtime_module.managers() == []
        m = KVCacheManager(data.draw(st.integers(1, tensor_blocks), label="num_blocks"), 16, 128, 2)
        ids = m.alloc(m.available_size())
        check_ids(m, kv, ids)
        m.check_invariants()
    finally:
        shutdown_kvcached()


def test_one_manager_per_group(kv_env):
    m, kv = make(kv_env, "interleaved", num_blocks=100)
    ids = m.alloc(10)
    with pytest.raises(KVCachedConfigError, match="already has a manager"):
        KVCacheManager(100, 16, 128, 2)
    with pytest.raises(KVCachedConfigError, match="already has a manager"):
        KVCacheManager(50, 16, 128, 2, pool_name="other")
    assert get_kv_cache_manager(100, 16, 128, 2) is m
    with pytest.raises(KVCachedConfigError, match="already has a manager"):
        get_kv_cache_manager(50, 16, 128, 2)
    assert m.stats()["allocated"] == 10
    m.close()
    m.close()
    m2 = KVCacheManager(100, 16, 128, 2)
    assert m2.available_size() == 100
    check_ids(m2, kv, m2.alloc(100))


# -- threads ------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_eight_thread_churn(kv_env, layout):
    m, kv = make(kv_env, layout, num_blocks=600, min_reserved=1, max_reserved=2)
    owned = [[] for _ in range(8)]
    errors = []
    start = threading.Barrier(8)

    def worker(i):
        rng = random.Random(i)
        mine = owned[i]
        try:
            start.wait()
            for _ in range(400):
                if mine and rng.random() < 0.5:
                    k = rng.randint(1, len(mine))
                    rng.shuffle(mine)
                    m.free(mine[:k])
                    del mine[:k]
                else:
                    ids = m.alloc(rng.randint(1, 24))
                    if ids is not None:
                        mine.extend(ids)
        except Exception as exc:               # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    everything = [b for mine in owned for b in mine]
    check_ids(m, kv, everything)
    states = m._blocks.block_states()
    assert m.stats()["allocated"] == len(everything)
    assert sorted(np.flatnonzero(states == 1).tolist()) == sorted(everything)
    m.check_invariants()
    for mine in owned:
        m.free(mine)
    assert m.stats()["allocated"] == 0
    m.check_invariants()
