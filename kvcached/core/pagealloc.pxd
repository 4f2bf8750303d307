# The C-level contract of kvcached.core.pagealloc: PageAllocator (the data path and the Python
# surface) over PageMapper (the driver work: ids mapped and unmapped through transit, fences),
# around a page ledger (each page id's state and the sets holding it: pagesets.pxd). PageMapper
# is the Refillable its RefillPolicy drives (refill.pxd: the locks, the ledger and the counters
# the policy reads are declared there, inherited here). Every field commented, every cdef's failure
# mode stated: `except -1` raises; out of memory is the value _OOM (1, from vmm), never an
# exception; `noexcept` is bookkeeping only (never a driver call). It cimports refill, pagesets,
# pagetable and vmm; only blockalloc cimports it.

from libc.stdint cimport int32_t, int64_t, uint64_t, uintptr_t

from kvcached.core cimport pagetable, refill, vmm
# what blockalloc takes from here: the slow-path sentinel and the used state (pagesets.pxd)
from kvcached.core.pagesets cimport _NEED_SLOW, _PS_USED

# Lock order: refill.pxd (BlockAllocator.lock -> map_lock -> lock -> Backend._lock).


cdef class PageMapper(refill.Refillable):
    # The driver work of a PageAllocator (its one subclass, which makes it): maps free ids for a
    # take or into the pool, unmaps ids behind their fence, retries failed unmaps. Inherited from
    # refill.Refillable: lock, map_lock, led (the page ledger), table, num_table_pages,
    # pages_taken, activity, num_slow_path, phys_time, last_error.
    cdef refill.RefillPolicy policy             # its refill policy: made in __cinit__, never None (Note [Refill policy])
    cdef readonly vmm.Backend backend          # the table's backend (fences, physical figures, handle cache)
    cdef public uintptr_t stream                # CUstream the fences of returned pages are recorded on
    cdef readonly size_t page_bytes             # physical bytes of one page id (all its segments)
    cdef int32_t* scratch                       # ids being unmapped; used only by the holder of map_lock
    cdef size_t phys_snapshot                   # backend's free physical bytes when last asked
    cdef size_t phys_base                       # backend.physical_bytes at that moment
    # counters, ever (stats() reports them under the same names)
    cdef uint64_t num_maps                      # page ids mapped
    cdef uint64_t num_unmaps                    # page ids unmapped
    cdef uint64_t num_oom                       # takes that found too little (out of memory, limit, gate)
    cdef uint64_t num_fences                    # fences recorded for pending pages
    cdef uint64_t num_refills                   # refill chunks that mapped (_map_into_pool)
    cdef uint64_t num_unmap_failures            # page unmaps the driver refused (each retried later)
    cdef uint64_t num_refill_failures           # refill chunks that could not map (out of memory, gate, error)

    # each holds map_lock (the docstrings say which locks they take); besides refill.Refillable's
    # mechanisms (_map_into_pool, _drain, _unmap_pool, _refresh_physical), defined here
    cdef int _map_free_ids(self, int32_t* out, int np, int k, bint into_pool, int* pooled) except -1 nogil  # 0 / _OOM (settled), or raises
    cdef int _discard_used(self, int n, int32_t* ids) except -1 nogil        # unmap pages in use nobody will hand out; raises
    cdef int _unmap_ids(self, int n, int32_t* ids) except -1 nogil   # 0, or raises past the unmap (ids settled anyway)
    cdef int _pool_out(self, int keep, int below) except -1 nogil    # 0, or raises as _unmap_ids


cdef class PageAllocator(PageMapper):
    # Hands out the page ids; the data path and the Python surface over its PageMapper.
    cdef vmm.Lifecycle life                     # live / closed / forked: Note [Fork and close]
    cdef bint weights_bound                     # a BlockAllocator set the weights
    cdef uint64_t num_pool_hits                 # takes served from the pool alone (stats())

    # the data path (callers: BlockAllocator, the manager); see each docstring for its locks
    cdef int take_pages(self, int n, int32_t* out) except -1 nogil                    # 0 / _OOM (nothing changed), or raises
    cdef int take_blocks(self, int64_t need, int32_t* out, int* n_out) except -1 nogil # 0 / _OOM (nothing changed), or raises
    cdef int take_pool(self, int64_t need, bint by_weight, int32_t* out, int* n_out) noexcept nogil  # 0 / _NEED_SLOW (nothing taken)
    cdef int return_pages(self, int n, const int32_t* ids) except -1 nogil             # 0, or raises (the pages stay accounted for)
    cdef int return_pages_fast(self, int n, const int32_t* ids) noexcept nogil        # 0 / _NEED_SLOW (nothing changed)
    cdef int64_t available_weight(self, bint by_weight, int64_t max_new_pages) noexcept nogil   # counters only
    # internals (and refill.Refillable's _take_pool_locked: the pool take under `lock`)
    cdef int _take(self, int64_t need, bint by_weight, int32_t* out, int* n_out) except -1 nogil   # 0 / _OOM, or raises
    cdef int _check_usable(self) except -1 nogil                # 0, or raises KVCachedClosedError (closed / forked)
    cdef int _check_not_forked(self) except -1                  # 0, or raises KVCachedClosedError in a forked child
    cdef int _bind_weights(self, const int32_t* weights) except -1   # 0, or raises KVCachedConfigError (busy)


cdef int64_t _max_new_pages(object value) except -2   # -1 or a page count; raises TypeError / ValueError
