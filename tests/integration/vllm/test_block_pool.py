"""ElasticBlockPool against vLLM's own BlockPool: the same ids, free-queue order and prefix hits
within one kvcached page, the same admissions across pages, pages mapped only while they hold
blocks, and blocks vLLM touches or unpins kept consistent with kvcached.

Skipped without a supported vLLM (tests/integration/vllm/_vllm_contract.py). Real parts only: vLLM's
KVCacheManager, BlockPool and Requests, kvcached managers on the host backend.
"""

from __future__ import annotations

import pytest
from _procs import wait_until
from _vllm_contract import (
    PAGE,
    PER_PAGE,
    SMALL_BLOCKS,
    TOKENS_PER_BLOCK,
    admit,
    make_request,
    mapped_pages,
    pages_of_held_blocks,
    vllm_manager,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.kv_cache_utils import BlockHash, KVCacheBlock, make_block_hash_with_group_id
from vllm.v1.request import Request

from kvcached import init_kvcached
from kvcached.integration.vllm import ElasticBlockPool, PoolGeometry, set_pool_geometry


prompts = st.lists(st.integers(0, 2), min_size=1, max_size=6 * TOKENS_PER_BLOCK)
steps = st.lists(st.one_of(st.tuples(st.just("add"), prompts), st.tuples(st.just("free"), st.integers(0, 50)),
                           st.tuples(st.just("evict"), st.integers(0, 50)), st.tuples(st.just("reset"))),
                 min_size=1, max_size=40)


def _lockstep(stock: VllmKVCacheManager, elastic: VllmKVCacheManager, ops, *, same_ids: bool,
              same_hits: bool = True) -> None:
    """Run ops on both managers; every admission (success; prefix hit if same_hits; ids if
    same_ids) and the free count must agree, and the elastic pool's invariants hold after
    every step."""
    pool: ElasticBlockPool = elastic.block_pool            # type: ignore[assignment]
    running: list[tuple[Request, Request]] = []
    for n, op in enumerate(ops):
        if op[0] == "add":
            pair = (make_request(str(n), op[1]), make_request(str(n), op[1]))
            expected, got = admit(stock, pair[0]), admit(elastic, pair[1])
            if same_ids:
                assert got == expected, f"step {n}"
            else:
                assert (got[1] is None) == (expected[1] is None), f"step {n}"
                assert got[0] == expected[0] or not same_hits, f"step {n}"
            if got[1] is not None:
                running.append(pair)
        elif op[0] == "free" and running:
            for manager, request in zip((stock, elastic), running.pop(op[1] % len(running))):
                manager.free(request)
        elif op[0] == "evict" and same_ids:      # (an id names different blocks in the two pools otherwise)
            block_ids = {op[1] % stock.block_pool.num_gpu_blocks}
            stock.block_pool.evict_blocks(block_ids)
            pool.evict_blocks(block_ids)
        elif op[0] == "reset":
            assert elastic.reset_prefix_cache() == stock.reset_prefix_cache()
        assert pool.get_num_free_blocks() == stock.block_pool.get_num_free_blocks()
        assert pool.get_usage() == stock.block_pool.get_usage()
        if same_ids and pool.metrics_collector is not None:     # blocks allocated and not evicted since
            seen, expected_seen = pool.metrics_collector, stock.block_pool.metrics_collector
            assert set(seen.block_metrics) == set(expected_seen.block_metrics), f"step {n}"
            assert len(seen.drain_events()) == len(expected_seen.drain_events()), f"step {n}"
        if same_ids:
            assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == \
                   [b.block_id for b in stock.block_pool.free_block_queue.get_all_free_blocks()]
        pool.check_invariants()
        assert mapped_pages(pool) == pages_of_held_blocks(pool)
    for pair in running:
        for manager, request in zip((stock, elastic), pair):
            manager.free(request)
    pool.check_invariants()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=steps, caching=st.booleans(), metrics=st.booleans())
