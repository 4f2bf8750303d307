"""BlockAllocator on the host backend: placement policy, the available contract, bad input,
zero-copy variants, try_to_reserve, clear, and data integrity through real memory."""

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcached.core import BlockAllocator, PageAllocator
from kvcached.errors import BlockStateError, KVCachedConfigError

from _stacks import GRANULARITY, make_table, state_of

KIB = 1 << 10


def page_of(s, b):
    return b * s.blocks.id_to_page_num // s.blocks.id_to_page_den


def test_dense_intervals_skip_straddling_blocks(stack_factory):
    s = stack_factory(num_pages=4, block_bytes=24 * KIB)          # 64 KiB pages, 24 KiB blocks
    states = s.blocks.block_states()
    # block 2 covers [48, 72) KiB: straddles pages 0 and 1
    assert states[2] == 2 and states[0] == 0 and states[1] == 0
    assert s.blocks.total_blocks == int((states == 0).sum())
    ids = s.blocks.alloc(s.blocks.available_blocks())
    assert 2 not in ids and len(set(ids)) == len(ids)
    s.blocks.check_invariants()


def test_pages_with_no_block_are_never_mapped(stack_factory):
    # 40 KiB blocks over 64 KiB pages: page 2 ([128, 192) KiB) holds no whole block
    s = stack_factory(num_pages=6, block_bytes=40 * KIB, capacity_granules=None)
    occ = s.blocks.page_occupancy(range(6))
    assert occ[2] == (0, 0)
    ids = s.blocks.alloc(s.blocks.available_blocks())
    assert ids is not None
    assert 2 not in s.table.mapped_page_ids()
    s.blocks.check_invariants()


def test_best_fit_then_emptiest_first(stack_factory):
    s = stack_factory(num_pages=8, block_bytes=8 * KIB, capacity_granules=None, max_reserved=8)  # 8 per page
    a = s.blocks.alloc(8)               # page 0 full
    b = s.blocks.alloc(8)               # page 1 full
    c = s.blocks.alloc(8)               # page 2 full
    s.blocks.free(a[:5])                # page 0: 5 free
    s.blocks.free(b[:2])                # page 1: 2 free
    s.blocks.free(c[:7])                # page 2: 7 free
    # fits in one page: the page with the fewest free slots that still holds 2 -> page 1
    got = s.blocks.alloc(2)
    assert {page_of(s, x) for x in got} == {1}
    # 4 fits page 0 (5 free) and page 2 (7 free): best fit is page 0
    got = s.blocks.alloc(4)
    assert {page_of(s, x) for x in got} == {0}
    # 8 > any page's free count (page 0: 1, page 2: 7): emptiest first (page 2), remainder best fit
    got = s.blocks.alloc(8)
    assert sorted(page_of(s, x) for x in got) == [0] + [2] * 7
    assert s.table.mapped_page_ids() == [0, 1, 2]     # no new page was needed
    s.blocks.check_invariants()


def test_new_pages_fill_partials_then_in_order(stack_factory):
    s = stack_factory(num_pages=8, block_bytes=8 * KIB, capacity_granules=None)
    a = s.blocks.alloc(6)                                # page 0: 2 free
    got = s.blocks.alloc(12)                             # 2 from page 0, then 8 + 2 on new pages
    pages = [page_of(s, x) for x in got]
    assert pages.count(0) == 2 and len(set(got)) == 12 and len(set(pages)) == 3
    assert s.pages.stats()["in_use"] == 3
    s.blocks.free(a + got)
    assert s.pages.stats()["in_use"] == 0
    s.blocks.check_invariants()


