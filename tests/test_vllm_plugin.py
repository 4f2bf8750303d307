"""Contract tests of kvcached.integration.vllm against vLLM's own scheduler-side classes.

Skipped without vLLM (the main CI venv has none; the vLLM venv runs them). Real parts only:
vLLM's KVCacheManager, BlockPool and Requests, kvcached managers on the host backend, a budget
segment shared with a second holder, subprocesses for what must not leak into this process.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcached.errors import KVCachedConfigError, KVCachedError
from kvcached.integration.vllm.version import SUPPORTED_VLLM, check_vllm_version

try:
    check_vllm_version()
except KVCachedConfigError as exc:
    pytest.skip(str(exc), allow_module_level=True)

import torch
import vllm.v1.core.block_pool as vllm_block_pool
import vllm.v1.core.kv_cache_coordinator as vllm_coordinator
from _procs import unique_name
from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
from vllm.platforms import current_platform
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
    make_block_hash_with_group_id,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import Request

from kvcached import init_kvcached
from kvcached.integration.vllm import (
    ElasticBlockPool,
    PoolGeometry,
    allocate_kv_cache,
    disable,
    enable,
    is_enabled,
    pool_geometry,
    set_pool_geometry,
)

STOCK_BLOCK_POOL = vllm_block_pool.BlockPool
PAGE = 64 << 10                     # 64 KiB pages: small pools span several of them
SMALL_BLOCKS = PoolGeometry(block_size=1, cell_size=1024, num_layers=1, num_kv_buffers=1)    # 64 blocks a page
PER_PAGE = PAGE // 1024
TOKENS_PER_BLOCK = 4
ENTRY_POINT = "kvcached = kvcached.integration.vllm:register"      # as pyproject.toml declares it


@pytest.fixture
def kv(kv_env):
    """kvcached on the host backend with 64 KiB pages and no reserved pool (mapped pages = pages
    holding blocks); no geometry set, nothing enabled, before and after."""
    kv_env(MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=0)
    init_kvcached(device="cpu", page_size_bytes=PAGE)
    init_none_hash(sha256)
    yield kv_env
    set_pool_geometry(None)
    disable()


def _vllm_manager(num_blocks: int, *, elastic: bool, caching: bool = True,
                  metrics: bool = False) -> VllmKVCacheManager:
    """vLLM's scheduler-side KVCacheManager over one full-attention group, with vLLM's pool or
    ours (built through enable(), the way the scheduler gets it); metrics: a collector that
    samples every block."""
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=TOKENS_PER_BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    if elastic:
        enable(worker=False)
    try:
        manager = VllmKVCacheManager(config, max_model_len=4096, scheduler_block_size=TOKENS_PER_BLOCK,
                                     hash_block_size=TOKENS_PER_BLOCK, enable_caching=caching,
                                     metrics_collector=KVCacheMetricsCollector(sample_rate=1.0) if metrics else None)
    finally:
        disable()
    assert isinstance(manager.block_pool, ElasticBlockPool) == elastic
    return manager


def _request(request_id: str, tokens: list[int]) -> Request:
    params = SamplingParams(max_tokens=17)
    params.update_from_generation_config({}, eos_token_id=100)
    return Request(request_id=request_id, prompt_token_ids=tokens, mm_features=None, sampling_params=params,
                   pooling_params=None, block_hasher=get_request_block_hasher(TOKENS_PER_BLOCK, sha256))


def _admit(manager: VllmKVCacheManager, request: Request):
    """What vLLM's scheduler does to admit a prompt: look up the prefix cache, then allocate the
    rest (None when the pool's free count does not cover it)."""
    computed, num_computed, _ = manager.get_computed_blocks(request)
    blocks = manager.allocate_slots(request, request.num_tokens - num_computed, num_computed, computed)
    return num_computed, None if blocks is None else blocks.get_block_ids()


def _mapped_pages(pool: ElasticBlockPool) -> int:
    """Page ids mapped (one backs a page of every layer and buffer)."""
    return pool.manager.stats()["pages"]["mapped"]


def _pages_of_held_blocks(pool: ElasticBlockPool) -> int:
    per_page = pool.manager.get_page_occupancy([0])[0][1]
    return len({block.block_id // per_page for block in pool.blocks
                if block.is_null or block.ref_cnt > 0 or pool._held[block.block_id]})


# -- switching it on and off ----------------------------------------------------------------------

def _run_python(code: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, KVCACHED_TRACKER="0", **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=300, check=False)


def test_importing_kvcached_changes_nothing_in_vllm():
    result = _run_python("""
        import kvcached, kvcached.integration, kvcached.integration.vllm as kv
        from kvcached.integration.vllm import ElasticBlockPool, allocate_kv_cache
        import vllm.v1.core.block_pool as bp, vllm.v1.core.kv_cache_coordinator as kc
        assert kc.BlockPool is bp.BlockPool and bp.BlockPool.__module__ == "vllm.v1.core.block_pool", kc.BlockPool
        assert not kv.is_enabled()
        print("unchanged")
    """)
    assert result.returncode == 0 and "unchanged" in result.stdout, result.stderr


def test_enable_swaps_the_coordinators_pool_and_disable_restores_it(kv):
    assert not is_enabled()
    enable(worker=False)
    enable(worker=False)                                    # idempotent
    assert is_enabled() and vllm_coordinator.BlockPool is ElasticBlockPool
    assert vllm_block_pool.BlockPool is STOCK_BLOCK_POOL    # vLLM's class itself is untouched
    disable()
    disable()
    assert not is_enabled() and vllm_coordinator.BlockPool is STOCK_BLOCK_POOL
    assert type(_vllm_manager(16, elastic=False).block_pool) is STOCK_BLOCK_POOL
    assert type(_vllm_manager(16, elastic=True).block_pool) is ElasticBlockPool


def test_enable_with_the_worker_hook_swaps_allocate_kv_cache(kv):
    import importlib

    try:
        runners = [importlib.import_module(m) for m in ("vllm.v1.worker.gpu_model_runner",
                                                        "vllm.v1.worker.gpu.attn_utils")]
    except ImportError as exc:
        pytest.skip(f"vLLM's GPU worker modules do not import here: {exc}")
    stock = [runner.allocate_kv_cache for runner in runners]
    enable()
    assert all(runner.allocate_kv_cache is allocate_kv_cache for runner in runners)
    disable()
    assert [runner.allocate_kv_cache for runner in runners] == stock


@pytest.mark.parametrize("version", ["0.32.9", "0.34.0", "1.33.0", "0.3.3", "nightly", ""])
def test_version_check_names_the_version_and_the_supported_range(version):
    with pytest.raises(KVCachedConfigError) as info:
        check_vllm_version(version)
    assert repr(version)[1:-1] in str(info.value) and SUPPORTED_VLLM in str(info.value)


@pytest.mark.parametrize("version", ["0.33.0", "0.33.7", "0.33.1.dev4+g1234abc", "0.33.0rc1"])
def test_version_check_accepts_the_supported_minor(version):
    assert check_vllm_version(version) == version


def test_enable_refuses_another_vllm_release_and_changes_nothing(tmp_path):
    # A real distribution record of vllm 0.32.0 first on sys.path: what metadata then reports.
    dist = tmp_path / "vllm-0.32.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n")
    result = _run_python(f"""
        import sys; sys.path.insert(0, {str(tmp_path)!r})
        from kvcached.errors import KVCachedConfigError, KVCachedError
        import kvcached.integration.vllm as kv
        try:
            kv.enable()
        except KVCachedConfigError as exc:
            print("refused:", exc)
        else:
            raise SystemExit("enabled on vllm 0.32.0")
        import vllm.v1.core.block_pool as bp, vllm.v1.core.kv_cache_coordinator as kc
        assert kc.BlockPool is bp.BlockPool and not kv.is_enabled()
        try:
            kv.ElasticBlockPool
        except KVCachedConfigError:
            print("pool refused")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("refused: vllm 0.32.0 is installed") == 1, result.stdout
    assert SUPPORTED_VLLM in result.stdout and "pool refused" in result.stdout


def test_entry_point_is_declared_when_kvcached_is_installed():
    from importlib import metadata

    points = [p for p in metadata.entry_points(group="vllm.general_plugins") if p.value.startswith("kvcached")]
    if not points:
        pytest.skip("kvcached is not installed with its vllm.general_plugins entry point here")
    from kvcached.integration.vllm import register

    assert [f"{p.name} = {p.value}" for p in points] == [ENTRY_POINT] and [p.load() for p in points] == [register]


# -- the pool against vLLM's own pool ---------------------------------------------------------------

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
            pair = (_request(str(n), op[1]), _request(str(n), op[1]))
            expected, got = _admit(stock, pair[0]), _admit(elastic, pair[1])
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
        assert _mapped_pages(pool) == _pages_of_held_blocks(pool)
    for pair in running:
        for manager, request in zip((stock, elastic), pair):
            manager.free(request)
    pool.check_invariants()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=steps, caching=st.booleans(), metrics=st.booleans())
def test_one_page_pool_hands_out_exactly_vllms_ids(kv, ops, caching, metrics):
    """Within one kvcached page (the standalone geometry: 1024 blocks of 64 bytes a page here)
    every id, free-queue order and prefix hit is vLLM's own, and a metrics collector hears of
    the same allocations and evictions."""
    stock, elastic = (_vllm_manager(40, elastic=elastic, caching=caching, metrics=metrics)
                      for elastic in (False, True))
    try:
        _lockstep(stock, elastic, ops, same_ids=True)
    finally:
        elastic.block_pool.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=steps, caching=st.booleans(), keep_cached_pages=st.booleans())
def test_multi_page_pool_admits_as_vllm_does_and_maps_only_held_pages(kv, ops, caching, keep_cached_pages):
    """Across pages: the same admissions as vLLM's pool; with keep_idle_cached_pages the same
    prefix hits too (without it, pages of only cached blocks go back, and hits may be fewer)."""
    set_pool_geometry(SMALL_BLOCKS)
    stock, elastic = _vllm_manager(4 * PER_PAGE, elastic=False, caching=caching), \
        _vllm_manager(4 * PER_PAGE, elastic=True, caching=caching)
    elastic.block_pool.keep_idle_cached_pages = keep_cached_pages
    try:
        _lockstep(stock, elastic, ops, same_ids=False, same_hits=keep_cached_pages)
        if not keep_cached_pages:
            assert _mapped_pages(elastic.block_pool) == 1    # nothing in use: only the null block's page
        pool = elastic.block_pool
        pool.release_free_pages()
        assert _mapped_pages(pool) == 1          # the null block's page: everything else unmapped
        pool.check_invariants()
    finally:
        elastic.block_pool.close()


@pytest.mark.parametrize("layout", ["per_layer", "interleaved"])
@pytest.mark.parametrize("geometry", [SMALL_BLOCKS, PoolGeometry(block_size=2, cell_size=512, num_layers=3)])
def test_freed_blocks_unmap_their_pages(kv, layout, geometry):
    """Pages are mapped as blocks are taken and unmapped as they empty, cached or not, with any
    layout and number of layers and buffers (ids of one page are found from the manager)."""
    kv(MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=0, LAYOUT=layout)
    init_kvcached(device="cpu", page_size_bytes=PAGE)
    set_pool_geometry(geometry)
    pool = ElasticBlockPool(512, enable_caching=True, hash_block_size=TOKENS_PER_BLOCK)
    per_page = pool.manager.get_page_occupancy([0])[0][1]
    assert _mapped_pages(pool) == 1
    blocks = pool.get_new_blocks(5 * per_page)
    pool.check_invariants()
    assert _mapped_pages(pool) == 6 == _pages_of_held_blocks(pool)
    for n, block in enumerate(blocks[::2]):                     # half of them become cache entries
        pool._insert_block_hash(make_block_hash_with_group_id(BlockHash(b"c%d" % n), 0), block, num_tokens=4)
    pool.free_blocks(reversed(blocks))
    assert _mapped_pages(pool) == 1 and pool.get_num_free_blocks() == 511
    pool.check_invariants()
    pool.close()


def test_unpinned_blocks_are_reported_reused_before_their_page_goes_back(kv):
    """unpin_blocks keeps blocks readable until the pool reuses them; giving their page back is
    a reuse, so the reader hears of it before the memory goes."""
    set_pool_geometry(SMALL_BLOCKS)
    pool = ElasticBlockPool(8 * PER_PAGE, enable_caching=True, hash_block_size=TOKENS_PER_BLOCK)
    blocks = pool.get_new_blocks(2 * PER_PAGE)          # the rest of page 0, all of page 1, one of page 2
    on_page_1 = [b for b in blocks if b.block_id // PER_PAGE == 1]
    reused: list = []
    pool.unpin_blocks(on_page_1[:3], reused.append)
    assert reused == [] and _mapped_pages(pool) == 3
    pool.free_blocks(on_page_1[3:])                     # page 1 now holds only unpinned blocks
    assert sorted(b.block_id for b in reused) == [b.block_id for b in on_page_1[:3]] and _mapped_pages(pool) == 2
    pool.check_invariants()
    pool.close()


@pytest.mark.parametrize("victim_page", [0, 3])
def test_touching_a_free_block_claims_that_id_from_kvcached(kv, victim_page):
    """vLLM's touch() may take any free block as a hit (its tests and connectors do): the pool
    then has kvcached hold that very id, so it is never handed out twice."""
    set_pool_geometry(SMALL_BLOCKS)
    pool = ElasticBlockPool(8 * PER_PAGE, enable_caching=True, hash_block_size=TOKENS_PER_BLOCK)
    victim = pool.blocks[victim_page * PER_PAGE + 5]
    pool.touch([victim])
    assert victim.ref_cnt == 1 and pool._held[victim.block_id] and not pool._borrowed
    pool.check_invariants()
    assert _mapped_pages(pool) == _pages_of_held_blocks(pool) == (1 if victim_page == 0 else 2)
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


def test_a_touched_block_kvcached_cannot_back_now_is_borrowed_not_double_allocated(kv):
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


def test_unpinning_a_borrowed_block_leaves_a_plain_free_block(kv):
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


# -- honest free count, limits, a shared budget -------------------------------------------------

pool_ops = st.lists(st.one_of(
    st.tuples(st.just("take"), st.integers(0, 3 * PER_PAGE)),     # up to that many, within the count
    st.tuples(st.just("free"), st.integers(0, 10**6)),             # one reference of a block in use
    st.tuples(st.just("cache"), st.integers(0, 10**6)),            # a prefix-cache entry for a block in use
    st.tuples(st.just("touch"), st.integers(1, 8 * PER_PAGE - 1)),  # any block as a prefix hit
    st.tuples(st.just("unpin"), st.integers(0, 10**6)),            # one reference, readable until reused
    st.tuples(st.just("limit"), st.integers(-1, 8))), max_size=40)   # in pages, -1 none


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=pool_ops)
def test_free_count_stays_exact_through_every_change_of_the_pool(kv, ops):
    """Through blocks taken, freed, cached, touched as hits (free ones included: claimed or
    borrowed), unpinned and limits moved, the count vLLM calls equals the general form after
    every step (check_invariants; See Note [Free count binding]), all of it can be taken, and
    exactly that much while no block is borrowed (Note [Claiming a block])."""
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
def test_free_count_is_exactly_what_get_new_blocks_can_hand_out(kv, held, cached, limit_pages, seed):
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
def test_a_limit_lowered_between_the_count_and_the_allocation(kv, held, cached, limit_pages, extra, seed):
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


def test_lowered_limit_mid_run_shrinks_admission_and_never_raises(kv):
    """A vLLM KVCacheManager with prefix caching serves a stream of requests; then the limit
    drops to 2 pages: the pool gives back its cached pages and the free count drops with them,
    admission returns None instead of raising, and no page is mapped beyond the limit's share."""
    import random
    import time

    set_pool_geometry(SMALL_BLOCKS)
    manager = _vllm_manager(8 * PER_PAGE, elastic=True)
    pool: ElasticBlockPool = manager.block_pool            # type: ignore[assignment]
    pool.keep_idle_cached_pages = True                     # the cache keeps its pages until the limit
    rng = random.Random(7)

    def stream(num_requests: int, running: list[Request]) -> int:
        refused = 0
        for n in range(num_requests):
            request = _request(f"{len(running)}-{n}-{rng.random()}", [rng.randrange(3) for _ in
                                                                       range(rng.randrange(1, 80))])
            if _admit(manager, request)[1] is None:          # must never raise
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
    before, pages_before = pool.get_num_free_blocks(), _mapped_pages(pool)
    assert pages_before > 2                                  # cached blocks keep pages mapped
    assert pool.manager.set_memory_limit(2 * PAGE, revision=1)["status"] == "deferred"
    deadline = time.monotonic() + 60
    while pool.get_num_free_blocks() >= before:              # the next frees notice the limit
        assert time.monotonic() < deadline, "the pool never followed the lowered limit"
        pool.free_blocks([])
    assert _mapped_pages(pool) <= 2 and pool.manager.memory_limit()["status"] == "applied"
    assert stream(250, running) > 0
    assert _mapped_pages(pool) <= 2
    for request in running:
        manager.free(request)
    pool.check_invariants()
    pool.close()


def test_budget_shared_with_another_holder(kv):
    """Under KVCACHED_GLOBAL_BUDGET another holder of the budget takes memory: the pool's free
    count drops to what is left, all of it can be allocated, and it grows back on release."""
    from kvcached.shm.budget import Budget, delete_budget

    name = unique_name("vllm")
    kv(MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=0, GLOBAL_BUDGET=name, GLOBAL_BUDGET_BYTES=8 * PAGE)
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


def test_a_second_process_sharing_the_budget_lowers_the_free_count(kv):
    from kvcached.shm.budget import delete_budget

    name = unique_name("vllm")
    kv(MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=0, GLOBAL_BUDGET=name, GLOBAL_BUDGET_BYTES=8 * PAGE)
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


def test_reset_prefix_cache_works_under_a_limit(kv):
    set_pool_geometry(SMALL_BLOCKS)
    manager = _vllm_manager(4 * PER_PAGE, elastic=True)
    pool: ElasticBlockPool = manager.block_pool            # type: ignore[assignment]
    request = _request("a", [1] * (10 * TOKENS_PER_BLOCK))
    assert _admit(manager, request)[1] is not None
    manager.free(request)
    pool.manager.set_memory_limit(PAGE, revision=1)
    assert pool.get_num_free_blocks() < pool.free_block_queue.num_free_blocks
    assert pool.reset_prefix_cache()
    pool.check_invariants()
    pool.close()


def test_pool_geometry_for_another_size_is_refused(kv):
    set_pool_geometry(PoolGeometry(block_size=1, cell_size=1024, num_layers=1, num_kv_buffers=1, num_blocks=99))
    with pytest.raises(KVCachedConfigError, match="num_blocks=99"):
        ElasticBlockPool(100, enable_caching=True, hash_block_size=TOKENS_PER_BLOCK)
    with pytest.raises(KVCachedConfigError):
        set_pool_geometry("16 blocks")                                   # type: ignore[arg-type]
    with pytest.raises(KVCachedConfigError, match="cell_size"):
        PoolGeometry(block_size=1, cell_size=0, num_layers=1)


# -- the worker side: KV tensors of vLLM's specs -------------------------------------------------

SPECS = {
    "full": FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32),
    "sliding": SlidingWindowSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32, sliding_window=8),
    "mla": MLAAttentionSpec(block_size=4, num_kv_heads=1, head_size=32, dtype=torch.float32),
}


