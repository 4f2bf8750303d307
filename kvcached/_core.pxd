# The C-level interface of kvcached._core: every field commented, every cdef method's failure mode
# stated (`except -1` raises; out of memory is the value _OOM = 1; `noexcept` is bookkeeping only).

from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from cpython.ref cimport PyObject
from cuda.bindings cimport cydriver

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    int pthread_mutex_init(pthread_mutex_t*, void*)
    int pthread_mutex_destroy(pthread_mutex_t*)
    int pthread_mutex_lock(pthread_mutex_t*)
    int pthread_mutex_unlock(pthread_mutex_t*)

cdef enum:
    _MAX_CACHED_HANDLES = 256

cdef enum:
    # Backend fault injection (tests): the primitives that can be made to fail
    _FAULT_MAP = 0
    _FAULT_SET_ACCESS = 1
    _FAULT_UNMAP = 2
    _NUM_FAULT_OPS = 3


cdef class Backend:
    cdef pthread_mutex_t _lock                  # guards the cache, the counters, fault_countdown
    cdef readonly size_t granularity            # bytes; sizes and addresses are multiples of it
    cdef readonly str kind                      # "cuda" or "host"
    cdef readonly int device_id                 # CUDA ordinal; -1 for the host
    cdef readonly int cache_capacity            # most released handles kept for reuse
    cdef int cache_count                        # handles in the cache now
    cdef uint64_t cache_handles[_MAX_CACHED_HANDLES]
    cdef size_t cache_sizes[_MAX_CACHED_HANDLES]
    cdef readonly size_t cached_bytes           # bytes held by cached handles
    cdef readonly size_t physical_bytes         # bytes created and not released (cache included)
    cdef readonly uint64_t num_creates          # physical handles created
    cdef readonly uint64_t num_releases         # physical handles released
    cdef readonly uint64_t num_cache_hits       # acquisitions served from the cache
    cdef int64_t fault_countdown                # -1 off; 0: every acquisition reports _OOM
    cdef bint faults_armed                      # some fault_times[op] != 0: the primitives count calls
    cdef int64_t fault_after[_NUM_FAULT_OPS]    # successful calls of op before the next injected failure
    cdef int64_t fault_times[_NUM_FAULT_OPS]    # failures of op still to inject; -1 forever, 0 off
    cdef bint fault_oom[_NUM_FAULT_OPS]         # inject out of memory (_OOM) rather than a DriverError
    cdef readonly bint integrated_memory        # device memory is host memory (CU_DEVICE_ATTRIBUTE_INTEGRATED)
    cdef uint64_t live_token                    # == _fork_generation while usable; Note [Fork and close]
    cdef int creator_pid                        # process that made it (for the forked-child message)

    # primitives (subclasses); each raises on failure; _create, _map and _set_access return _OOM
    # when out of memory (nothing changed), _unmap raises (the mapping stays)
    cdef int _reserve(self, size_t size_bytes, uintptr_t* address) except -1 nogil
    cdef int _free_range(self, uintptr_t address, size_t size_bytes) except -1 nogil
    cdef int _create(self, size_t size_bytes, uint64_t* handle) except -1 nogil
    cdef int _release(self, uint64_t handle, size_t size_bytes) except -1 nogil
    cdef int _map(self, uintptr_t address, size_t size_bytes, uint64_t handle) except -1 nogil
    cdef int _set_access(self, uintptr_t address, size_t size_bytes, bint writable) except -1 nogil
    cdef int _unmap_status(self, uintptr_t address, size_t size_bytes) noexcept nogil  # 0, or errno / CUresult: the mapping stays
    cdef object _unmap_error(self, int code)    # the DriverError for a code _unmap_status returned
    cdef int _record_fence(self, uintptr_t stream, uintptr_t* fence) except -1 nogil
    cdef int _fence_done(self, uintptr_t fence) except -1 nogil       # 1 done, 0 not yet
    cdef int _release_fence(self, uintptr_t fence) except -1 nogil
    cdef int _free_physical_bytes(self, size_t* free_bytes) except -1 nogil
    # shared
    cdef int _unmap(self, uintptr_t address, size_t size_bytes) except -1 nogil   # _unmap_status, raising
    cdef int acquire_handle(self, size_t size_bytes, uint64_t* handle) except -1 nogil   # 0 / _OOM
    cdef int recycle_handle(self, uint64_t handle, size_t size_bytes) except -1 nogil
    cdef int _release_counted(self, uint64_t handle, size_t size_bytes) except -1 nogil
    cdef int release_cached_handles(self) except -1 nogil
    cdef int check_aligned(self, size_t value, str what) except -1
    cdef int _check_live(self) except -1 nogil                 # raises in a forked child
    cdef int _injected_fault(self, int op) except -1 nogil     # 0 / _OOM, or raises; tests only
    cdef int _fault_fires(self, int op) noexcept nogil         # 0 run, 1 error, 2 out of memory; tests only


