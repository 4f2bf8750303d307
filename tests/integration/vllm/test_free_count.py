"""ElasticBlockPool's free count is honest: exactly what get_new_blocks can hand out through every
change of the pool, under a limit lowered between vLLM's count and its allocation, mid-run, and
under a global budget shared with another holder (in this process or another).

Skipped without a supported vLLM (tests/integration/vllm/_vllm_contract.py). Real parts only: vLLM's
KVCacheManager and Requests, kvcached managers on the host backend, a budget segment shared with
a second process.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap

import pytest
from _procs import unique_name
from _vllm_contract import (
    PAGE,
    PER_PAGE,
    SMALL_BLOCKS,
    TOKENS_PER_BLOCK,
    admit,
    make_request,
    mapped_pages,
    vllm_manager,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id
from vllm.v1.request import Request

from kvcached.errors import KVCachedConfigError, KVCachedError
from kvcached.integration.vllm import ElasticBlockPool, PoolGeometry, set_pool_geometry


pool_ops = st.lists(st.one_of(
    st.tuples(st.just("take"), st.integers(0, 3 * PER_PAGE)),     # up to that many, within the count
    st.tuples(st.just("free"), st.integers(0, 10**6)),             # one reference of a block in use
    st.tuples(st.just("cache"), st.integers(0, 10**6)),            # a prefix-cache entry for a block in use
    st.tuples(st.just("touch"), st.integers(1, 8 * PER_PAGE - 1)),  # any block as a prefix hit
    st.tuples(st.just("unpin"), st.integers(0, 10**6)),            # one reference, readable until reused
    st.tuples(st.just("limit"), st.integers(-1, 8))), max_size=40)   # in pages, -1 none


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=pool_ops)
def test_free_count_stays_exact_through_every_change_of_the_pool(vllm_kv, ops):
    """Through blocks taken, freed, cached, touched as hits (free ones included: claimed or
    borrowed), unpinned and limits moved, the pool's invariants hold after every step
    (check_invariants), all of the free count can be taken, and exactly that much while no block
    is borrowed (Note [Claiming a block])."""
    set_pool_geometry(SMALL_BLOCKS)
    pool = ElasticBlockPool(8 * PER_PAGE, enable_caching=True, hash_block_size=TOKENS_PER_BLOCK)
    in_use: list = []           # one entry per reference this test holds
    try:
        for n, op in enumerate(ops):
            if op[0] == "take":
                in_use += pool.get_new_blocks(min(op[1], pool.get_num_free_blocks()))
            elif op[0] == "touch":
                pool.touch([pool.blocks[op[1]]])
                in_use.append(pool.blocks[op[1]])
            elif op[0] == "limit":
                pool.manager.set_memory_limit(op[1] * PAGE if op[1] >= 0 else -1, revision=n + 1)
            elif in_use and op[0] == "cache":
                pool._insert_block_hash(make_block_hash_with_group_id(BlockHash(b"s%d" % n), 0),
                                        in_use[op[1] % len(in_use)], num_tokens=TOKENS_PER_BLOCK)
            elif in_use and op[0] == "free":
                pool.free_blocks([in_use.pop(op[1] % len(in_use))])
            elif in_use and op[0] == "unpin":
                pool.unpin_blocks([in_use.pop(op[1] % len(in_use))], lambda block: None)
            pool.check_invariants()
        borrowed = bool(pool._borrowed)
        num_free = pool.get_num_free_blocks()
        assert len(pool.get_new_blocks(num_free)) == num_free
        assert pool.get_num_free_blocks() == 0 or borrowed
        while num_free := pool.get_num_free_blocks():
            assert len(pool.get_new_blocks(num_free)) == num_free
        with pytest.raises(ValueError):
            pool.get_new_blocks(1)
        pool.check_invariants()
    finally:
        pool.close()


def pool_with_cached_free_blocks(held: int, cached: int, seed: int) -> ElasticBlockPool:
    """A caching pool that took `held` blocks and freed half of them (shuffled by `seed`), the
    first `cached` of them keeping a prefix-cache entry (free, held, counted as free)."""
    import random

    set_pool_geometry(SMALL_BLOCKS)
    pool = ElasticBlockPool(8 * PER_PAGE, enable_caching=True, hash_block_size=TOKENS_PER_BLOCK)
    try:
        blocks = pool.get_new_blocks(held)
        random.Random(seed).shuffle(blocks)
        for n, block in enumerate(blocks[:cached]):
            pool._insert_block_hash(make_block_hash_with_group_id(BlockHash(b"h%d" % n), 0), block,
                                    num_tokens=TOKENS_PER_BLOCK)
        pool.free_blocks(blocks[:len(blocks) // 2])
    except BaseException:
        pool.close()
        raise
    return pool


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(held=st.integers(0, 6 * PER_PAGE), cached=st.integers(0, 100), limit_pages=st.integers(0, 9),
       seed=st.integers(0, 2**32 - 1))
def test_free_count_is_exactly_what_get_new_blocks_can_hand_out(vllm_kv, held, cached, limit_pages, seed):
    pool = pool_with_cached_free_blocks(held, cached, seed)
    try:
        pool.manager.set_memory_limit(limit_pages * PAGE, revision=1)
        num_free = pool.get_num_free_blocks()
        assert num_free <= pool.free_block_queue.num_free_blocks
        taken = pool.get_new_blocks(num_free)
        assert len({b.block_id for b in taken}) == num_free and all(b.ref_cnt == 1 for b in taken)
        assert pool.get_num_free_blocks() == 0
        before = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        with pytest.raises(ValueError):
            pool.get_new_blocks(1)
        assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == before
        pool.check_invariants()
    finally:
        pool.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(held=st.integers(0, 4 * PER_PAGE), cached=st.integers(0, 100), limit_pages=st.integers(0, 6),
       extra=st.integers(0, 3 * PER_PAGE), seed=st.integers(0, 2**32 - 1))
def test_a_limit_lowered_between_the_count_and_the_allocation(vllm_kv, held, cached, limit_pages, extra, seed):
    """vLLM counts, then allocates; a limit lowered in between (the tracker's watcher thread) is
    the race of Note [Honest free count]: get_new_blocks(n) for the count taken before succeeds
    exactly when the count taken after still covers n (falling back on held cached blocks), and
    otherwise raises ValueError with the pool, its free queue and kvcached unchanged."""
    pool = pool_with_cached_free_blocks(held, cached, seed)
    try:
        wanted = min(pool.get_num_free_blocks(), extra)                 # vLLM's admission
        pool.manager.set_memory_limit(limit_pages * PAGE, revision=1)   # ... another thread, meanwhile
        covered = wanted <= pool.get_num_free_blocks()
        queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        allocated, held_before = pool.manager.stats()["allocated"], bytes(pool._held)
        if covered:
            taken = pool.get_new_blocks(wanted)
            assert len({b.block_id for b in taken}) == wanted and all(b.ref_cnt == 1 for b in taken)
        else:
            with pytest.raises(ValueError, match=f"Cannot get {wanted} free blocks"):
                pool.get_new_blocks(wanted)
            assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == queue
            assert pool.manager.stats()["allocated"] == allocated and bytes(pool._held) == held_before
        pool.check_invariants()
    finally:
        pool.close()


def test_lowered_limit_mid_run_shrinks_admission_and_never_raises(vllm_kv):
    """A vLLM KVCacheManager with prefix caching serves a stream of requests; then the limit
    drops to 2 pages: the pool gives back its cached pages and the free count drops with them,
    admission returns None instead of raising, and no page is mapped beyond the limit's share."""
    import random
    import time

    set_pool_geometry(SMALL_BLOCKS)
    manager = vllm_manager(8 * PER_PAGE, elastic=True)
    pool: ElasticBlockPool = manager.block_pool            # type: ignore[assignment]
    pool.keep_idle_cached_pages = True                     # the cache keeps its pages until the limit
    rng = random.Random(7)

    def stream(num_requests: int, running: list[Request]) -> int:
        refused = 0
        for n in range(num_requests):
            request = make_request(f"{len(running)}-{n}-{rng.random()}", [rng.randrange(3) for _ in
                                                                       range(rng.randrange(1, 80))])
            if admit(manager, request)[1] is None:          # must never raise
                refused += 1
            else:
                running.append(request)
            while running and (len(running) > 12 or rng.random() < 0.4):
                manager.free(running.pop(rng.randrange(len(running))))
            pool.check_invariants()
        return refused

    running: list[Request] = []
    stream(150, running)
    while running:
        manager.free(running.pop())
    before, pages_before = pool.get_num_free_blocks(), mapped_pages(pool)
    assert pages_before > 2                                  # cached blocks keep pages mapped
    assert pool.manager.set_memory_limit(2 * PAGE, revision=1)["status"] == "deferred"
    deadline = time.monotonic() + 60
    while pool.get_num_free_blocks() >= before:              # the next frees notice the limit
        assert time.monotonic() < deadline, "the pool never followed the lowered limit"
        pool.free_blocks([])
    assert mapped_pages(pool) <= 2 and pool.manager.memory_limit()["status"] == "applied"
    assert stream(250, running) > 0
    assert mapped_pages(pool) <= 2
    for request in running:
        manager.free(request)
    pool.check_invariants()
    pool.close()


def test_budget_shared_with_another_holder(vllm_kv):
    """Under KVCACHED_GLOBAL_BUDGET another holder of the budget takes memory: the pool's free
    count drops to what is left, all of it can be allocated, and it grows back on release."""
    from kvcached.shm.budget import Budget, delete_budget

    name = unique_name("vllm")
    vllm_kv(MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=0, GLOBAL_BUDGET=name, GLOBAL_BUDGET_BYTES=8 * PAGE)
    set_pool_geometry(SMALL_BLOCKS)
    try:
        pool = ElasticBlockPool(16 * PER_PAGE, enable_caching=True, hash_block_size=TOKENS_PER_BLOCK)
        assert pool.get_num_free_blocks() == 8 * PER_PAGE - 1            # the null block holds page 0
        with Budget.open(name) as other:
            assert other.try_acquire(3 * PAGE)
            assert pool.get_num_free_blocks() == 5 * PER_PAGE - 1
            blocks = pool.get_new_blocks(5 * PER_PAGE - 1)
            assert pool.get_num_free_blocks() == 0
            with pytest.raises(ValueError):
                pool.get_new_blocks(1)
            pool.free_blocks(blocks[PER_PAGE - 1:])
            other.release(3 * PAGE)
            assert pool.get_num_free_blocks() == 8 * PER_PAGE - PER_PAGE
        pool.check_invariants()
        pool.close()
    finally:
        with contextlib.suppress(KVCachedError):
            delete_budget(name, force=True)


def test_a_second_process_sharing_the_budget_lowers_the_free_count(vllm_kv):
    from kvcached.shm.budget import delete_budget

    name = unique_name("vllm")
    vllm_kv(MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=0, GLOBAL_BUDGET=name, GLOBAL_BUDGET_BYTES=8 * PAGE)
    set_pool_geometry(SMALL_BLOCKS)
    other = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from kvcached.shm.budget import Budget
        with Budget.open({name!r}) as budget:
            assert budget.try_acquire({4 * PAGE})
            print("held", flush=True)
            sys.stdin.readline()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pool = ElasticBlockPool(16 * PER_PAGE, enable_caching=False, hash_block_size=TOKENS_PER_BLOCK)
        assert other.stdout.readline().strip() == "held"
        assert pool.get_num_free_blocks() == 4 * PER_PAGE - 1            # 8 pages: ours 1, theirs 4
        assert len(pool.get_new_blocks(4 * PER_PAGE - 1)) == 4 * PER_PAGE - 1
        assert pool.get_num_free_blocks() == 0
        pool.check_invariants()
        pool.close()
    finally:
        other.communicate("\n", timeout=60)
        with contextlib.suppress(KVCachedError):
            delete_budget(name, force=True)


def test_reset_prefix_cache_works_under_a_limit(vllm_kv):
    set_pool_geometry(SMALL_BLOCKS)
    manager = vllm_manager(4 * PER_PAGE, elastic=True)
    pool: ElasticBlockPool = manager.block_pool            # type: ignore[assignment]
    request = make_request("a", [1] * (10 * TOKENS_PER_BLOCK))
    assert admit(manager, request)[1] is not None
    manager.free(request)
    pool.manager.set_memory_limit(PAGE, revision=1)
    assert pool.get_num_free_blocks() < pool.free_block_queue.num_free_blocks
    assert pool.reset_prefix_cache()
    pool.check_invariants()
    pool.close()


def test_pool_geometry_for_another_size_is_refused(vllm_kv):
    set_pool_geometry(PoolGeometry(block_size=1, cell_size=1024, num_layers=1, num_kv_buffers=1, num_blocks=99))
    with pytest.raises(KVCachedConfigError, match="num_blocks=99"):
        ElasticBlockPool(100, enable_caching=True, hash_block_size=TOKENS_PER_BLOCK)
    with pytest.raises(KVCachedConfigError):
        set_pool_geometry("16 blocks")                                   # type: ignore[arg-type]
    with pytest.raises(KVCachedConfigError, match="cell_size"):
        PoolGeometry(block_size=1, cell_size=0, num_layers=1)
