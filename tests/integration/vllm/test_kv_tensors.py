"""The worker side of kvcached.integration.vllm: allocate_kv_cache makes KV tensors with vLLM's
views and placement for its attention specs (and refuses what kvcached cannot back), and only
in the scheduler's process, where the pool built next maps their blocks.

Skipped without a supported vLLM (tests/integration/vllm/_vllm_contract.py).
"""

from __future__ import annotations

import pytest
import torch
import _vllm_contract  # noqa: F401 (skips this module without a supported vLLM)
from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    HiSparseHotSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvcached.errors import KVCachedConfigError
from kvcached.integration.vllm import ElasticBlockPool, allocate_kv_cache, pool_geometry


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
def test_kv_tensors_match_vllms_views_and_alias_as_vllm_places_them(vllm_kv, groups, overlay, layout):
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


def test_kv_tensors_refuse_what_kvcached_cannot_back(vllm_kv):
    raw = HiSparseHotSpec(block_size=4, page_size=512, blocks_per_request=2)     # a raw buffer, no layer views
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[KVCacheTensor(size=1 << 12, layers=["h"], layer_stride=0,
                                                                         block_stride=0)],
                           kv_cache_groups=[KVCacheGroupSpec(["h"], raw)])
    with pytest.raises(KVCachedConfigError, match="HiSparseHotSpec"):
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
def test_a_worker_outside_the_schedulers_process_is_refused(vllm_kv, monkeypatch, backend, multiprocessing):
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


def test_a_worker_in_the_schedulers_process_backs_the_pools_blocks(vllm_kv, monkeypatch):
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
