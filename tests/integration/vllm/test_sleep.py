"""Prefix-cache reset and sleep mode with kvcached.integration.vllm: reset_prefix_cache gives back
every page without a block in use; vLLM's sleep-mode backend "kvcached" releases every KV page
and makes the pool usable again on wake-up, from blocks that hold nothing of before. Driven
through vLLM's scheduler-side KVCacheManager and sleep-mode factory, on the host backend. See
Note [Sleep] in block_pool and Note [A sleep-mode backend] in sleep.

Skipped without a supported vLLM (tests/integration/vllm/_vllm_contract.py).
"""

from __future__ import annotations

import pytest
import torch
from _vllm_contract import (
    PER_PAGE,
    SMALL_BLOCKS,
    TOKENS_PER_BLOCK,
    admit,
    make_request,
    mapped_pages,
    scheduler_manager,
    vllm_manager,
)

transformers = pytest.importorskip("transformers")

from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

from kvcached.errors import BlockStateError, KVCachedConfigError
from kvcached.integration.vllm import (
    ElasticBlockPool,
    KVCachedSleepBackend,
    allocate_kv_cache,
    disable,
    enable,
    pool_geometry,
    release_kv_cache,
    restore_kv_cache,
    set_pool_geometry,
)

NUM_BLOCKS = 4 * PER_PAGE          # four kvcached pages of 64 blocks
SPEC = FullAttentionSpec(block_size=TOKENS_PER_BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)   # 1 KiB pages


def _prompt(seed: int, num_blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(num_blocks * TOKENS_PER_BLOCK)]


@pytest.fixture
def model_config(tmp_path) -> ModelConfig:
    """A ModelConfig of a small Llama config file (no weights), as vLLM builds it."""
    transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2).save_pretrained(tmp_path)
    return ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, max_model_len=256)


@pytest.fixture
def engine(vllm_kv):
    """KV tensors from the worker hook and vLLM's scheduler-side KVCacheManager over them, its
    pool an ElasticBlockPool of the same kvcached group (one process, as with vLLM's uniproc
    executor); the sleep-mode backend registered by enable()."""
    layer_bytes = SPEC.page_size_bytes * NUM_BLOCKS
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_groups=[KVCacheGroupSpec(["layer"], SPEC)],
                           kv_cache_tensors=[KVCacheTensor(size=layer_bytes, layers=["layer"], layer_stride=layer_bytes,
                                                           block_stride=SPEC.page_size_bytes)])
    tensors = allocate_kv_cache(config, "cpu")
    manager = scheduler_manager(config, worker=True, enable_caching=True)
    pool = manager.block_pool
    pool.keep_idle_cached_pages = True      # cached blocks keep their pages until a reset or sleep
    try:
        yield Engine(manager, pool, tensors["layer"])
    finally:
        pool.close()


class Engine(tuple):
    """(manager, pool, kv); its repr never reads the KV tensor, whose unallocated rows are not
    mapped (a failing test's report would fault printing it)."""

    def __new__(cls, manager, pool, kv):
        return super().__new__(cls, (manager, pool, kv))

    def __repr__(self) -> str:
        return f"Engine(pool of {self[1].num_gpu_blocks} blocks)"


def _fill(manager: VllmKVCacheManager, kv: torch.Tensor, request, value: float) -> list[int]:
    """Admit the request and write value into every one of its blocks; their ids."""
    num_computed, block_ids = admit(manager, request)
    assert num_computed == 0 and block_ids is not None
    kv[block_ids[0]] = value
    return block_ids[0]


# -- reset_prefix_cache -----------------------------------------------------------------------------