cdef class CudaBackend(Backend):
    cdef cydriver.CUdevice device
    cdef cydriver.CUcontext context             # the device's primary context (torch's too)
    cdef bint has_context                       # primary context retained, to release at exit
    cdef cydriver.CUmemAllocationProp prop      # pinned device memory on `device`
    cdef cydriver.CUmemAccessDesc access_rw     # read-write for the device
    cdef cydriver.CUmemAccessDesc access_ro     # read-only (the shared zero page)
    cdef int _bind(self) except -1 nogil        # make the primary context current on this thread


cdef class HostBackend(Backend):
    cdef int fd                                 # the pool memfd: every page is a slot of it
    cdef readonly size_t capacity_bytes         # most bytes the pool hands out ("device memory")
    cdef size_t pool_end                        # slots below this offset were handed out once
    cdef size_t pool_span_bytes                 # size of the memfd: offsets available for slots
    cdef uint64_t* free_offsets                 # released slots, reused before pool_end grows
    cdef size_t* free_sizes
    cdef Py_ssize_t num_free
    cdef Py_ssize_t cap_free


cdef class VirtualRange:
    cdef readonly Backend backend
    cdef readonly uintptr_t address             # base; never changes for the range's life
    cdef readonly size_t size_bytes
    cdef bint freed                             # reservation given back
    cdef uint64_t live_token                    # Note [Fork and close]
    @staticmethod
    cdef VirtualRange _wrap(Backend backend, uintptr_t address, size_t size_bytes)