def _config(num_blocks: int, groups: dict[str, list[str]], overlay: bool) -> KVCacheConfig:
    """vLLM's layer-outermost placement: layer i of every group at the same offset when overlay
    (hybrid models: groups share the bytes), else one region per layer."""
    page = {SPECS[kind].page_size_bytes for kind in groups}.pop()
    region = page * num_blocks
    tensors, start = [], 0
    width = max(len(layers) for layers in groups.values())
    for layers in groups.values():
        offset = 0 if overlay else start
        tensors.append(KVCacheTensor(size=0, layers=layers, layer_stride=region, block_stride=page, offset=offset))
        start += region * len(layers)
    size = region * (width if overlay else start // region)
    tensors = [KVCacheTensor(size=size, layers=t.layers, layer_stride=t.layer_stride, block_stride=t.block_stride,
                             offset=t.offset) for t in tensors]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                         kv_cache_groups=[KVCacheGroupSpec(layers, SPECS[kind]) for kind, layers in groups.items()])


@pytest.mark.parametrize("groups, overlay", [
    ({"full": ["f0", "f1", "f2"]}, False),
    ({"mla": ["m0", "m1"]}, False),
    ({"full": ["f0", "f1"], "sliding": ["s0", "s1"]}, True),          # a hybrid model: groups overlay
    ({"full": ["f0"], "sliding": ["s0", "s1"]}, False),
])
@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC, "BLNHC"])
def test_kv_tensors_match_vllms_views_and_alias_as_vllm_places_them(kv, groups, overlay, layout):
    """Same shapes, dtypes and in-block strides as vLLM's own views of its slab; writes through
    one layer's view land where vLLM's placement says (separate layers apart, overlaid layers
    shared), in blocks handed out by the pool the allocation pointed at."""
    from vllm.v1.kv_cache_interface import create_kv_cache_views

    num_blocks = 48
    config = _config(num_blocks, groups, overlay)
    ours = allocate_kv_cache(config, "cpu", layout)
    assert pool_geometry() is not None and pool_geometry().num_blocks == num_blocks
    resolved = layout if isinstance(layout, KVCacheLayout) else KVCacheLayout[layout]
    slab = torch.zeros(config.kv_cache_tensors[0].size, dtype=torch.int8)
    stock = {}
    for tensor in config.kv_cache_tensors:
        spec = next(g.kv_cache_spec for g in config.kv_cache_groups if tensor.layers[0] in g.layer_names)
        stock.update(zip(tensor.layers, create_kv_cache_views(slab, spec, num_blocks, resolved, tensor)))
    assert ours.keys() == stock.keys()
    for name, view in ours.items():
        assert view.shape == stock[name].shape and view.dtype == stock[name].dtype, name
        assert view.stride()[1:] == stock[name].stride()[1:], name
    pool = ElasticBlockPool(num_blocks, enable_caching=True, hash_block_size=4)
    try:
        block_ids = [block.block_id for block in pool.get_new_blocks(num_blocks - 1)]
        for index, name in enumerate(ours):
            value = float(index + 1)
            ours[name][block_ids] = value
            stock[name][block_ids] = value
        for name in ours:
            assert torch.equal(ours[name][block_ids], stock[name][block_ids]), name
    finally:
        pool.close()