def test_reset_prefix_cache_gives_back_every_page_without_a_block_in_use(vllm_kv):
    """Cached blocks on several pages keep them mapped; the reset drops every entry and the pages
    go back at once, all but the null block's, with vLLM's free count unchanged."""
    set_pool_geometry(SMALL_BLOCKS)
    manager = vllm_manager(NUM_BLOCKS, elastic=True)
    pool: ElasticBlockPool = manager.block_pool            # type: ignore[assignment]
    pool.keep_idle_cached_pages = True                      # cached pages stay until the reset
    try:
        for n in range(2):
            request = make_request(str(n), _prompt(n, 70))
            assert admit(manager, request)[1] is not None
            manager.free(request)
        assert mapped_pages(pool) == 3                      # 140 cached blocks and the null block
        free_count = pool.get_num_free_blocks()
        assert manager.reset_prefix_cache()
        assert mapped_pages(pool) == 1 and pool.get_num_free_blocks() == free_count
        assert not pool.cached_block_hash_to_block._cache
        pool.check_invariants()
        hit = make_request("again", _prompt(0, 70))
        assert admit(manager, hit)[0] == 0                  # no entry survived
        manager.free(hit)
    finally:
        pool.close()


def test_reset_prefix_cache_with_a_request_running_changes_nothing(vllm_kv):
    """vLLM's reset refuses while a block is in use: every entry and page stays."""
    set_pool_geometry(SMALL_BLOCKS)
    manager = vllm_manager(NUM_BLOCKS, elastic=True)
    pool: ElasticBlockPool = manager.block_pool            # type: ignore[assignment]
    pool.keep_idle_cached_pages = True
    try:
        cached = make_request("cached", _prompt(0, 70))
        assert admit(manager, cached)[1] is not None
        manager.free(cached)
        running = make_request("running", _prompt(1, 3))
        assert admit(manager, running)[1] is not None
        pages = mapped_pages(pool)
        assert not manager.reset_prefix_cache()
        assert mapped_pages(pool) == pages
        pool.check_invariants()
        manager.free(running)
        again = make_request("again", _prompt(0, 70))
        assert admit(manager, again)[0] > 0                 # the entries are still there
        manager.free(again)
    finally:
        pool.close()


# -- sleep mode ---------------------------------------------------------------------------------------

def test_enable_registers_the_sleep_backend_with_vllm(vllm_kv, model_config):
    enable()
    enable()                                                # idempotent, registered once
    disable()
    model_config.sleep_mode_backend = "kvcached"
    assert type(SleepModeBackendFactory.create_backend(model_config)) is KVCachedSleepBackend


def test_sleep_releases_every_page_and_wake_up_starts_from_fresh_blocks(engine):
    """Sleep (after vLLM's reset, as LLM.sleep does it): nothing mapped, nothing handed out, the
    pool consistent; wake-up: the pool admits again, from zeroed blocks and with no cache hit."""
    manager, pool, kv = engine
    request = make_request("a", _prompt(0, 70))
    old_ids = _fill(manager, kv, request, 7.0)
    manager.free(request)                                   # cached: its pages stay mapped
    assert mapped_pages(pool) >= 2
    assert manager.reset_prefix_cache()
    backend = KVCachedSleepBackend()
    backend.suspend(level=1)
    assert backend.state() == "SUSPENDED" and pool.asleep
    assert mapped_pages(pool) == 0 and pool.manager.stats()["allocated"] == 0
    assert pool.get_num_free_blocks() == 0
    assert admit(manager, make_request("b", _prompt(1, 2)))[1] is None    # vLLM would admit nothing
    pool.check_invariants()
    backend.suspend(level=1)                                # idempotent

    backend.resume()
    assert backend.state() == "RUNNING" and not pool.asleep
    assert mapped_pages(pool) == 1 and pool.get_num_free_blocks() == NUM_BLOCKS - 1
    pool.check_invariants()
    again = make_request("again", _prompt(0, 70))
    num_computed, block_ids = admit(manager, again)
    assert num_computed == 0 and block_ids is not None
    assert set(block_ids[0]) & set(old_ids)                 # the same ids, pages mapped afresh
    assert bool((kv[block_ids[0]] == 0).all())              # zeros, not the 7.0 of before the sleep
    kv[block_ids[0]] = 1.0
    manager.free(again)
    pool.check_invariants()