cdef class PageTable:
    cdef pthread_mutex_t lock                   # serialises map_pages / unmap_pages / close; waited on without the GIL
    cdef uint64_t live_token                    # Note [Fork and close]; _TOKEN_CLOSED after close()
    cdef int creator_pid
    cdef readonly uint64_t num_rollback_failures  # undo steps of failed maps that failed too
    cdef readonly object last_rollback_error    # the latest of them
    cdef readonly uint64_t num_unmap_failures   # segment unmaps the driver refused (the segment stayed mapped)
    cdef readonly object last_unmap_error       # the latest of them
    cdef readonly Backend backend
    cdef readonly int num_pages                 # page ids are [0, num_pages)
    cdef readonly int num_segments              # mappings per page id
    cdef readonly size_t map_bytes              # bytes of each mapping
    cdef readonly int num_mapped                # page ids mapped now
    cdef readonly bint zero_page                # unmapped page ids show a shared read-only zero page
    cdef list ranges                            # keeps the segments' ranges alive
    cdef uintptr_t* segment_base                # segment i of page p is at segment_base[i] + p * map_bytes
    cdef uint64_t* handles                      # [page * num_segments + segment]; 0 = none
    cdef uint8_t* mapped                        # per page id: 0 unmapped, 1 mapped, 2 partly unmapped after a failure (unmap only)
    cdef uint64_t zero_handle                   # the shared zero page (0 when zero_page is off)
    cdef readonly object mirror                 # repeats maps/unmaps on peers, or None (Note [Mirrored page table])
    cdef int map_pages(self, const int32_t* page_ids, int n) except -1 nogil    # 0 / _OOM; all or nothing, mirrored
    cdef int _map_mirrored(self, const int32_t* page_ids, int n) except -1      # GIL held
    cdef int _map_local(self, const int32_t* page_ids, int n) except -1 nogil   # 0 / _OOM; all or nothing, this table only
    cdef int unmap_pages(self, const int32_t* page_ids, int n) except -1 nogil  # returns how many the driver refused; mirrored
    cdef int _unmap_mirrored(self, const int32_t* page_ids, int n) except -1    # GIL held
    cdef int _unmap_local(self, const int32_t* page_ids, int n) except -1 nogil # this table only
    cdef int _check_usable(self) except -1 nogil                                # raises when closed / forked
    cdef int _map_forward(self, const int32_t* page_ids, int n, int* pages_done, int* segments_done, int* stage) except -1 nogil
    cdef int _undo_map(self, const int32_t* page_ids, int pages_done, int segments_done, int stage, int cached_before, bint raising) except -1 nogil
    cdef int _map_rollback(self, const int32_t* page_ids, int pages_done, int segments_done, int stage) except -1   # GIL held
    cdef object _unmap_segment_caught(self, int32_t page_id, int segment, object first)
    cdef bint _page_has_handles(self, int32_t page_id) noexcept nogil
    cdef int _unmap_segment(self, int32_t page_id, int segment) except -1 nogil
    cdef int _remap_zero(self, uintptr_t address) except -1 nogil
    cdef int _close_locked(self) except -1
    cdef int _small_ids(self, page_ids, bint want_mapped, int32_t* out) except -2
    cdef object _checked_ids(self, page_ids, bint want_mapped)


# -- page allocator and block allocator ------------------------------------------------------
# Lock order (see Note [Allocator locks] in _block_allocator.pxi): BlockAllocator.lock ->
# PageAllocator.map_lock -> PageAllocator.lock -> Backend._lock. Nothing is waited on in the
# other direction.

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_cond_t:
        pass
    ctypedef struct pthread_condattr_t:
        pass
    int pthread_mutex_trylock(pthread_mutex_t*)
    int pthread_condattr_init(pthread_condattr_t*)
    int pthread_condattr_setclock(pthread_condattr_t*, int)
    int pthread_condattr_destroy(pthread_condattr_t*)
    int pthread_cond_init(pthread_cond_t*, pthread_condattr_t*)
    int pthread_cond_destroy(pthread_cond_t*)
    int pthread_cond_signal(pthread_cond_t*)
    int pthread_cond_broadcast(pthread_cond_t*)
    int pthread_cond_wait(pthread_cond_t*, pthread_mutex_t*)
    int pthread_cond_timedwait(pthread_cond_t*, pthread_mutex_t*, const void*)

cdef extern from "<time.h>" nogil:
    cdef struct timespec:
        long tv_sec
        long tv_nsec
    int clock_gettime(int, timespec*)
    int CLOCK_MONOTONIC

cdef enum:
    _NEED_SLOW = 2      # a fast (GIL-held, driver-free) worker could not serve: retry the slow way
    _BAD_ID = 3         # BlockAllocator._free_locked: an id is unknown / not allocated / repeated

cdef enum:
    # PageAllocator.state[page_id]; every page id of the table is in exactly one state
    _PS_OUTSIDE = 0     # not handed out: at or above capacity_pages, or holds no block (weight 0)
    _PS_FREE = 1        # below capacity, unmapped, in the free set
    _PS_POOL = 2        # mapped, unused: the reserved pool
    _PS_USED = 3        # mapped, handed out by take_pages / take_blocks
    _PS_PENDING = 4     # returned, still mapped until its fence is done (then unmapped)
    _PS_TRANSIT = 5     # being mapped or unmapped by the holder of map_lock

cdef enum:
    # BlockAllocator.block_state[block_id]
    _BS_FREE = 0        # a valid id, not allocated (its page may or may not be mapped)
    _BS_ALLOCATED = 1   # handed out by alloc
    _BS_INVALID = 2     # in no page's interval (straddles two pages, or beyond the last page)
    _BS_HELD = 3        # allocated on behalf of try_to_reserve, not yet handed out
    _BS_MARK = 4        # transient, inside free(): seen once in this call


