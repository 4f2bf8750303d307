"""What the contract tests of kvcached.integration.vllm share (tests/integration/vllm/): the skip
without a supported vLLM, kvcached on the host backend (conftest's `vllm_kv` fixture), and vLLM's
scheduler-side KVCacheManager over one full-attention group, with vLLM's pool or ours.

Importing it skips the importing test module where vLLM is missing (the main CI venv has none;
the vLLM venv of .ci/run_vllm runs them) or is not the supported release.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

from kvcached.errors import KVCachedConfigError
from kvcached.integration.vllm.version import check_vllm_version

try:
    check_vllm_version()
except KVCachedConfigError as exc:
    pytest.skip(str(exc), allow_module_level=True)

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from kvcached import init_kvcached
from kvcached.integration.vllm import ElasticBlockPool, PoolGeometry, disable, enable, set_pool_geometry

PAGE = 64 << 10                     # 64 KiB pages: small pools span several of them
SMALL_BLOCKS = PoolGeometry(block_size=1, cell_size=1024, num_layers=1, num_kv_buffers=1)    # 64 blocks a page
PER_PAGE = PAGE // 1024
TOKENS_PER_BLOCK = 4


@contextlib.contextmanager
def kvcached_for_vllm(kv_env) -> Iterator[None]:
    """kvcached on the host backend with 64 KiB pages and no reserved pool (mapped pages = pages
    holding blocks); no geometry set, nothing enabled, before and after (conftest's vllm_kv)."""
    kv_env(MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=0)
    init_kvcached(device="cpu", page_size_bytes=PAGE)
    init_none_hash(sha256)
    try:
        yield
    finally:
        set_pool_geometry(None)
        disable()


def scheduler_manager(config: KVCacheConfig, *, elastic: bool = True, worker: bool = False,
                      block_size: int = TOKENS_PER_BLOCK, max_model_len: int = 4096, **kwargs) -> VllmKVCacheManager:
    """vLLM's scheduler-side KVCacheManager over `config`, with vLLM's pool or ours (built
    through enable(worker=worker), the way the scheduler gets it, then disable()); kwargs go to
    vLLM's KVCacheManager."""
    if elastic:
        enable(worker=worker)
    try:
        manager = VllmKVCacheManager(config, max_model_len=max_model_len, scheduler_block_size=block_size,
                                     hash_block_size=block_size, **kwargs)
    finally:
        disable()
    assert isinstance(manager.block_pool, ElasticBlockPool) == elastic, type(manager.block_pool)
    return manager


def vllm_manager(num_blocks: int, *, elastic: bool, caching: bool = True, metrics: bool = False) -> VllmKVCacheManager:
    """scheduler_manager over one full-attention group; metrics: a collector that samples every
    block."""
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=TOKENS_PER_BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    return scheduler_manager(config, elastic=elastic, enable_caching=caching,
                             metrics_collector=KVCacheMetricsCollector(sample_rate=1.0) if metrics else None)


def make_request(request_id: str, tokens: list[int]) -> Request:
    params = SamplingParams(max_tokens=17)
    params.update_from_generation_config({}, eos_token_id=100)
    return Request(request_id=request_id, prompt_token_ids=tokens, mm_features=None, sampling_params=params,
                   pooling_params=None, block_hasher=get_request_block_hasher(TOKENS_PER_BLOCK, sha256))


def admit(manager: VllmKVCacheManager, request: Request):
    """What vLLM's scheduler does to admit a prompt: look up the prefix cache, then allocate the
    rest (None when the pool's free count does not cover it)."""
    computed, num_computed, _ = manager.get_computed_blocks(request)
    blocks = manager.allocate_slots(request, request.num_tokens - num_computed, num_computed, computed)
    return num_computed, None if blocks is None else blocks.get_block_ids()


def mapped_pages(pool: ElasticBlockPool) -> int:
    """Page ids mapped (one backs a page of every layer and buffer)."""
    return pool.manager.stats()["pages"]["mapped"]


def pages_of_held_blocks(pool: ElasticBlockPool) -> int:
    per_page = pool.manager.get_page_occupancy([0])[0][1]
    return len({block.block_id // per_page for block in pool.blocks
                if block.is_null or block.ref_cnt > 0 or pool._held[block.block_id]})
