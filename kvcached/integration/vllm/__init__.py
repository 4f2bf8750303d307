"""kvcached inside vLLM (0.32.x and 0.33.x): an elastic BlockPool for the scheduler, KV tensors from
``alloc_kv_cache`` for the worker, and the plugin switch.

- ``enable(worker=True)`` / ``disable()`` / ``is_enabled()``; ``register`` is the
  ``vllm.general_plugins`` entry point (vLLM calls it at start-up in every process); it does
  nothing unless KVCACHED_VLLM=1.
- ``ElasticBlockPool``: vLLM's BlockPool over a KVCacheManager (``pool.manager`` takes limits;
  ``pool.release_free_pages()`` gives cached pages back).
- ``allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes)``: vLLM's worker
  allocation over kvcached; it sets the geometry of the next pool (``set_pool_geometry``,
  ``PoolGeometry``, ``STANDALONE_GEOMETRY``). At tensor_parallel_size > 1 (vLLM's multiprocess
  executor) each worker joins the kvcached instance that the scheduler's first pool leads (tp.py).
- ``KVCachedSleepBackend``: vLLM's sleep-mode backend "kvcached" (``LLM(...,
  enable_sleep_mode=True, sleep_mode_backend="kvcached")``); ``release_kv_cache()`` /
  ``restore_kv_cache()`` put this process's pools to sleep and wake them.
- ``check_vllm_version()``, ``SUPPORTED_VLLM``, ``SUPPORTED_RELEASES``.

Importing this package imports no vLLM module and changes nothing; the names that need vLLM
are loaded on first use, after the version check.
"""

from importlib import import_module

from .plugin import disable, enable, is_enabled, register
from .version import SUPPORTED_RELEASES, SUPPORTED_VLLM, check_vllm_version

_NEEDS_VLLM = {
    "ElasticBlockPool": "block_pool",
    "PoolGeometry": "block_pool",
    "STANDALONE_GEOMETRY": "block_pool",
    "pool_geometry": "block_pool",
    "set_pool_geometry": "block_pool",
    "allocate_kv_cache": "kv_tensors",
    "KVCachedSleepBackend": "sleep",
    "release_kv_cache": "sleep",
    "restore_kv_cache": "sleep",
}

__all__ = [
    "STANDALONE_GEOMETRY",
    "SUPPORTED_RELEASES",
    "SUPPORTED_VLLM",
    "ElasticBlockPool",
    "KVCachedSleepBackend",
    "PoolGeometry",
    "allocate_kv_cache",
    "check_vllm_version",
    "disable",
    "enable",
    "is_enabled",
    "pool_geometry",
    "register",
    "release_kv_cache",
    "restore_kv_cache",
    "set_pool_geometry",
]


def __getattr__(name: str):
    module = _NEEDS_VLLM.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    check_vllm_version()
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