def test_one_page_pool_hands_out_exactly_vllms_ids(vllm_kv, ops, caching, metrics):
    """Within one kvcached page (the standalone geometry: 1024 blocks of 64 bytes a page here)
    every id, free-queue order and prefix hit is vLLM's own, and a metrics collector hears of
    the same allocations and evictions."""
    stock, elastic = (vllm_manager(40, elastic=elastic, caching=caching, metrics=metrics)
                      for elastic in (False, True))
    try:
        _lockstep(stock, elastic, ops, same_ids=True)
    finally:
        elastic.block_pool.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=steps, caching=st.booleans(), keep_cached_pages=st.booleans())
def test_multi_page_pool_admits_as_vllm_does_and_maps_only_held_pages(vllm_kv, ops, caching, keep_cached_pages):
    """Across pages: the same admissions as vLLM's pool; with keep_idle_cached_pages the same
    prefix hits too (without it, pages of only cached blocks go back, and hits may be fewer)."""
    set_pool_geometry(SMALL_BLOCKS)
    stock, elastic = vllm_manager(4 * PER_PAGE, elastic=False, caching=caching), \
        vllm_manager(4 * PER_PAGE, elastic=True, caching=caching)
    elastic.block_pool.keep_idle_cached_pages = keep_cached_pages
    try:
        _lockstep(stock, elastic, ops, same_ids=False, same_hits=keep_cached_pages)
        pool = elastic.block_pool
        if not keep_cached_pages:                           # nothing in use: only the null block's page
            wait_until(lambda: mapped_pages(pool) == 1, what="every page but the null block's unmapped")
        pool.release_free_pages()
        wait_until(lambda: mapped_pages(pool) == 1, what="every page but the null block's unmapped")
        pool.check_invariants()
    finally:
        elastic.block_pool.close()


@pytest.mark.parametrize("layout", ["per_layer", "interleaved"])
@pytest.mark.parametrize("geometry", [SMALL_BLOCKS, PoolGeometry(block_size=2, cell_size=512, num_layers=3)])
def test_freed_blocks_unmap_their_pages(vllm_kv, layout, geometry):
    """Pages are mapped as blocks are taken and unmapped as they empty, cached or not, with any
    layout and number of layers and buffers (ids of one page are found from the manager)."""
    vllm_kv(MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=0, LAYOUT=layout)
    init_kvcached(device="cpu", page_size_bytes=PAGE)
    set_pool_geometry(geometry)
    pool = ElasticBlockPool(512, enable_caching=True, hash_block_size=TOKENS_PER_BLOCK)
    per_page = pool.manager.get_page_occupancy([0])[0][1]
    assert mapped_pages(pool) == 1
    blocks = pool.get_new_blocks(5 * per_page)
    pool.check_invariants()
    assert mapped_pages(pool) == 6 == pages_of_held_blocks(pool)
    for n, block in enumerate(blocks[::2]):                     # half of them become cache entries
        pool._insert_block_hash(make_block_hash_with_group_id(BlockHash(b"c%d" % n), 0), block, num_tokens=4)
    pool.free_blocks(reversed(blocks))
    assert pool.get_num_free_blocks() == 511
    # A free whose pages go back while the allocator's background thread holds its map lock leaves
    # them to that thread to unmap (Note [Deferred unmap]): wait for it.
    wait_until(lambda: mapped_pages(pool) == 1, what="the freed blocks' pages unmapped")
    pool.check_invariants()
    pool.close()


