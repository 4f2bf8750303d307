"""kvcached: an elastic KV cache for LLM serving on CUDA virtual memory.

The layers, each calling only the ones below it (tests/test_layers.py checks the imports)::

    ops/, serving/, integration/vllm/   applications: the public API only (this module, runtime,
                                        KVCacheManager, limits, shm.client, shm.budget)
    CLI              cli/kvctl.py, cli/kvtop.py   operators: read segments, request limits
    runtime          runtime.py            the one registry: backend, groups, managers
    manager          kv_cache_manager.py   engine-facing policy: limits, budget, publishing
    tensor parallel  tp/                   rank 0's page tables mirrored on the other ranks
    compiled core    core/                 the hot path, one Cython module per layer:
      block allocator  core/blockalloc.pyx   block ids over pages (its parts: core/freebuckets.pyx,
                                             core/blockargs.pyx)
      page allocator   core/pagealloc.pyx    free set, reserved pool, pending fences, refill policy
      page table       core/pagetable.pyx    map/unmap all or nothing, rollback, zero page
      backend          core/vmm.pyx          checked driver calls, CUDA memory, the handle
                                             cache, virtual ranges and DLPack; host memory
                                             in core/hostmem.pyx

Each compiled module cimports only the ones below it through their .pxd contracts.
Beside them: layout.py (where each block lives in the ranges), limits.py (the limit arithmetic),
shm/ (the shared-memory segments, the budgets and the one poller thread: shm/__init__.py says
which file holds what), and errors, config, checks, sizes at the bottom.
docs/design.md describes each layer, its invariants and the measurements behind it.

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
__version__ = "0.1.0"


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