def test_kv_tensors_refuse_what_kvcached_cannot_back(kv):
    mamba = MambaSpec(block_size=4, shapes=((2, 3),), dtypes=(torch.float32,))
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[KVCacheTensor(size=1 << 12, layers=["m"], layer_stride=0,
                                                                         block_stride=0)],
                           kv_cache_groups=[KVCacheGroupSpec(["m"], mamba)])
    with pytest.raises(KVCachedConfigError, match="MambaSpec"):
        allocate_kv_cache(config, "cpu")
    with pytest.raises(KVCachedConfigError, match="LHBNC"):
        allocate_kv_cache(_config(8, {"full": ["f0"]}, False), "cpu", KVCacheLayout.LHBNC)
    with pytest.raises(KVCachedConfigError, match="not a KVCacheLayout"):
        allocate_kv_cache(_config(8, {"full": ["f0"]}, False), "cpu", "XYZ")
    assert pool_geometry() is None                  # nothing was allocated, no geometry set


# -- one process: the worker beside the scheduler (See Note [One process] in kv_tensors) ---------

def _engine_config(backend: str) -> VllmConfig:
    """The config of an engine whose executor is ``backend``, as vLLM's platform settles it; vLLM's
    worker wrapper initialises the KV cache with it current (set_current_vllm_config)."""
    return VllmConfig(parallel_config=ParallelConfig(distributed_executor_backend=backend))