cdef class PageAllocator:
    cdef uint64_t live_token                    # Note [Fork and close]; _TOKEN_CLOSED after close()
    cdef int creator_pid
    cdef readonly PageTable table
    cdef readonly Backend backend
    cdef pthread_mutex_t lock                   # state lock: everything below; never held across a driver or Python call
    cdef pthread_mutex_t map_lock               # serialises page-table calls (map/unmap); waited on only without the GIL
    cdef pthread_cond_t wake                    # the background thread sleeps on it (with `lock`)
    cdef pthread_cond_t pool_cv                 # broadcast when a refill round pools a page or ends (with `lock`)
    cdef readonly int num_table_pages           # the table's num_pages: capacity never exceeds it
    cdef readonly int capacity_pages            # page ids [0, capacity_pages) may be handed out
    cdef readonly int min_reserved              # background thread keeps the pool at least this big
    cdef readonly int max_reserved              # returned pages beyond this many pooled ones are unmapped
    cdef readonly int refill_target             # pool size a refill round aims at, in [min_reserved, max_reserved]
    cdef bint bg_refilling                      # a refill round runs: short callers wait for it (Note [Proactive refill])
    cdef uint64_t pages_taken                   # pages handed out by take_pages / take_blocks, ever
    cdef uint64_t num_pool_waits                # takes that waited for a refill round's pages
    cdef readonly double idle_trim_s            # trim the pool after this long without take/return; 0 off
    cdef readonly int limit_pages               # in-use + pool never exceed it; -1 = no limit
    cdef public uintptr_t stream                # CUstream the fences of returned pages are recorded on
    cdef readonly size_t page_bytes             # physical bytes of one page id (all its segments)
    cdef uint8_t* state                         # [page] one of _PS_*
    cdef int32_t* weight                        # [page] blocks the page holds (1 until a BlockAllocator binds)
    cdef bint weights_bound                     # a BlockAllocator set the weights
    cdef int32_t* fw_count                      # Fenwick tree over page ids: 1 per free id
    cdef int64_t* fw_weight                     # Fenwick tree over page ids: weight per free id
    cdef int fw_top                             # highest power of two <= num_table_pages
    cdef int num_free                           # ids in the free set
    cdef int num_pool                           # ids in the pool
    cdef int num_used                           # ids handed out
    cdef int num_pending                        # ids waiting for their fence
    cdef int num_transit                        # ids in flight under map_lock
    cdef int refill_transit                     # of those, ids the background refill is mapping for the pool
    cdef int64_t refill_transit_weight          # their blocks (available_weight counts them as pool)
    cdef int64_t pool_weight                    # sum of the weights of the pool's ids
    cdef int32_t* pool                          # the pool, a stack (top = most recently returned)
    cdef int32_t* pend_ids                      # ring of pending ids, FIFO, batches contiguous
    cdef int pend_head                          # index of the oldest pending id in pend_ids
    cdef uintptr_t* batch_fence                 # ring of pending batches: the fence of each
    cdef int32_t* batch_count                   # ring of pending batches: ids in each
    cdef int batch_head                         # index of the oldest batch
    cdef int num_batches                        # batches in the ring
    cdef int32_t* scratch                       # ids being unmapped; used only by the holder of map_lock
    cdef int32_t* retry_ids                     # pending ids (no fence) whose unmap failed: unmapped again by _drain
    cdef int num_retry                          # ids in retry_ids (also counted in num_pending)
    cdef size_t phys_snapshot                   # backend's free physical bytes when last asked
    cdef size_t phys_base                       # backend.physical_bytes at that moment
    cdef double phys_time                       # monotonic seconds of that snapshot
    cdef bint has_gate                          # an external budget gate is set
    cdef object gate_acquire                    # acquire(nbytes) -> bool, called before mapping
    cdef object gate_release                    # release(nbytes), called after unmapping
    cdef bint bg_running                        # the background thread is running (signal it)
    cdef bint bg_stopping                       # stop() asked it to exit
    cdef bint bg_backoff                        # its last refill failed: sleep a full period first
    cdef bint idle_trimmed                      # pool trimmed (idle or trim()): no refill until activity
    cdef uint64_t activity                      # take/return calls, for the idle policy
    cdef uint64_t bg_seen_activity              # background thread: `activity` when it last looked
    cdef double bg_active_time                  # background thread: when it last saw activity change
    cdef object thread                          # the threading.Thread, or None
    cdef public object last_error               # last exception the background thread caught
    # counters
    cdef uint64_t num_maps, num_unmaps, num_pool_hits, num_slow_path, num_oom
    cdef uint64_t num_fences, num_idle_trims, num_refills
    cdef uint64_t num_unmap_failures            # page unmaps the driver refused (each retried later)
    cdef uint64_t num_refill_failures           # refill chunks that could not map (out of memory, gate, error)
    cdef uint64_t num_bg_rounds                 # rounds the background thread completed (tests wait on it)

    # the data path (callers: BlockAllocator, the manager); see each docstring for its locks
    cdef int take_pages(self, int n, int32_t* out) except -1 nogil                    # 0 / _OOM
    cdef int take_blocks(self, int64_t need, int32_t* out, int* n_out) except -1 nogil # 0 / _OOM
    cdef int take_pool(self, int64_t need, bint by_weight, int32_t* out, int* n_out) noexcept nogil  # 0 / _NEED_SLOW
    cdef int return_pages(self, int n, const int32_t* ids) except -1 nogil
    cdef int return_pages_fast(self, int n, const int32_t* ids) noexcept nogil        # 0 / _NEED_SLOW
    cdef int64_t available_weight(self, bint by_weight, int64_t max_new_pages) noexcept nogil
    # internals
    cdef int _take(self, int64_t need, bint by_weight, int32_t* out, int* n_out) except -1 nogil
    cdef int _take_pool_locked(self, int64_t need, bint by_weight, int32_t* out, int* n_out) noexcept nogil
    cdef void _unpop_pool(self, int n, const int32_t* ids) noexcept nogil
    cdef void _fw_add(self, int32_t page_id, int sign) noexcept nogil
    cdef int32_t _fw_pop_lowest(self) noexcept nogil
    cdef int _fw_count_for_weight(self, int64_t need) noexcept nogil
    cdef int64_t _fw_weight_of_lowest(self, int k) noexcept nogil
    cdef void _release_page(self, int32_t page_id) noexcept nogil
    cdef void _queue_retry(self, int32_t page_id) noexcept nogil
    cdef int _settle_failed_map(self, int n, const int32_t* ids) noexcept nogil
    cdef int _discard_used(self, int n, int32_t* ids) except -1 nogil          # unmap pages in use nobody will hand out
    cdef int _check_usable(self) except -1 nogil                # raises when closed / forked
    cdef int _check_not_forked(self) except -1                  # raises in a forked child
    cdef int _drain(self, bint wait_all) except -1 nogil
    cdef int _unmap_ids(self, int n, int32_t* ids) except -1 nogil
    cdef int _pool_out(self, int keep, int below) except -1 nogil
    cdef int _refill(self) except -1 nogil
    cdef int _refill_chunk(self, int chunk) except -1 nogil
    cdef bint _refill_covers(self, int64_t need, bint by_weight) noexcept nogil
    cdef int _wait_for_refill(self, int64_t need, bint by_weight, int32_t* out, int* n_out) noexcept nogil
    cdef int _refresh_physical(self) except -1 nogil
    cdef int _gate_acquire(self, int n) except -1 nogil
    cdef int _gate_release(self, int n) except -1 nogil
    cdef int _bg_step(self) except -1 nogil
    cdef int _bind_weights(self, const int32_t* weights) except -1