def test_unpinned_blocks_are_reported_reused_before_their_page_goes_back(vllm_kv):
    """unpin_blocks keeps blocks readable until the pool reuses them; giving their page back is
    a reuse, so the reader hears of it before the memory goes."""
    set_pool_geometry(SMALL_BLOCKS)
    pool = ElasticBlockPool(8 * PER_PAGE, enable_caching=True, hash_block_size=TOKENS_PER_BLOCK)
    blocks = pool.get_new_blocks(2 * PER_PAGE)          # the rest of page 0, all of page 1, one of page 2
    on_page_1 = [b for b in blocks if b.block_id // PER_PAGE == 1]
    reused: list = []
    pool.unpin_blocks(on_page_1[:3], reused.append)
    assert reused == [] and mapped_pages(pool) == 3
    pool.free_blocks(on_page_1[3:])                     # page 1 now holds only unpinned blocks
    assert sorted(b.block_id for b in reused) == [b.block_id for b in on_page_1[:3]] and mapped_pages(pool) == 2
    pool.check_invariants()
    pool.close()


@pytest.mark.parametrize("victim_page", [0, 3])
def test_touching_a_free_block_claims_that_id_from_kvcached(vllm_kv, victim_page):
    """vLLM's touch() may take any free block as a hit (its tests and connectors do): the pool
    then has kvcached hold that very id, so it is never handed out twice."""
    set_pool_geometry(SMALL_BLOCKS)
    pool = ElasticBlockPool(8 * PER_PAGE, enable_caching=True, hash_block_size=TOKENS_PER_BLOCK)
    victim = pool.blocks[victim_page * PER_PAGE + 5]
    pool.touch([victim])
    assert victim.ref_cnt == 1 and pool._held[victim.block_id] and not pool._borrowed
    pool.check_invariants()
    assert mapped_pages(pool) == pages_of_held_blocks(pool) == (1 if victim_page == 0 else 2)
    taken = pool.get_new_blocks(pool.get_num_free_blocks())
    assert victim.block_id not in {block.block_id for block in taken}
    pool.free_blocks(taken + [victim])
    pool.check_invariants()
    pool.close()


def _pool_with_a_borrowed_block() -> tuple[ElasticBlockPool, KVCacheBlock]:
    """A caching pool whose limit covers only the null block's page, and a free block on another
    page touched as a prefix hit: kvcached cannot back it now, so it is borrowed."""
    set_pool_geometry(SMALL_BLOCKS)
    pool = ElasticBlockPool(8 * PER_PAGE, enable_caching=True, hash_block_size=TOKENS_PER_BLOCK)
    pool.manager.set_memory_limit(PAGE, revision=1)          # only the null block's page
    victim = pool.blocks[3 * PER_PAGE]
    pool.touch([victim])
    assert pool._borrowed == {victim.block_id}
    return pool, victim


def test_a_touched_block_kvcached_cannot_back_now_is_borrowed_not_double_allocated(vllm_kv):
    pool, victim = _pool_with_a_borrowed_block()
    pool.check_invariants()
    # kvcached's share is counted less the borrowed id (it may be among what kvcached hands out).
    assert pool.get_num_free_blocks() == PER_PAGE - 2
    taken = pool.get_new_blocks(PER_PAGE - 2)
    pool.manager.set_memory_limit(-1, revision=2)            # kvcached may now hand out the id
    more = pool.get_new_blocks(pool.get_num_free_blocks())
    handed_out = [block.block_id for block in taken + more]
    assert victim.block_id not in handed_out and len(set(handed_out)) == len(handed_out)
    assert not pool._borrowed and pool._held[victim.block_id]   # backed for its user once handed to us
    pool.free_blocks(taken + more + [victim])
    pool.check_invariants()
    pool.close()


def test_unpinning_a_borrowed_block_leaves_a_plain_free_block(vllm_kv):
    """A borrowed block that unpin_blocks frees is free in kvcached: counted as a free block
    kvcached may hand out, and its reader hears of it when it is handed out."""
    pool, victim = _pool_with_a_borrowed_block()
    reused: list = []
    pool.unpin_blocks([victim], reused.append)
    assert not pool._borrowed and victim.ref_cnt == 0
    pool.check_invariants()
    assert pool.get_num_free_blocks() == PER_PAGE - 1
    pool.manager.set_memory_limit(-1, revision=2)
    taken = pool.get_new_blocks(pool.get_num_free_blocks())
    assert victim in taken and reused == [victim]
    pool.free_blocks(taken)
    pool.check_invariants()
    pool.close()