@pytest.mark.parametrize("backend, multiprocessing", [("mp", "0"), ("mp", None), ("uni", None)])
def test_a_worker_outside_the_schedulers_process_is_refused(kv, monkeypatch, backend, multiprocessing):
    """With the multiprocessing executor the worker is a process of its own, whose tensors the
    scheduler's pool (in the engine core's process) would never map: refused before anything is
    allocated, naming the settings that put the worker in the scheduler's process. On vLLM's CPU
    platform "uni" becomes "mp" unless VLLM_ENABLE_V1_MULTIPROCESSING=0."""
    if multiprocessing is None:
        monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", multiprocessing)
    vllm_config = _engine_config(backend)
    if vllm_config.parallel_config.distributed_executor_backend != "mp":
        pytest.skip(f"{type(current_platform).__name__} runs distributed_executor_backend={backend!r} in process")
    with set_current_vllm_config(vllm_config), pytest.raises(KVCachedConfigError) as info:
        allocate_kv_cache(_config(8, {"full": ["f0"]}, False), "cpu")
    message = str(info.value)
    assert "MultiprocExecutor" in message and "distributed_executor_backend='mp'" in message, message
    assert "distributed_executor_backend='uni'" in message and "VLLM_ENABLE_V1_MULTIPROCESSING=0" in message
    assert pool_geometry() is None                  # nothing was allocated, no geometry set


def test_a_worker_in_the_schedulers_process_backs_the_pools_blocks(kv, monkeypatch):
    """The uniproc executor (VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps it on vLLM's CPU platform):
    the tensors are made, and the pool built next in this process hands out rows of them."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vllm_config = _engine_config("uni")
    assert vllm_config.parallel_config.distributed_executor_backend == "uni"
    with set_current_vllm_config(vllm_config):
        tensors = allocate_kv_cache(_config(8, {"full": ["f0"]}, False), "cpu")
    assert pool_geometry() is not None and pool_geometry().num_blocks == 8
    pool = ElasticBlockPool(8, enable_caching=False, hash_block_size=4)
    try:
        block_ids = [block.block_id for block in pool.get_new_blocks(7)]
        tensors["f0"][block_ids] = 1.5             # mapped by the pool's manager: the write lands
        assert bool((tensors["f0"][block_ids] == 1.5).all())
    finally:
        pool.close()
