# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, auto_pickle=False
"""kvcached._pagealloc: whole pages for the block allocator above it.

  _page_allocator.pxi  PageAllocator: free page ids, reserved pool, resize, limits, deferred
                       unmap, and mapping a chunk into the pool
  _refill.pxi          RefillPolicy: the background thread, its wake-up, the refill target,
                       idle trim and the budget gate (Note [Refill policy])

It stands on kvcached._pagetable (PageTable: what one page id maps, all-or-nothing) over
kvcached._vmm (checked driver calls, the backends and their handle cache, VirtualRange). Calls
into them are vtable calls through their .pxd contracts; nothing here touches their locks or the
handle cache. kvcached._core (BlockAllocator) is the only module above it.

Every cdef function says how it fails: ``except -1`` raises (driver and syscall errors), and out of
memory is the value ``_OOM`` (1), never an exception, so callers can roll back and return None.
"""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy

from kvcached._posix cimport (
    CLOCK_MONOTONIC, _now, clock_gettime, getpid, pthread_cond_broadcast, pthread_cond_destroy,
    pthread_cond_init, pthread_cond_signal, pthread_cond_timedwait, pthread_cond_wait, pthread_condattr_destroy,
    pthread_condattr_init, pthread_condattr_setclock, pthread_condattr_t, pthread_mutex_destroy, pthread_mutex_init,
    pthread_mutex_lock, pthread_mutex_trylock, pthread_mutex_unlock, timespec, usleep,
)
from kvcached._vmm cimport _OOM, _TOKEN_CLOSED, _fork_generation, _lifecycle_name, _live_token, _raise_unusable

import threading as _threading

from kvcached.checks import as_int
from kvcached.errors import KVCachedConfigError, MappingError

include "_page_allocator.pxi"
include "_refill.pxi"
