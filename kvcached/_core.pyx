# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, auto_pickle=False
"""kvcached._core: the hot path the package is built around.

  _block_allocator.pxi BlockAllocator: free slots per page, best fit, per-block allocated bit

It stands on the three layers below, each its own extension module with a .pxd contract:
kvcached._pagealloc (PageAllocator: free page ids, reserved pool, deferred unmap, limits; its
RefillPolicy) over kvcached._pagetable (PageTable: what one page id maps, all-or-nothing) over
kvcached._vmm (checked driver calls, the backends and their handle cache, VirtualRange). Calls into
them are vtable calls through those contracts; nothing here touches their locks.

Glossary: range = virtual reservation; page = physical mapping unit (one page id backs one
mapping per segment); block = KV slot; pool = mapped but unused pages.

Every cdef function says how it fails: ``except -1`` raises (driver and syscall errors), and out of
memory is the value ``_OOM`` (1), never an exception, so callers can roll back and return None.

For tools and tests, this module also re-exports the Python names of the layers below, so that
``from kvcached import _core`` reaches the whole compiled core; the package's own modules import
each name from the module that defines it.
"""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset
from cpython.ref cimport Py_INCREF, Py_XDECREF, PyObject

from kvcached._posix cimport (
    getpid, pthread_mutex_destroy, pthread_mutex_init, pthread_mutex_lock, pthread_mutex_trylock,
    pthread_mutex_unlock,
)
from kvcached._vmm cimport _OOM, _TOKEN_CLOSED, _fork_generation, _lifecycle_name, _live_token, _raise_unusable
from kvcached cimport _pagealloc
from kvcached._pagealloc cimport _NEED_SLOW, _PS_USED, _max_new_pages

from kvcached.errors import BlockStateError, KVCachedConfigError, MappingError

# The compiled core's Python surface in one namespace (tools and tests: `kvcached._core.X`).
from kvcached._vmm import (  # noqa: F401
    DEFAULT_HANDLE_CACHE_SIZE,
    Backend,
    CudaBackend,
    HostBackend,
    VirtualRange,
    cuda_device_count,
    cuda_unavailable_reason,
    fork_generation,
)
from kvcached._pagetable import PageTable  # noqa: F401
from kvcached._pagealloc import PageAllocator, RefillPolicy  # noqa: F401

include "_block_allocator.pxi"
