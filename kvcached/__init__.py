"""kvcached: an elastic KV cache for LLM serving on CUDA virtual memory.

The layers and the file of each: docs/design.md, "Layers and files" (tests/test_layers.py checks).

The public API is re-exported here lazily, so that ``kvctl`` and the tracker import neither torch
nor the compiled core. Importing the package also gives a manager made without a registry the
runtime's (Note [One registry] in kv_cache_manager).
"""

from importlib import import_module

from . import kv_cache_manager as _kv_cache_manager
from .errors import (
    BlockStateError,
    DriverError,
    DriverUnavailableError,
    KVCachedArgumentError,
    KVCachedClosedError,
    KVCachedConfigError,
    KVCachedError,
    KVCachedTPError,
    MappingError,
    OutOfDeviceMemory,
)

_LAZY = {
    "init_kvcached": "runtime",
    "alloc_kv_cache": "runtime",
    "get_kv_cache_manager": "runtime",
    "shutdown_kvcached": "runtime",
    "wait_for_scheduler": "runtime",
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
    "KVCachedTPError",
    "MappingError",
    "OutOfDeviceMemory",
]
__version__ = "0.2.0"


def _runtime_registry():
    """The runtime's registry, for a KVCacheManager made without one (Note [One registry] in
    kv_cache_manager). Imports the runtime on first use only."""
    return import_module(".runtime", __name__).REGISTRY


_kv_cache_manager.registry_provider = _runtime_registry


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcached' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