@pytest.mark.parametrize("block_kib", [8, 16, 24, 40])
@pytest.mark.parametrize("limit", [None, 3])
def test_available_blocks_contract(stack_factory, block_kib, limit):
    s = stack_factory(num_pages=12, capacity_granules=7, block_bytes=block_kib * KIB, max_reserved=2)
    if limit is not None:
        s.pages.set_limit_pages(limit)
    held = s.blocks.alloc(3)
    s.blocks.free(held[:1])
    for _ in range(3):
        n = s.blocks.available_blocks()
        before = state_of(s)
        assert s.blocks.alloc(n + 1) is None
        assert state_of(s) == before
        got = s.blocks.alloc(n)
        assert got is not None and len(set(got)) == n
        assert s.blocks.available_blocks() == 0 and s.blocks.alloc(1) is None
        s.blocks.check_invariants()
        s.blocks.free(got[: n // 2])
    s.blocks.check_invariants()


def test_sparse_ids(stack_factory):
    s = stack_factory(num_pages=6, block_bytes=None, sparse=(100, 7), capacity_granules=None)
    ids = s.blocks.alloc(10)
    assert sorted(ids) == list(range(7)) + [100, 101, 102]
    with pytest.raises(BlockStateError):
        s.blocks.free([7])                               # in no page's interval
    s.blocks.free(ids)
    s.blocks.check_invariants()


def test_free_errors_change_nothing(stack_factory):
    s = stack_factory(num_pages=8, block_bytes=16 * KIB)
    ids = s.blocks.alloc(6)
    s.blocks.try_to_reserve(2)
    held = [b for b, st in enumerate(s.blocks.block_states()) if st == 3]
    before = state_of(s)
    for bad in ([ids[0], ids[0]],                        # repeated in one call
                [ids[1], -1],                            # negative
                [ids[2], s.blocks.max_block_id],         # out of range
                [ids[3], 2 ** 40],                       # not an int32
                [ids[4], 30],                            # valid id, never allocated
                [ids[5], held[0]]):                      # held by try_to_reserve
        with pytest.raises(BlockStateError):
            s.blocks.free(bad)
        assert state_of(s) == before
    with pytest.raises(BlockStateError):
        s.blocks.free_from(np.array([ids[0], ids[0]], dtype=np.int32))
    assert state_of(s) == before
    with pytest.raises(TypeError):
        s.blocks.free(["x"])
    assert state_of(s) == before
    s.blocks.free(ids)
    with pytest.raises(BlockStateError):
        s.blocks.free(ids[:1])                           # double free
    with pytest.raises(ValueError):
        s.blocks.alloc(-1)
    with pytest.raises(ValueError):
        s.blocks.try_to_reserve(-1)
    assert s.blocks.alloc(0) == []
    s.blocks.check_invariants()


def test_constructor_validation(host_backend):
    table, _ = make_table(host_backend, 4)
    pages = PageAllocator(table)
    with pytest.raises(KVCachedConfigError):
        BlockAllocator(pages, [0, 4, 8], [4, 4, 4], 1, 4, 16)            # wrong length
    with pytest.raises(KVCachedConfigError):
        BlockAllocator(pages, [0, 4, 8, 12], [4, 4, 4, 5], 1, 4, 17)     # id 16 maps to page 4
    with pytest.raises(KVCachedConfigError):
        BlockAllocator(pages, [0, 4, 8, 12], [4, 4, 4, 4], 1, 4, 15)     # past max_block_id
    with pytest.raises(KVCachedConfigError):
        BlockAllocator(pages, [0, 4, 8, 12], [4, 4, -1, 4], 1, 4, 16)
    with pytest.raises(KVCachedConfigError):
        BlockAllocator(pages, [0, 4, 8, 12], [4, 4, 4, 4], 0, 4, 16)
    ok = BlockAllocator(pages, [0, 4, 8, 12], [4, 4, 4, 4], 1, 4, 16)
    assert ok.total_blocks == 16
    with pytest.raises(KVCachedConfigError):                             # already bound
        BlockAllocator(pages, [0, 4, 8, 12], [4, 4, 4, 4], 1, 4, 16)


def test_alloc_into_and_free_from(stack_factory):
    torch = pytest.importorskip("torch")
    s = stack_factory(num_pages=8, block_bytes=16 * KIB)
    buf = np.empty(9, dtype=np.int32)
    assert s.blocks.alloc_into(buf) is True
    assert len(set(buf.tolist())) == 9
    t = torch.empty(5, dtype=torch.int32)
    assert s.blocks.alloc_into(t) is True
    assert not set(t.tolist()) & set(buf.tolist())
    big = np.empty(1000, dtype=np.int32)
    before = state_of(s)
    assert s.blocks.alloc_into(big) is False
    assert state_of(s) == before
    s.blocks.free_from(buf)
    s.blocks.free_from(t)
    assert s.blocks.stats()["allocated"] == 0
    with pytest.raises(ValueError):
        s.blocks.alloc_into(np.empty(4, dtype=np.int64))
    s.blocks.check_invariants()


def test_try_to_reserve_and_free_reserved(stack_factory):
    s = stack_factory(num_pages=8, capacity_granules=4, block_bytes=16 * KIB, max_reserved=0)  # 4 per page
    assert s.blocks.try_to_reserve(6) is True
    assert s.table.mapped_page_ids() == [0, 1]
    assert s.blocks.available_blocks() == 16
    before = state_of(s)
    assert s.blocks.try_to_reserve(11) is False
    assert state_of(s) == before
    got = s.blocks.alloc(4)                              # from the held blocks, no page work
    assert s.pages.stats()["num_maps"] == 2
    assert s.blocks.stats()["held"] == 2
    s.blocks.free_reserved()
    assert s.blocks.stats()["held"] == 0
    s.blocks.free(got)
    assert s.table.mapped_page_ids() == []
    s.blocks.check_invariants()


def test_clear_frees_everything(stack_factory):
    s = stack_factory(num_pages=8, block_bytes=16 * KIB, max_reserved=1)
    s.blocks.alloc(7)
    s.blocks.try_to_reserve(3)
    s.blocks.clear()
    st = s.blocks.stats()
    assert st["allocated"] == 0 and st["held"] == 0 and st["owned_pages"] == 0
    assert len(s.table.mapped_page_ids()) == 1           # one page kept in the pool
    s.blocks.check_invariants()


def test_resize_refuses_below_live_pages(stack_factory):
    s = stack_factory(num_pages=8, block_bytes=16 * KIB, capacity_granules=None)
    ids = s.blocks.alloc(12)                             # pages 0..2
    before = state_of(s)
    assert s.blocks.resize(2) is False
    assert state_of(s) == before
    with pytest.raises(KVCachedConfigError):
        s.blocks.resize(9)
    assert s.blocks.resize(3) is True
    assert s.blocks.alloc(1) is None and s.blocks.available_blocks() == 0
    assert s.blocks.resize(8) is True
    assert s.blocks.available_blocks() == 20
    s.blocks.free(ids)
    s.blocks.check_invariants()


@pytest.mark.parametrize("segments", [1, 4])
@pytest.mark.parametrize("block_kib", [16, 24])
def test_data_integrity_through_real_memory(stack_factory, segments, block_kib):
    """Write a distinct pattern into every live block of every segment (a per_layer-like setup
    with `segments` buffers), churn, and check that no live block changed or shares memory."""
    torch = pytest.importorskip("torch")
    block = block_kib * KIB
    s = stack_factory(num_pages=12, capacity_granules=None, segments=segments, block_bytes=block,
                      max_reserved=1)
    views = [r.tensor() for r in s.ranges]
    rng = np.random.default_rng(7)
    live = {}                                            # block id -> stamp
    stamp = 0

    def write(b, value):
        for seg, v in enumerate(views):
            v[b * block:(b + 1) * block].fill_((value * 7 + seg) % 251)

    def check():
        for b, value in live.items():
            for seg, v in enumerate(views):
                want = (value * 7 + seg) % 251
                chunk = v[b * block:(b + 1) * block]
                assert int(chunk.min()) == want == int(chunk.max()), f"block {b} segment {seg} changed"

    for step in range(60):
        if live and rng.random() < 0.45:
            victims = rng.choice(sorted(live), size=int(rng.integers(1, len(live) + 1)), replace=False).tolist()
            s.blocks.free(victims)
            for b in victims:
                del live[b]
        else:
            got = s.blocks.alloc(int(rng.integers(1, 9)))
            if got is None:
                continue
            for b in got:
                assert b not in live
                stamp += 1
                live[b] = stamp
                write(b, stamp)
        check()
        s.blocks.check_invariants()
    # no two live blocks overlap in bytes (distinct ids of one size never do; spell it out)
    spans = sorted((b * block, (b + 1) * block) for b in live)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_bools_are_refused_and_numpy_ints_accepted(stack_factory):
    s = stack_factory(num_pages=8, capacity_granules=None, block_bytes=16 * KIB)
    ids = s.blocks.alloc(np.int64(3))
    assert ids is not None and len(ids) == 3
    before = state_of(s)
    for call in (lambda: s.blocks.alloc(True), lambda: s.blocks.try_to_reserve(np.bool_(True)),
                 lambda: s.blocks.free([True]), lambda: s.blocks.free([ids[0], False]),
                 lambda: s.blocks.alloc_into(np.zeros(2, np.bool_)), lambda: s.blocks.free_from(np.ones(1, np.bool_))):
        with pytest.raises(TypeError, match="bool"):
            call()
        assert state_of(s) == before
    s.blocks.free([np.int32(b) for b in ids])
    assert s.blocks.stats()["allocated"] == 0
    s.blocks.check_invariants()


# -- counts past int32 and ids past int64 (the contract: more than available is None) ---------

def _huge_counts():
    """Counts no allocator can hold (>= 2**31), as ints and, where they fit, numpy ints."""
    ints = st.one_of(st.sampled_from([2**31, 2**31 + 1, 2**32, 2**63 - 1, 2**63, 2**64, 2**64 + 1, 2**200]),
                     st.integers(min_value=2**31, max_value=2**80))

    def wrap(n: int, kind: str):
        if kind == "numpy" and n < 2**63:
            return np.int64(n)
        if kind == "numpy" and n < 2**64:
            return np.uint64(n)
        return n
    return st.builds(wrap, ints, st.sampled_from(["int", "numpy"]))


def test_huge_counts_return_none_and_change_nothing(stack_factory):
    s = stack_factory(num_pages=8, capacity_granules=None, block_bytes=16 * KIB)
    live = s.blocks.alloc(3)

    @settings(max_examples=80, deadline=None)
    @given(n=_huge_counts())
    def check(n):
        before, failed = state_of(s), s.blocks.stats()["num_failed_allocs"]
        assert s.blocks.alloc(n) is None
        assert s.blocks.try_to_reserve(n) is False
        assert state_of(s) == before
        assert s.blocks.stats()["num_failed_allocs"] == failed + 2
        neg = -int(n)
        for call, name in ((s.blocks.alloc, "alloc"), (s.blocks.try_to_reserve, "try_to_reserve")):
            with pytest.raises(ValueError, match=rf"{name}\(n={neg}\): n must be >= 0"):
                call(neg)
        with pytest.raises(BlockStateError, match=rf"block id {int(n)} is not a block id"):
            s.blocks.free([live[0], n])
        assert state_of(s) == before
        s.blocks.check_invariants()

    check()
    # just past what it holds: None as well, without a buffer sized by the request
    assert s.blocks.alloc(s.blocks.total_blocks + 1) is None
    assert s.blocks.alloc(2**31 - 1) is None and s.blocks.try_to_reserve(2**31 - 1) is False
    s.blocks.free(live)
    s.blocks.check_invariants()


# -- host memory of the bookkeeping: built in O(pages) beyond its own arrays, refused when they do
# not fit. A child process with its address space capped a few GiB above its size after import:
# before the check, construction allocated ~32 bytes per block in numpy temporaries and died with
# MemoryError there (or was killed by the OOM killer without a cap).

_CAPPED_PRELUDE = """
import json, resource, sys, time
import numpy as np
from kvcached.core import BlockAllocator, PageAllocator
from kvcached.core import PageTable
from kvcached.core import HostBackend
from kvcached.errors import KVCachedConfigError

def vm_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()

def rss_peak_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

def dense_allocator(num_pages, ids_per_page, max_block_id):
    backend = HostBackend(64 << 10, None)
    rng = backend.reserve(num_pages * (64 << 10))
    table = PageTable(backend, [(rng, 0)], 64 << 10, num_pages, False)
    pages = PageAllocator(table, None, min_reserved=0, max_reserved=0, idle_trim_s=0.0)
    first = np.arange(num_pages, dtype=np.int64) * ids_per_page
    count = np.clip(max_block_id - first, 0, ids_per_page)
    return BlockAllocator(pages, first, count, 1, ids_per_page, max_block_id), pages

resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + HEADROOM, resource.getrlimit(resource.RLIMIT_AS)[1]))
rss0 = rss_peak_bytes()
t0 = time.perf_counter()
"""


def run_capped(body: str, headroom_bytes: int) -> dict:
    """Run `body` after _CAPPED_PRELUDE in a child; it prints one JSON object, returned here."""
    import json
    import os
    import subprocess
    import sys

    code = _CAPPED_PRELUDE.replace("HEADROOM", str(headroom_bytes)) + body
    env = {**os.environ, "KVCACHED_DEBUG_CHECKS": "0"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_too_large_an_allocator_is_refused_before_allocating():
    # 2**31 - 1 ids need ~19 GiB of bookkeeping; the child may map 3 GiB more
    out = run_capped("""
try:
    dense_allocator(2048, 1 << 20, 2**31 - 1)
    print(json.dumps({"error": None}))
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc), "s": time.perf_counter() - t0,
                      "rss_growth": rss_peak_bytes() - rss0}))
""", headroom_bytes=3 << 30)
    assert out["error"] == "KVCachedConfigError", out
    message = out["message"]
    assert "2147483647 blocks" in message and "num_blocks" in message, message
    assert re.search(r"need \d+ bytes \(.* GiB\) of host memory .* bytes are left under the RLIMIT_AS limit", message)
    assert out["s"] < 10, out                               # refused up front, not after a long fill
    assert out["rss_growth"] < 64 << 20, out                # nothing per block was allocated


def test_large_allocator_builds_in_its_own_arrays_only():
    # 2**28 ids: 256 MiB of block states and the id-object table in memory; the free stacks and
    # the held stack (8 bytes per id) only reserved, touched as pages are used
    out = run_capped("""
blocks, pages = dense_allocator(2048, 1 << 17, 1 << 28)
grown = rss_peak_bytes() - rss0
ids = blocks.alloc((1 << 17) + 5)
ok = ids is not None and len(set(ids)) == (1 << 17) + 5
blocks.free(ids)
huge = blocks.alloc(2**31 - 1)
blocks.close()
print(json.dumps({"ok": ok, "huge": huge, "rss_growth": grown, "total": blocks.stats()["total_blocks"]}))
""", headroom_bytes=4 << 30)
    assert out["ok"] and out["huge"] is None and out["total"] == 1 << 28, out
    assert out["rss_growth"] < (1 << 28) * 5 // 4 + (96 << 20), out     # ~1 byte per id, not ~32


def test_block_slots_are_made_only_by_a_block_allocator():
    """BlockSlots is the allocator's bookkeeping, never made on its own (its arrays would be NULL)."""
    from kvcached.core.blockalloc import BlockSlots

    with pytest.raises(TypeError, match="make a BlockAllocator"):
        BlockSlots()
