"""kvcached: an elastic KV cache for LLM serving on CUDA virtual memory.

The public API is re-exported here lazily, so that ``kvctl`` and the tracker import neither torch
nor the compiled core.
"""

from importlib import import_module

from .errors import (
    BlockStateError,
    DriverError,
    DriverUnavailableError,
    KVCachedArgumentError,
    KVCachedClosedError,
    KVCachedConfigError,
    KVCachedError,
    KVCachePoolExhausted,
    MappingError,
    OutOfDeviceMemory,
)

_LAZY = {
    "init_kvcached": "runtime",
    "alloc_kv_cache": "runtime",
    "get_kv_cache_manager": "runtime",
    "shutdown_kvcached": "runtime",
    "KVCacheManager": "kv_cache_manager",
}

__all__ = sorted(_LAZY) + [
    "BlockStateError",
    "DriverError",
    "DriverUnavailableError",
    "KVCachedArgumentError",
    "KVCachedClosedError",
    "KVCachedConfigError",
    "KVCachedError",
    "KVCachePoolExhausted",
    "MappingError",
    "OutOfDeviceMemory",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcached' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
