# The C-level contract of kvcached.core.refill: RefillPolicy (when a PageAllocator's pool is
# refilled and trimmed: its background thread, refill target, idle trim, budget gate) and
# Refillable, the part of a page allocator the policy reads and the mechanisms it calls.
# Refillable is declared here, below the allocator, so that the policy needs no cimport of
# pagealloc (Cython forbids a cycle): pagealloc's PageMapper subclasses it and defines the
# mechanisms, PageAllocator (below PageMapper) the pool take (Note [Refill policy]). Failure modes as everywhere in the core: `except -1` raises,
# out of memory is a value, `noexcept` is bookkeeping only. It cimports pagesets, pagetable and
# vmm; pagealloc cimports it.

from libc.stdint cimport int32_t, int64_t, uint64_t

from kvcached.core._posix cimport pthread_cond_t, pthread_mutex_t
from kvcached.core cimport pagesets, pagetable, vmm

# Lock order (see Note [Allocator locks] in blockalloc.pyx): BlockAllocator.lock ->
# Refillable.map_lock -> Refillable.lock -> Backend._lock. Nothing is waited on in the other
# direction. RefillPolicy has no lock: its fields are guarded by its allocator's `lock`.

cdef class RefillPolicy


cdef class Refillable:
    # What a RefillPolicy reads and drives; pagealloc.pxd's PageMapper and PageAllocator define it.
    cdef pthread_mutex_t lock                   # state lock: led and the fields below; never held across a driver or Python call
    cdef pthread_mutex_t map_lock               # serialises page-table calls (map/unmap); waited on only without the GIL
    cdef pagesets.PageLedger led                # every page id's state, the free set, the pool, the pending ring, the counts
    cdef readonly pagetable.PageTable table    # maps and unmaps the page ids handed out
    cdef readonly int num_table_pages           # the table's num_pages: capacity never exceeds it
    cdef uint64_t pages_taken                   # pages handed out by take_pages / take_blocks, ever
    cdef uint64_t activity                      # take/return calls (the policy's idle rule reads it)
    cdef uint64_t num_slow_path                 # takes that took map_lock
    cdef double phys_time                       # monotonic seconds of the last free-physical-memory snapshot
    cdef public object last_error               # last exception caught off the caller's path (thread, free)

    # the mechanisms (pagealloc defines them; these raise NotImplementedError / return _NEED_SLOW)
    cdef int _take_pool_locked(self, int64_t need, bint by_weight, int32_t* out, int* n_out) noexcept nogil  # 0 / _NEED_SLOW; hold lock
    cdef int _map_into_pool(self, int chunk, bint* failed) except -1 nogil   # pages pooled (0: nothing, or failed[0] set), or raises
    cdef int _drain(self, bint wait_all) except -1 nogil        # 0, or raises (what failed stays pending or retried); hold map_lock
    cdef int _unmap_pool(self) except -1 nogil                  # 0, or raises: the pool behind a fence, cached handles released; hold map_lock
    cdef int _refresh_physical(self) except -1 nogil            # 0, or raises (a driver query); hold map_lock


cdef class RefillPolicy:
    # When the pool is refilled and trimmed; owned by one PageAllocator, which every method gets
    # as `pa` (no reference back: Note [Refill policy]). Fields guarded by pa.lock unless noted.
    cdef vmm.Lifecycle life                     # made here or inherited by a forked child (never closed)
    cdef pthread_cond_t wake                    # the background thread sleeps on it (with pa.lock)
    cdef pthread_cond_t pool_cv                 # broadcast when a refill round pools a page or ends (with pa.lock)
    cdef int min_reserved                       # the pool's floor: a round aims at least this high
    cdef int refill_target                      # pool size a refill round aims at, in [min_reserved, max_reserved]
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
    cdef bint _refill_covers(self, Refillable pa, int64_t need, bint by_weight) noexcept nogil   # the running round will cover `need`; hold pa.lock
    cdef int _wait_for_refill(self, Refillable pa, int64_t need, bint by_weight, int32_t* out, int* n_out) noexcept nogil  # 0 / _NEED_SLOW; takes pa.lock
    cdef int _gate_acquire(self, int n, size_t page_bytes) except -1 nogil  # 1 granted, 0 refused, or raises what the gate raised
    cdef int _gate_release(self, int n, size_t page_bytes) except -1 nogil  # 0, or raises what the gate raised
    cdef int _refill(self, Refillable pa) except -1 nogil                   # 0, or raises (the round ends, waiters woken)
    cdef int _bg_step(self, Refillable pa) except -1 nogil                  # 0 go on, 1 exit, or raises (the thread backs off)
    cdef int _start(self, Refillable pa) except -1                          # 0, or raises what Thread.start raised; GIL held
    cdef int _stop(self, Refillable pa) except -1                           # 0, or raises what Thread.join raised; GIL held
