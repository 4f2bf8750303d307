# The C-level contract of kvcached.core.pagealloc: PageAllocator (the state of each page id across
# its sets — free set, reserved pool, pending ring: pagesets.pxd — mapping, limits) and RefillPolicy (its background thread, refill target, idle trim, budget gate).
# Every field commented, every cdef's failure mode stated: `except -1` raises; out of memory is
# the value _OOM (1, from vmm), never an exception; `noexcept` is bookkeeping only (never a
# driver call). It cimports pagesets (the free set, the pool, the pending ring), pagetable and
# vmm; only blockalloc cimports it.

from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t, uintptr_t

from kvcached.core._posix cimport pthread_cond_t, pthread_mutex_t
from kvcached.core cimport pagesets, pagetable
from kvcached.core cimport vmm

# Lock order (see Note [Allocator locks] in blockalloc.pyx): BlockAllocator.lock ->
# PageAllocator.map_lock -> PageAllocator.lock -> Backend._lock. Nothing is waited on in the
# other direction. RefillPolicy has no lock: its fields are guarded by its allocator's `lock`.

cdef enum:
    _NEED_SLOW = 2      # a fast (GIL-held, driver-free) worker could not serve: retry the slow way

cdef enum:
    # PageAllocator.state[page_id]; every page id of the table is in exactly one state
    _PS_OUTSIDE = 0     # not handed out: at or above capacity_pages, or holds no block (weight 0)
    _PS_FREE = 1        # below capacity, unmapped, in the free set
    _PS_POOL = 2        # mapped, unused: the reserved pool
    _PS_USED = 3        # mapped, handed out by take_pages / take_blocks
    _PS_PENDING = 4     # returned, still mapped until its fence is done (then unmapped)
    _PS_TRANSIT = 5     # being mapped or unmapped by the holder of map_lock

cdef class PageAllocator


cdef class RefillPolicy:
    # When the pool is refilled and trimmed; owned by one PageAllocator, which every method gets
    # as `pa` (no reference back: Note [Refill policy]). Fields guarded by pa.lock unless noted.
    cdef vmm.Lifecycle life                     # made here or inherited by a forked child (never closed)
    cdef pthread_cond_t wake                    # the background thread sleeps on it (with pa.lock)
    cdef pthread_cond_t pool_cv                 # broadcast when a refill round pools a page or ends (with pa.lock)
    cdef int min_reserved                       # the pool's floor: a round aims at least this high
    cdef int refill_target                      # pool size a refill round aims at, in [min_reserved, pa.max_reserved]
    cdef double idle_trim_s                     # trim the pool after this long without take/return; 0 off (unlocked)
    cdef bint bg_refilling                      # a refill round runs: short callers wait for it (Note [Proactive refill])
    cdef bint bg_running                        # the background thread is running (signal it)
    cdef bint bg_stopping                       # stop() asked it to exit
    cdef bint bg_backoff                        # its last refill failed: sleep a full period first
    cdef bint idle_trimmed                      # pool trimmed (idle or trim()): no refill until activity
    cdef uint64_t bg_seen_activity              # thread only: pa.activity when it last looked
    cdef double bg_active_time                  # thread only: when it last saw pa.activity change
    cdef bint has_gate                          # an external budget gate is set (changed under pa.map_lock and pa.lock)
    cdef object gate_acquire                    # acquire(nbytes) -> bool, called before mapping (under pa.map_lock)
    cdef object gate_release                    # release(nbytes), called after unmapping (under pa.map_lock)
    cdef object thread                          # the threading.Thread, or None (GIL)
    # counters, ever (pa.stats() reports them under the same names)
    cdef uint64_t num_pool_waits                # takes that waited for a refill round's pages
    cdef uint64_t num_idle_trims                # idle trims of the pool by the background thread
    cdef uint64_t num_bg_rounds                 # rounds the background thread completed (tests wait on it)

    # `noexcept` ones are bookkeeping; the others say what they raise
    cdef void _wake_locked(self) noexcept nogil                             # signal the thread if it runs; hold pa.lock
    cdef void _set_floor_locked(self, int min_reserved) noexcept nogil      # new min_reserved, target reset, wake; hold pa.lock
    cdef bint _refill_covers(self, PageAllocator pa, int64_t need, bint by_weight) noexcept nogil   # the running round will cover `need`; hold pa.lock
    cdef int _wait_for_refill(self, PageAllocator pa, int64_t need, bint by_weight, int32_t* out, int* n_out) noexcept nogil  # 0 / _NEED_SLOW; takes pa.lock
    cdef int _gate_acquire(self, int n, size_t page_bytes) except -1 nogil  # 1 granted, 0 refused, or raises what the gate raised
    cdef int _gate_release(self, int n, size_t page_bytes) except -1 nogil  # 0, or raises what the gate raised
    cdef int _refill(self, PageAllocator pa) except -1 nogil                # 0, or raises (the round ends, waiters woken)
    cdef int _bg_step(self, PageAllocator pa) except -1 nogil               # 0 go on, 1 exit, or raises (the thread backs off)
    cdef int _start(self, PageAllocator pa) except -1                       # 0, or raises what Thread.start raised; GIL held
    cdef int _stop(self, PageAllocator pa) except -1                        # 0, or raises what Thread.join raised; GIL held