def test_sleep_without_the_reset_drops_the_cache_too(engine):
    """A sleep not preceded by vLLM's reset resets the cache itself: no entry outlives its bytes."""
    manager, pool, kv = engine
    request = make_request("a", _prompt(0, 10))
    _fill(manager, kv, request, 7.0)
    manager.free(request)
    release_kv_cache()
    assert mapped_pages(pool) == 0
    restore_kv_cache()
    assert admit(manager, make_request("again", _prompt(0, 10)))[0] == 0


def test_sleep_with_a_request_running_is_refused_and_changes_nothing(engine):
    """Refused for every pool of the process (an idle standalone one too) while one pool has a
    block in use; fine once the request is freed."""
    manager, pool, kv = engine
    set_pool_geometry(None)
    idle = ElasticBlockPool(8, enable_caching=True, hash_block_size=TOKENS_PER_BLOCK)
    running = make_request("running", _prompt(0, 3))
    block_ids = _fill(manager, kv, running, 5.0)
    pages, free_count = mapped_pages(pool), pool.get_num_free_blocks()
    backend = KVCachedSleepBackend()
    with pytest.raises(BlockStateError, match="3 blocks of this pool are in use.*LLM.sleep"):
        backend.suspend(level=1)
    assert backend.state() == "RUNNING" and not pool.asleep and not idle.asleep
    assert (mapped_pages(pool), pool.get_num_free_blocks()) == (pages, free_count)
    assert bool((kv[block_ids] == 5.0).all())               # still mapped, still its bytes
    pool.check_invariants()
    manager.free(running)
    backend.suspend(level=2)
    assert mapped_pages(pool) == mapped_pages(idle) == 0
    backend.resume(["kv_cache"])
    assert not pool.asleep and not idle.asleep
    idle.check_invariants()
    idle.close()


def test_discard_of_the_kv_cache_tag_releases_and_resume_restores(engine):
    """vLLM's release_kv_cache_memory(): discard(("kv_cache",)), later wake_up(["kv_cache"])."""
    manager, pool, kv = engine
    backend = KVCachedSleepBackend()
    backend.discard(("kv_cache",))
    assert mapped_pages(pool) == 0 and pool.asleep
    with pytest.raises(KVCachedConfigError, match="weights"):
        backend.discard(("weights",))                       # nothing but the KV cache on a CPU
    backend.resume(["weights"])                             # another tag: the KV cache sleeps on
    assert pool.asleep
    backend.resume(["kv_cache"])
    assert not pool.asleep and mapped_pages(pool) == 1
    request = make_request("a", _prompt(0, 3))
    _fill(manager, kv, request, 2.0)
    manager.free(request)


def test_bad_sleep_level_is_refused(engine):
    manager, pool, kv = engine
    with pytest.raises(KVCachedConfigError, match="level=0"):
        KVCachedSleepBackend().suspend(level=0)
    assert not pool.asleep


def test_sleep_mode_with_another_backend_is_refused_by_the_worker_hook(vllm_kv, model_config, monkeypatch):
    """vLLM's default sleep backend frees what is in its CuMem pool, where kvcached's KV cache is
    not: the worker hook refuses it before allocating, naming the backend to use."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vllm_config = VllmConfig(model_config=model_config)
    model_config.enable_sleep_mode = True           # (vLLM's CPU platform refuses it at construction)
    config = KVCacheConfig(num_blocks=8, kv_cache_groups=[KVCacheGroupSpec(["layer"], SPEC)],
                           kv_cache_tensors=[KVCacheTensor(size=8 * SPEC.page_size_bytes, layers=["layer"],
                                                           layer_stride=8 * SPEC.page_size_bytes,
                                                           block_stride=SPEC.page_size_bytes)])
    with set_current_vllm_config(vllm_config), \
            pytest.raises(KVCachedConfigError, match="sleep_mode_backend='cumem'.*sleep_mode_backend='kvcached'"):
        allocate_kv_cache(config, "cpu")
    assert pool_geometry() is None                  # nothing was allocated
    model_config.sleep_mode_backend = "kvcached"
    with set_current_vllm_config(vllm_config):
        assert allocate_kv_cache(config, "cpu").keys() == {"layer"}