cdef class BlockAllocator:
    cdef uint64_t live_token                    # Note [Fork and close]; _TOKEN_CLOSED after close()
    cdef int creator_pid
    cdef readonly PageAllocator pages
    cdef pthread_mutex_t lock                   # guards everything below; see Note [Allocator locks]
    cdef readonly int num_pages                 # the page table's page ids
    cdef readonly int32_t max_block_id          # ids are < max_block_id
    cdef readonly int64_t id_to_page_num        # page of block b = b * num // den
    cdef readonly int64_t id_to_page_den
    cdef readonly int max_blocks_per_page       # largest page_num_blocks
    cdef readonly int64_t total_blocks          # sum of page_num_blocks
    cdef int32_t* page_first                    # [page] first block id of the page's interval
    cdef int32_t* page_blocks                   # [page] blocks in the interval
    cdef int64_t* slot_base                     # [page] where the page's free-id stack starts in `slots`
    cdef int32_t* slots                         # free-id stacks, one per page, total_blocks long
    cdef int32_t* page_free                     # [page] free ids of an owned page (stack height)
    cdef uint8_t* page_owned                    # [page] 1: taken from the page allocator and not returned
    cdef uint8_t* page_mark                     # [page] scratch inside _free_locked: touched in this call
    cdef uint8_t* block_state                   # [block] one of _BS_*
    cdef int32_t* bucket_head                   # [free count] first partially used page with that many free; -1 none
    cdef int32_t* page_next                     # [page] bucket list links
    cdef int32_t* page_prev
    cdef uint64_t* bucket_bits                  # bit f set: bucket f not empty
    cdef int bucket_words                       # 64-bit words of bucket_bits
    cdef int64_t partial_free                   # free ids in owned pages
    cdef int64_t num_allocated                  # ids handed out by alloc (held ids not counted)
    cdef int32_t* held                          # try_to_reserve's ids, a stack
    cdef int64_t num_held
    cdef int num_owned                          # owned pages
    cdef int32_t* page_buf                      # page ids to/from the page allocator; used under `lock`
    cdef PyObject** id_objs                     # [block] the int object alloc hands out for it, or NULL (GIL)
    cdef int32_t id_objs_len                    # ids below this use id_objs; Note [Block id objects]
    cdef uint8_t* page_adopted                  # [page] 1: ever taken, so its ids may sit in id_objs
    cdef public bint debug_checks               # check_invariants() after every public call
    cdef uint64_t num_allocs, num_frees, num_failed_allocs
    cdef int num_inflight                       # allocs taking pages without the lock (Note [Allocator locks])

    cdef int _alloc_locked(self, int n, int32_t* out, bint may_block, bint use_held) except -1 nogil  # 0 / _OOM / _NEED_SLOW
    cdef int _free_locked(self, int n, const int32_t* ids, int* n_empty, int64_t* bad) noexcept nogil  # 0 / _BAD_ID
    cdef void _adopt(self, int32_t page_id) noexcept nogil
    cdef void _bucket_insert(self, int32_t page_id, int count) noexcept nogil
    cdef void _bucket_remove(self, int32_t page_id, int count) noexcept nogil
    cdef int _bucket_at_least(self, int count) noexcept nogil
    cdef int _bucket_highest(self) noexcept nogil
    cdef int _take_from(self, int32_t page_id, int k, int32_t* out) noexcept nogil
    cdef int _lock(self) except -1                                                   # GIL held
    cdef int _raise_unusable(self) except -1                                         # always raises KVCachedError
    cdef int _check_not_forked(self) except -1
    cdef int _clear_locked(self) except -1
    cdef int _run_alloc(self, int n, int32_t* out, bint use_held, bint hold=*) except -1   # 0 / _OOM; GIL held
    cdef int _hold(self, int n, const int32_t* ids) noexcept nogil
    cdef int _place(self, int n, int h, int np_new, int32_t* out) noexcept nogil     # -> unneeded new pages, in page_buf
    cdef int _run_free(self, int n, const int32_t* ids) except -1                    # raises BlockStateError; GIL held
    cdef int _return_pages(self, int ne) except -1                                   # page_buf[0..ne) back; never raises past the free