cdef class PageAllocator:
    cdef vmm.Lifecycle life                     # live / closed / forked: Note [Fork and close]
    cdef readonly pagetable.PageTable table    # maps and unmaps the page ids handed out
    cdef readonly vmm.Backend backend          # the table's backend (fences, physical figures, handle cache)
    cdef pthread_mutex_t lock                   # state lock: everything below; never held across a driver or Python call
    cdef pthread_mutex_t map_lock               # serialises page-table calls (map/unmap); waited on only without the GIL
    cdef RefillPolicy policy                    # its refill policy: made in __cinit__, never None (Note [Refill policy])
    cdef readonly int num_table_pages           # the table's num_pages: capacity never exceeds it
    cdef readonly int capacity_pages            # page ids [0, capacity_pages) may be handed out
    cdef readonly int max_reserved              # returned pages beyond this many pooled ones are unmapped
    cdef uint64_t pages_taken                   # pages handed out by take_pages / take_blocks, ever
    cdef readonly int limit_pages               # in-use + pool never exceed it; -1 = no limit
    cdef public uintptr_t stream                # CUstream the fences of returned pages are recorded on
    cdef readonly size_t page_bytes             # physical bytes of one page id (all its segments)
    cdef uint8_t* state                         # [page] one of _PS_*
    cdef int32_t* weight                        # [page] blocks the page holds (1 until a BlockAllocator binds)
    cdef bint weights_bound                     # a BlockAllocator set the weights
    cdef pagesets.FreeSet free_set              # the free ids, lowest first (Fenwick tree)
    cdef pagesets.PoolStack pool                # the pool: mapped, unused ids, a stack
    cdef pagesets.PendingRing pending           # mapped ids behind a fence, and the ids whose unmap failed
    cdef int num_used                           # ids handed out
    cdef int num_transit                        # ids in flight under map_lock
    cdef int refill_transit                     # of those, ids the background refill is mapping for the pool
    cdef int64_t refill_transit_weight          # their blocks (available_weight counts them as pool)
    cdef int32_t* scratch                       # ids being unmapped; used only by the holder of map_lock
    cdef size_t phys_snapshot                   # backend's free physical bytes when last asked
    cdef size_t phys_base                       # backend.physical_bytes at that moment
    cdef double phys_time                       # monotonic seconds of that snapshot
    cdef uint64_t activity                      # take/return calls (the policy's idle rule reads it)
    cdef public object last_error               # last exception caught off the caller's path (thread, free)
    # counters, ever (stats() reports them under the same names)
    cdef uint64_t num_maps                      # page ids mapped
    cdef uint64_t num_unmaps                    # page ids unmapped
    cdef uint64_t num_pool_hits                 # takes served from the pool alone
    cdef uint64_t num_slow_path                 # takes that took map_lock
    cdef uint64_t num_oom                       # takes that found too little (out of memory, limit, gate)
    cdef uint64_t num_fences                    # fences recorded for pending pages
    cdef uint64_t num_refills                   # refill chunks that mapped (_map_into_pool)
    cdef uint64_t num_unmap_failures            # page unmaps the driver refused (each retried later)
    cdef uint64_t num_refill_failures           # refill chunks that could not map (out of memory, gate, error)

    # the data path (callers: BlockAllocator, the manager); see each docstring for its locks
    cdef int take_pages(self, int n, int32_t* out) except -1 nogil                    # 0 / _OOM (nothing changed), or raises
    cdef int take_blocks(self, int64_t need, int32_t* out, int* n_out) except -1 nogil # 0 / _OOM (nothing changed), or raises
    cdef int take_pool(self, int64_t need, bint by_weight, int32_t* out, int* n_out) noexcept nogil  # 0 / _NEED_SLOW (nothing taken)
    cdef int return_pages(self, int n, const int32_t* ids) except -1 nogil             # 0, or raises (the pages stay accounted for)
    cdef int return_pages_fast(self, int n, const int32_t* ids) noexcept nogil        # 0 / _NEED_SLOW (nothing changed)
    cdef int64_t available_weight(self, bint by_weight, int64_t max_new_pages) noexcept nogil   # counters only
    # internals: `noexcept` ones are bookkeeping under `lock`; `except -1` ones may call the driver
    cdef int _take(self, int64_t need, bint by_weight, int32_t* out, int* n_out) except -1 nogil   # 0 / _OOM, or raises
    cdef int _take_pool_locked(self, int64_t need, bint by_weight, int32_t* out, int* n_out) noexcept nogil  # 0 / _NEED_SLOW
    cdef void _push_pool(self, int n, const int32_t* ids) noexcept nogil     # ids onto the pool's top, in order
    cdef void _unpop_pool(self, int n, const int32_t* ids) noexcept nogil    # undo taking ids off the pool's top
    cdef void _to_transit(self, int n, const int32_t* ids) noexcept nogil    # ids (out of every set) into transit
    cdef void _release_page(self, int32_t page_id) noexcept nogil            # an unmapped id back to free / outside
    cdef void _queue_pending_locked(self, int n, const int32_t* ids, uintptr_t fence) noexcept nogil  # mapped ids behind one fence
    cdef int _settle_unmapped(self, int n, const int32_t* ids) noexcept nogil   # transit ids after an unmap or a failed map -> how many were unmapped
    cdef int _map_free_ids(self, int32_t* out, int np, int k, bint into_pool, int* pooled) except -1 nogil  # 0 / _OOM (settled), or raises
    cdef int _discard_used(self, int n, int32_t* ids) except -1 nogil        # unmap pages in use nobody will hand out; raises
    cdef int _check_usable(self) except -1 nogil                # 0, or raises KVCachedClosedError (closed / forked)
    cdef int _check_not_forked(self) except -1                  # 0, or raises KVCachedClosedError in a forked child
    cdef int _drain(self, bint wait_all) except -1 nogil        # 0, or raises (what failed stays pending or retried)
    cdef int _unmap_ids(self, int n, int32_t* ids) except -1 nogil   # 0, or raises past the unmap (ids settled anyway)
    cdef int _pool_out(self, int keep, int below) except -1 nogil    # 0, or raises as _unmap_ids
    cdef int _map_into_pool(self, int chunk, bint* failed) except -1 nogil   # pages pooled (0: nothing, or failed[0] set), or raises
    cdef int _refresh_physical(self) except -1 nogil            # 0, or raises (a driver query)
    cdef int _bind_weights(self, const int32_t* weights) except -1   # 0, or raises KVCachedConfigError (busy)


cdef int64_t _max_new_pages(object value) except -2   # -1 or a page count; raises TypeError / ValueError
