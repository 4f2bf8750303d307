# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, auto_pickle=False
"""kvcached.core.pagealloc: whole pages for the block allocator above it.

PageAllocator hands out free page ids, keeps the reserved pool, defers unmaps behind fences and
applies limits. Where each page id is — its state, the free set, the pool, the pending ring with
the unmap retries, the counts across them and the limit rule — is its page ledger
(kvcached.core.pagesets: C structs with inline operations and their own checks). The class is cut
in two along the driver call: PageMapper holds the driver work that moves ids through transit
(map, unmap, fences, failed unmaps) and PageAllocator, its one subclass, the data path (take and
return, the pool fast path) and the Python surface; neither alone would stay a class one can read
whole (each under 600 lines). When the pool is refilled or trimmed is its RefillPolicy's decision
(kvcached.core.refill: Note [Refill policy]); PageMapper is the Refillable that policy drives.

It stands on kvcached.core.refill, kvcached.core.pagesets (inline struct operations, compiled in
here) and kvcached.core.pagetable (PageTable: what one page id maps, all-or-nothing) over
kvcached.core.vmm (checked driver calls, the backends and their handle cache). Calls into them are
vtable calls through their .pxd contracts; nothing here touches their locks or the handle cache.
kvcached.core.blockalloc (BlockAllocator) is the only module above it.

Every cdef function says how it fails: ``except -1`` raises (driver and syscall errors), and out of
memory is the value ``_OOM`` (1), never an exception, so callers can roll back and return None.
"""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy

from kvcached.core._posix cimport (
    _now, pthread_cond_broadcast, pthread_cond_signal, pthread_mutex_destroy, pthread_mutex_init, pthread_mutex_lock,
    pthread_mutex_trylock, pthread_mutex_unlock, usleep,
)
from kvcached.core.pagesets cimport (
    _NEED_SLOW, _PS_USED, freeset_count_for_weight, freeset_pop_lowest, freeset_weight_of_lowest, ledger_bind_weights,
    ledger_check, ledger_headroom, ledger_init, ledger_pop_pool, ledger_push_pool, ledger_queue_pending,
    ledger_release, ledger_resize, ledger_settle_unmapped, ledger_to_transit, ledger_transit_to_used,
    ledger_unpop_pool, pending_num, pending_oldest_fence, pending_pop, pending_take_retries, pool_drop,
)
from kvcached.core.refill cimport RefillPolicy, Refillable
from kvcached.core.vmm cimport (
    _OOM, lifecycle_check, lifecycle_check_owned, lifecycle_close, lifecycle_init, lifecycle_live, lifecycle_name,
    lifecycle_owned,
)

from kvcached.checks import as_int
from kvcached.errors import KVCachedConfigError, MappingError


# PageAllocator: free page ids, the reserved pool, deferred unmap, resize, limits; the mechanisms
# its RefillPolicy drives. See Note [Page allocator states], Note [Mapping in transit],
# Note [Deferred unmap], Note [Failed unmap], Note [Refill policy] in refill.pyx.

cdef int64_t _MAX_NEW_PAGES = (<int64_t>1) << 62


cdef int64_t _max_new_pages(object value) except -2:
    """The max_new_pages argument of the available_* queries: -1 (no cap) or a page count."""
    if type(value) is int and -1 <= value <= _MAX_NEW_PAGES:
        return value
    return as_int(value, "max_new_pages", minimum=-1, maximum=_MAX_NEW_PAGES,
                  hint="pass the pages that may still be mapped (e.g. budget free bytes // page bytes), or -1 for no cap")


cdef class PageMapper(Refillable):
    """Moves page ids through transit: maps free ids for a take or into the pool, unmaps ids
    behind their fence, retries failed unmaps, and keeps the free-physical-memory figure — the
    driver work of a PageAllocator (its one subclass, which makes it and holds the data path).

    Every method here calls the page table, so each holds map_lock (they say which locks they
    take); the page ledger changes only under ``lock``, taken around the driver call, never
    across it (Note [Mapping in transit], Note [Deferred unmap], Note [Failed unmap]). The
    mechanisms its RefillPolicy drives (Refillable's) are defined here.
    """

    # -- mapping (the holder of map_lock) ------------------------------------------------------
    cdef int _map_free_ids(self, int32_t* out, int np, int k, bint into_pool, int* pooled) except -1 nogil:
        """Map the k lowest free ids into out[np..np + k): the one protocol of a slow take and
        of a refill chunk (Note [Mapping in transit]). Hold map_lock and lock; returns with lock
        released. A take (into_pool False) passes the np pool ids it already moved to used in
        out[0..np): on success all np + k are used; on failure the pool ids go back onto the pool
        in their old order. A refill (into_pool True, np = 0) pools what still fits the pool and
        the limit (pooled[0]); the rest stay in transit for the caller to unmap. On failure the
        free ids go back (Note [Failed unmap]) and the gate gets back what it granted for them.
        Returns 0 mapped, _OOM (the gate refused, out of memory), or raises (settled as failed)."""
        cdef int32_t* ids = out + np
        cdef int i, rc = 0, unmapped = 0, fits = 0
        cdef bint finished = False, gated = False
        for i in range(k):
            ids[i] = freeset_pop_lowest(&self.led.free_set)
            if into_pool:
                self.led.refill_transit_weight += self.led.weight[ids[i]]
        ledger_to_transit(&self.led, k, ids)
        if into_pool:
            self.led.refill_transit += k
        pthread_mutex_unlock(&self.lock)
        try:
            if self.policy._gate_acquire(k, self.page_bytes) == 0:
                rc = _OOM
            else:
                gated = True
                rc = self.table.map_pages(ids, k)
            finished = True
        finally:
            pthread_mutex_lock(&self.lock)
            if into_pool:
                self.led.refill_transit -= k
                for i in range(k):
                    self.led.refill_transit_weight -= self.led.weight[ids[i]]
            if finished and rc == 0 and into_pool:
                # a limit set, or returns that filled the pool, while we mapped win: keep only
                # what still fits (the pool never exceeds max_reserved)
                fits = <int>max(0, min(k, self.led.max_reserved - self.led.pool.num, ledger_headroom(&self.led) + k))
                ledger_push_pool(&self.led, fits, ids)
                self.led.num_transit -= fits
                self.num_maps += k
                self.num_refills += 1
                pooled[0] = fits
                if fits:
                    pthread_cond_broadcast(&self.policy.pool_cv)
            elif finished and rc == 0:
                ledger_transit_to_used(&self.led, k, ids)
                self.num_maps += k
                self.pages_taken += np + k
                if self.policy.bg_running and self.led.pool.num < self.policy.refill_target:
                    pthread_cond_signal(&self.policy.wake)     # the slow path emptied the pool: refill now
            else:
                unmapped = ledger_settle_unmapped(&self.led, k, ids, self.table.mapped)
                self.led.num_transit -= k
                if into_pool:
                    self.num_refill_failures += 1
                else:
                    self.led.num_used -= np
                    ledger_unpop_pool(&self.led, np, out)
                    self.num_oom += 1
            pthread_mutex_unlock(&self.lock)
            if gated and unmapped:
                self.policy._gate_release(unmapped, self.page_bytes)
        return rc

    # -- unmapping (the holder of map_lock) ---------------------------------------------------
    cdef int _discard_used(self, int n, int32_t* ids) except -1 nogil:
        """Unmap pages in use that their taker cannot hand out (its BlockAllocator was closed
        while it mapped them). Takes map_lock and lock."""
        if n <= 0:
            return 0
        pthread_mutex_lock(&self.map_lock)
        try:
            pthread_mutex_lock(&self.lock)
            ledger_to_transit(&self.led, n, ids)
            self.led.num_used -= n
            pthread_mutex_unlock(&self.lock)
            self._unmap_ids(n, ids)
        finally:
            pthread_mutex_unlock(&self.map_lock)
        return 0

    cdef int _unmap_ids(self, int n, int32_t* ids) except -1 nogil:
        """Unmap ids in transit (hold map_lock, not lock) and put them back as free/outside; an id
        the driver refused to unmap stays mapped and counted, queued for a retry by the next
        drain, never lost (Note [Failed unmap]). The budget gate gets back exactly the pages
        unmapped. Raises only for failures past the unmap itself (the ids settled the same way)."""
        cdef int unmapped = 0
        if n <= 0:
            return 0
        try:
            self.table.unmap_pages(ids, n)
        finally:
            pthread_mutex_lock(&self.lock)
            unmapped = ledger_settle_unmapped(&self.led, n, ids, self.table.mapped)
            self.led.num_transit -= n
            self.num_unmaps += unmapped
            if unmapped < n:
                self.num_unmap_failures += n - unmapped
            pthread_mutex_unlock(&self.lock)
            self.policy._gate_release(unmapped, self.page_bytes)
        return 0

    cdef int _drain(self, bint wait_all) except -1 nogil:
        """Unmap pending batches, oldest first, while their fence is done; with wait_all, wait
        for every fence (polling, 50 us). Hold map_lock. Stops at the first fence not done:
        fences of one stream complete in order. Then unmaps again, once, the ids whose unmap
        failed before (Note [Failed unmap])."""
        cdef uintptr_t fence
        cdef int c
        while True:
            pthread_mutex_lock(&self.lock)
            if self.led.pending.num_batches == 0:
                c = pending_take_retries(&self.led.pending, self.scratch)
                ledger_to_transit(&self.led, c, self.scratch)
                pthread_mutex_unlock(&self.lock)
                return self._unmap_ids(c, self.scratch)
            fence = pending_oldest_fence(&self.led.pending)
            pthread_mutex_unlock(&self.lock)
            if self.backend._fence_done(fence) != 1:
                if not wait_all:
                    return 0
                usleep(50)
                continue
            pthread_mutex_lock(&self.lock)
            c = pending_pop(&self.led.pending, self.scratch)
            ledger_to_transit(&self.led, c, self.scratch)
            pthread_mutex_unlock(&self.lock)
            self.backend._release_fence(fence)
            self._unmap_ids(c, self.scratch)

    cdef int _pool_out(self, int keep, int below) except -1 nogil:
        """Take pool ids >= `below`, then pool ids from the top until at most `keep` remain
        (keep < 0: what the limit allows), and queue them behind one fence recorded now: kernels
        queued before their blocks were freed may still read them (Note [Deferred unmap]). Then
        unmaps what is due (on the host: all of it). Hold map_lock. If the fence cannot be
        recorded the ids go back onto the pool, mapped, and the error is raised."""
        cdef int n, k = -1
        cdef uintptr_t fence = 0
        pthread_mutex_lock(&self.lock)
        if keep < 0:
            keep = <int>max(0, min(self.led.pool.num, self.led.pool.num + ledger_headroom(&self.led)))
        n = pool_drop(&self.led.pool, below, keep, self.scratch)
        ledger_to_transit(&self.led, n, self.scratch)
        pthread_mutex_unlock(&self.lock)
        if n == 0:
            return 0
        try:
            self.backend._record_fence(self.stream, &fence)
            k = 0
        finally:
            pthread_mutex_lock(&self.lock)
            self.led.num_transit -= n
            if k == 0:
                ledger_queue_pending(&self.led, n, self.scratch, fence)
                self.num_fences += 1
            else:
                ledger_push_pool(&self.led, n, self.scratch)     # no fence: nothing may be unmapped
            pthread_mutex_unlock(&self.lock)
        return self._drain(False)

    cdef int _unmap_pool(self) except -1 nogil:
        """The whole pool behind a fence (_pool_out), and the backend's cached handles released
        (trim and the idle trim). Hold map_lock."""
        self._pool_out(0, self.num_table_pages)
        return self.backend.release_cached_above(0)

    # -- filling the pool (driven by the RefillPolicy) ----------------------------------------
    cdef int _map_into_pool(self, int chunk, bint* failed) except -1 nogil:
        """Map up to `chunk` free ids into the pool, towards the policy's refill_target (none
        while it stops or the pool was trimmed), the driver call outside `lock`; returns how
        many went into the pool (0: nothing to do, or out of memory / the gate refused, which
        sets failed[0]). Takes map_lock. See Note [Background thread]."""
        cdef int k, rc = _OOM, fits = 0
        pthread_mutex_lock(&self.map_lock)
        try:
            pthread_mutex_lock(&self.lock)
            k = 0
            if not (self.policy.bg_stopping or self.policy.idle_trimmed):
                k = <int>min(self.policy.refill_target - self.led.pool.num, self.led.free_set.num, chunk,
                             ledger_headroom(&self.led))
            if k <= 0:
                pthread_mutex_unlock(&self.lock)
                return 0
            try:
                rc = self._map_free_ids(self.scratch, 0, k, True, &fits)
            finally:
                if rc != 0:
                    failed[0] = True
            if rc != 0:
                self._refresh_physical()
                return 0
            elif fits < k:
                self._unmap_ids(k - fits, self.scratch + fits)
            return fits
        finally:
            pthread_mutex_unlock(&self.map_lock)

    cdef int _refresh_physical(self) except -1 nogil:
        """Ask the backend for its free physical bytes (a driver call on CUDA). Hold map_lock."""
        cdef size_t free_bytes = 0, base
        self.backend._free_physical_bytes(&free_bytes)
        base = self.backend.physical_bytes_locked()
        pthread_mutex_lock(&self.lock)
        self.phys_snapshot = free_bytes
        self.phys_base = base
        self.phys_time = _now()
        pthread_mutex_unlock(&self.lock)
        return 0


cdef class PageAllocator(PageMapper):
    """Hands out mapped page ids of one PageTable, keeping a pool of mapped, unused ones.

    Page ids live in exactly one state (Note [Page allocator states]): free (unmapped, below
    capacity), pool (mapped, unused), used (handed out), pending (returned, unmapped once the GPU
    work queued before the return has finished), or outside (above capacity). The free set is a
    Fenwick tree rather than a plain stack so that the lowest ids go first (a shrink finds the top
    ids free more often) and so that "the weight of the next k pages" — the blocks they hold,
    needed by available_blocks() — is an O(log pages) query. The states and the sets are its
    page ledger (kvcached.core.pagesets), the driver work its PageMapper base. When the pool is
    refilled or trimmed is its RefillPolicy's decision (Note [Refill policy]).

    Lock rule: ``lock`` guards the state and is never held across a driver or Python call, so it
    may be waited on with the GIL held; ``map_lock`` serialises every page-table call (the table is
    not thread-safe, and the driver serialises mappings anyway) and is only ever waited on without
    the GIL. Order: map_lock before lock. Python methods take what they need; cdef methods say
    which they take in their docstring.
    """

    def __cinit__(self, *args, **kwargs):
        pthread_mutex_init(&self.lock, NULL)
        pthread_mutex_init(&self.map_lock, NULL)
        self.policy = RefillPolicy.__new__(RefillPolicy)   # never None: the fast path reads it unchecked
        self.led.limit = -1
        lifecycle_init(&self.life)

    def __init__(self, pagetable.PageTable page_table not None, num_pages=None, int min_reserved=5, int max_reserved=10,
                 double idle_trim_s=30.0):
        """page_table: the table whose ids are handed out; num_pages: initial capacity (page ids
        [0, num_pages)), default the table's num_pages; min_reserved / max_reserved: bounds of
        the pool, in pages; idle_trim_s: seconds without take/return after which the background
        thread trims the pool (0 disables).

        Raises KVCachedConfigError for a capacity outside [0, table.num_pages], negative pool
        bounds, min_reserved > max_reserved, or a negative idle_trim_s."""
        cdef int P = page_table.num_pages
        capacity = P if num_pages is None else int(num_pages)
        if not 0 <= capacity <= P:
            raise KVCachedConfigError(
                f"num_pages={capacity} is outside [0, {P}]: the page table reserves {P} page ids; "
                f"pass at most {P} or build a larger table.")
        if min_reserved < 0 or max_reserved < 0 or min_reserved > max_reserved:
            raise KVCachedConfigError(
                f"pool bounds min_reserved={min_reserved}, max_reserved={max_reserved} must satisfy "
                f"0 <= min_reserved <= max_reserved.")
        if idle_trim_s < 0:
            raise KVCachedConfigError(f"idle_trim_s={idle_trim_s} must be >= 0 (0 disables idle trimming).")
        self.table = page_table
        self.backend = page_table.backend
        self.num_table_pages = P
        self.policy.min_reserved = min_reserved
        self.policy.refill_target = min_reserved
        self.policy.idle_trim_s = idle_trim_s
        self.page_bytes = page_table.num_segments * page_table.map_bytes
        self.scratch = <int32_t*>malloc(max(1, P) * sizeof(int32_t))
        if self.scratch == NULL or ledger_init(&self.led, P, capacity, max_reserved) != 0:
            raise MemoryError("no memory for the page allocator")
        with nogil:
            pthread_mutex_lock(&self.map_lock)
            try:
                self._refresh_physical()
            finally:
                pthread_mutex_unlock(&self.map_lock)
        self.policy.bg_active_time = _now()

    def __dealloc__(self):
        cdef int i
        cdef bint own = lifecycle_owned(&self.life)      # a forked child touches nothing: Note [Fork and close]
        if own and self.led.pending.fence != NULL and self.backend is not None:
            for i in range(self.led.pending.num_batches):
                try:
                    self.backend._release_fence(self.led.pending.fence[(self.led.pending.batch_head + i) % self.led.pending.size])
                except Exception:
                    pass
        ledger_release(&self.led)
        free(self.scratch)
        if own:
            pthread_mutex_destroy(&self.map_lock)
            pthread_mutex_destroy(&self.lock)

    cdef int _check_usable(self) except -1 nogil:
        """Raise KVCachedClosedError when closed or in a forked child (Note [Fork and close])."""
        return lifecycle_check(&self.life, b"PageAllocator",
                               b"its manager was closed or kvcached shut down; make a new manager.")

    cdef int _check_not_forked(self) except -1:
        # read-only surfaces (stats, checks) still answer on a closed allocator
        return lifecycle_check_owned(&self.life, b"PageAllocator")

    @property
    def lifecycle(self) -> str:
        """"live", "closed" (close() was called) or "forked" (inherited by a forked child)."""
        return lifecycle_name(&self.life)

    # -- taking pages -------------------------------------------------------------------------
    cdef int _take_pool_locked(self, int64_t need, bint by_weight, int32_t* out, int* n_out) noexcept nogil:
        cdef int k = ledger_pop_pool(&self.led, need, by_weight, out)
        if k == 0:
            return _NEED_SLOW
        n_out[0] = k
        self.num_pool_hits += 1
        self.pages_taken += k
        self.activity += 1
        self.policy.idle_trimmed = False
        if self.policy.bg_running and self.led.pool.num < self.policy.refill_target:
            pthread_cond_signal(&self.policy.wake)
        return 0

    cdef int take_pool(self, int64_t need, bint by_weight, int32_t* out, int* n_out) noexcept nogil:
        """Pages holding `need` weight (blocks when by_weight, else pages) from the pool only.

        Returns 0 with the ids in out[0..n_out), or _NEED_SLOW with nothing taken. No driver
        call, no Python: safe with the GIL held. Takes `lock`."""
        cdef int rc
        n_out[0] = 0
        if need <= 0:
            return 0
        pthread_mutex_lock(&self.lock)
        rc = self._take_pool_locked(need, by_weight, out, n_out)
        pthread_mutex_unlock(&self.lock)
        return rc

    cdef int take_pages(self, int n, int32_t* out) except -1 nogil:
        """n mapped page ids into out[0..n): from the pool first, else free ids mapped in one
        batched page-table call. Returns 0, or _OOM with everything exactly as before. Call
        without the GIL (it may map). Takes map_lock (slow path) and lock."""
        cdef int got = 0
        return self._take(n, False, out, &got)

    cdef int take_blocks(self, int64_t need, int32_t* out, int* n_out) except -1 nogil:
        """The fewest pages — pool pages first (top down), then the lowest free ids — whose
        weights (blocks, set by the BlockAllocator) sum to at least `need`. Same contract as
        take_pages; the ids are in out[0..n_out)."""
        return self._take(need, True, out, n_out)

    cdef int _take(self, int64_t need, bint by_weight, int32_t* out, int* n_out) except -1 nogil:
        cdef int np, k, pooled
        cdef int64_t rest
        n_out[0] = 0
        if need <= 0:
            return 0
        if self.take_pool(need, by_weight, out, n_out) == 0:
            return 0
        if self.policy._wait_for_refill(self, need, by_weight, out, n_out) == 0:
            return 0
        self._check_usable()
        pthread_mutex_lock(&self.map_lock)
        try:
            self._check_usable()    # closed while we waited for map_lock
            self._drain(False)
            pthread_mutex_lock(&self.lock)
            self.num_slow_path += 1
            if self._take_pool_locked(need, by_weight, out, n_out) == 0:
                pthread_mutex_unlock(&self.lock)
                return 0
            # Capacity first, before anything changes (Note [Page allocator states]).
            rest = need - (self.led.pool.weight_sum if by_weight else self.led.pool.num)
            if by_weight:
                k = freeset_count_for_weight(&self.led.free_set, rest)
            else:
                k = <int>rest if rest <= self.led.free_set.num else -1
            if k > ledger_headroom(&self.led):
                k = -1
            if k < 0:
                self.num_oom += 1
                pthread_mutex_unlock(&self.lock)
                return _OOM
            np = ledger_pop_pool(&self.led, self.led.pool.num, False, out)
            self.activity += 1
            self.policy.idle_trimmed = False
            if self._map_free_ids(out, np, k, False, &pooled) != 0:
                if np:      # returns may have filled the pool while we mapped: back within max_reserved
                    self._pool_out(self.led.max_reserved, self.num_table_pages)
                self._refresh_physical()
                return _OOM
            n_out[0] = np + k
            return 0
        finally:
            pthread_mutex_unlock(&self.map_lock)

    # -- returning pages ----------------------------------------------------------------------
    cdef int return_pages_fast(self, int n, const int32_t* ids) noexcept nogil:
        """Put n used pages into the pool if all fit (pool <= max_reserved, limit respected).
        Returns 0, or _NEED_SLOW with nothing changed. No driver call, no Python. Takes lock."""
        pthread_mutex_lock(&self.lock)
        if self.led.pool.num + n > self.led.max_reserved or ledger_headroom(&self.led) < 0:
            pthread_mutex_unlock(&self.lock)
            return _NEED_SLOW
        ledger_push_pool(&self.led, n, ids)
        self.led.num_used -= n
        self.activity += 1
        self.policy.idle_trimmed = False
        pthread_mutex_unlock(&self.lock)
        return 0

    cdef int return_pages(self, int n, const int32_t* ids) except -1 nogil:
        """Pages that became empty (each used; the caller checked): into the pool up to
        max_reserved (and the limit), the rest pending behind one fence recorded on `stream`,
        unmapped once it is done (Note [Deferred unmap]). Call without the GIL. Takes lock, and
        map_lock only if free (a busy one means someone else will drain)."""
        cdef int k = -1
        cdef uintptr_t fence = 0
        if n <= 0:
            return 0
        if self.return_pages_fast(n, ids) == 0:
            return 0
        try:
            self.backend._record_fence(self.stream, &fence)
            k = 0
        finally:
            if k != 0:
                # no fence, so nothing may be unmapped: the pages stay mapped, in the pool (even
                # past max_reserved; a trim or limit unmaps them later), never lost
                pthread_mutex_lock(&self.lock)
                ledger_push_pool(&self.led, n, ids)
                self.led.num_used -= n
                pthread_mutex_unlock(&self.lock)
        pthread_mutex_lock(&self.lock)
        k = <int>max(0, min(n, self.led.max_reserved - self.led.pool.num, ledger_headroom(&self.led) + n))
        ledger_push_pool(&self.led, k, ids)
        if n > k:
            ledger_queue_pending(&self.led, n - k, ids + k, fence)
            self.num_fences += 1
        self.led.num_used -= n
        self.activity += 1
        self.policy.idle_trimmed = False
        self.policy._wake_locked()
        pthread_mutex_unlock(&self.lock)
        if n == k:
            self.backend._release_fence(fence)
        elif pthread_mutex_trylock(&self.map_lock) == 0:
            try:
                self._drain(False)
            finally:
                pthread_mutex_unlock(&self.map_lock)
        return 0

    # -- the weights (BlockAllocator) ---------------------------------------------------------
    cdef int _bind_weights(self, const int32_t* weights) except -1:
        """Set each page's weight (the blocks it holds); pages of weight 0 are never handed out.
        Only before any page was taken or pooled. Raises KVCachedConfigError otherwise."""
        cdef bint busy
        with nogil:
            pthread_mutex_lock(&self.map_lock)
            pthread_mutex_lock(&self.lock)
            busy = self.weights_bound or not ledger_bind_weights(&self.led, weights)
            if not busy:
                self.weights_bound = True
            pthread_mutex_unlock(&self.lock)
            pthread_mutex_unlock(&self.map_lock)
        if busy:
            raise KVCachedConfigError(
                "this PageAllocator already serves a BlockAllocator or has pages mapped; build the "
                "BlockAllocator on a fresh PageAllocator, before start().")
        return 0

    cdef int64_t available_weight(self, bint by_weight, int64_t max_new_pages) noexcept nogil:
        """What take_blocks (by_weight) or take_pages could deliver now: the whole pool plus the
        lowest free ids that the limit, the free physical memory figure and `max_new_pages`
        (>= 0; -1 no cap: pages to be newly mapped, e.g. what a global budget still allows)
        allow. Counters only, no driver call. Takes lock; reads the backend's two byte counters
        without its lock (each an aligned word, and the answer is only promised while nothing
        changes)."""
        cdef int64_t free_phys, k
        cdef size_t physical, cached
        pthread_mutex_lock(&self.lock)
        physical = self.backend.physical_bytes
        cached = self.backend.cached_bytes
        free_phys = <int64_t>self.phys_snapshot - (<int64_t>physical - <int64_t>self.phys_base) + <int64_t>cached
        k = min(self.led.free_set.num, ledger_headroom(&self.led), free_phys // <int64_t>self.page_bytes - self.led.refill_transit)
        if max_new_pages >= 0:
            k = min(k, max_new_pages)
        k = max(0, k)
        # pages the refill is mapping reach the pool, and a caller short of pages waits for them
        if by_weight:
            k = self.led.pool.weight_sum + self.led.refill_transit_weight + freeset_weight_of_lowest(&self.led.free_set, <int>k)
        else:
            k += self.led.pool.num + self.led.refill_transit
        pthread_mutex_unlock(&self.lock)
        return k

    # -- Python surface -----------------------------------------------------------------------
    def available_pages(self, max_new_pages=-1) -> int:
        """Pages take_pages could deliver now: pool + min(free ids, free physical memory / page
        bytes, limit headroom, max_new_pages). max_new_pages caps the pages that would have to
        be newly mapped (-1: no cap), e.g. by what a global budget has left. O(1), no driver
        call (the physical figure is refreshed by the background thread and after out of
        memory, corrected by this backend's own creates and releases since). Exact on the host
        backend; on CUDA other processes may change it. Raises KVCachedClosedError when closed or in
        a forked child; KVCachedConfigError for a max_new_pages below -1 or not an integer."""
        self._check_usable()
        return self.available_weight(False, _max_new_pages(max_new_pages))

    def take(self, int n):
        """n mapped page ids (a list), or None when out of memory / over the limit (nothing
        changed). Raises ValueError for n < 0. For tests and tools; the BlockAllocator calls
        take_blocks."""
        cdef int32_t* out
        cdef int rc
        self._check_usable()
        if n < 0:
            raise ValueError(f"n={n} must be >= 0")
        if self.weights_bound:
            raise KVCachedConfigError("this PageAllocator serves a BlockAllocator; take blocks through it")
        out = <int32_t*>malloc(max(1, n) * sizeof(int32_t))
        if out == NULL:
            raise MemoryError
        try:
            with nogil:
                rc = self.take_pages(n, out)
            return None if rc == _OOM else [out[i] for i in range(n)]
        finally:
            free(out)

    def give_back(self, page_ids):
        """Return pages taken with take(). Raises MappingError (nothing changed) for an id that is
        not in use or repeated."""
        cdef int32_t[::1] ids
        cdef int i, n
        cdef int64_t bad = -1
        import numpy as np
        self._check_usable()
        arr = np.ascontiguousarray(np.asarray(page_ids, dtype=np.int64).reshape(-1))
        if np.unique(arr).size != arr.size:
            raise MappingError(f"page ids {arr.tolist()} contain duplicates")
        if arr.size == 0:
            return
        ids = arr.astype(np.int32)
        n = <int>ids.shape[0]
        with nogil:
            pthread_mutex_lock(&self.lock)
            for i in range(n):
                if not 0 <= ids[i] < self.num_table_pages or self.led.state[ids[i]] != _PS_USED:
                    bad = ids[i]
                    break
            pthread_mutex_unlock(&self.lock)
        if bad >= 0:
            raise MappingError(f"page id {bad} is not in use")
        with nogil:
            self.return_pages(<int>ids.shape[0], &ids[0])

    def set_limit_pages(self, int limit_pages):
        """Cap in-use + pool at `limit_pages` (-1: no cap). Pool pages over the cap are unmapped
        now; pages in use stay, and no page is mapped while over it."""
        self._check_usable()
        if limit_pages < -1:
            raise KVCachedConfigError(f"limit_pages={limit_pages} must be >= 0, or -1 for no limit")
        with nogil:
            pthread_mutex_lock(&self.lock)
            self.led.limit = limit_pages
            pthread_mutex_unlock(&self.lock)
            pthread_mutex_lock(&self.map_lock)
            try:
                self._pool_out(-1, self.num_table_pages)
            finally:
                pthread_mutex_unlock(&self.map_lock)
            pthread_mutex_lock(&self.lock)
            self.policy._wake_locked()
            pthread_mutex_unlock(&self.lock)

    def set_pool_bounds(self, int min_reserved, int max_reserved):
        """Change the pool bounds; a pool above the new maximum is unmapped down to it."""
        self._check_usable()
        if min_reserved < 0 or max_reserved < 0 or min_reserved > max_reserved:
            raise KVCachedConfigError(
                f"pool bounds min_reserved={min_reserved}, max_reserved={max_reserved} must satisfy "
                f"0 <= min_reserved <= max_reserved.")
        with nogil:
            pthread_mutex_lock(&self.map_lock)
            try:
                pthread_mutex_lock(&self.lock)
                self.led.max_reserved = max_reserved
                self.policy._set_floor_locked(min_reserved)
                pthread_mutex_unlock(&self.lock)
                self._pool_out(max_reserved, self.num_table_pages)
            finally:
                pthread_mutex_unlock(&self.map_lock)

    def set_idle_trim(self, double idle_trim_s):
        self._check_usable()
        if idle_trim_s < 0:
            raise KVCachedConfigError(f"idle_trim_s={idle_trim_s} must be >= 0 (0 disables idle trimming).")
        self.policy.idle_trim_s = idle_trim_s

    def set_budget_gate(self, acquire=None, release=None):
        """An external budget: `acquire(nbytes) -> bool` before mapping (False = out of memory),
        `release(nbytes)` after unmapping; both called without any allocator lock but map_lock,
        batched, never on the pool fast path. None, None removes it."""
        self._check_usable()
        if (acquire is None) != (release is None) or (acquire is not None and not (callable(acquire) and callable(release))):
            raise KVCachedConfigError("set_budget_gate needs two callables (acquire, release), or neither")
        with nogil:
            pthread_mutex_lock(&self.map_lock)
        self.policy.gate_acquire = acquire
        self.policy.gate_release = release
        self.policy.has_gate = acquire is not None
        pthread_mutex_unlock(&self.map_lock)

    def resize(self, int num_pages) -> bool:
        """Set the capacity to `num_pages` page ids. Growing adds free ids (never past the table's
        num_pages); shrinking drops — unmapping pool ones — the ids at or above it, and returns
        False, changing nothing, if any of them is in use. Pending ids above it leave when their
        fence is done. Raises KVCachedConfigError outside [0, table.num_pages]."""
        cdef int old
        cdef bint busy = False
        self._check_usable()
        if not 0 <= num_pages <= self.num_table_pages:
            raise KVCachedConfigError(
                f"num_pages={num_pages} is outside [0, {self.num_table_pages}]: the page table reserves "
                f"{self.num_table_pages} page ids; build a larger table to grow past it.")
        with nogil:
            pthread_mutex_lock(&self.map_lock)
            try:
                pthread_mutex_lock(&self.lock)
                old = self.led.capacity
                busy = not ledger_resize(&self.led, num_pages)
                if not busy:
                    self.policy._wake_locked()
                pthread_mutex_unlock(&self.lock)
                if not busy and num_pages < old:
                    self._pool_out(self.led.max_reserved, num_pages)
            finally:
                pthread_mutex_unlock(&self.map_lock)
        return not busy

    def trim(self):
        """Queue the whole pool behind a fence and unmap every pending page whose fence is done
        (on the host: all of them), and release the backend's cached handles. The background
        thread does not refill until the next take or return; it unmaps what is still pending."""
        self._check_usable()
        with nogil:
            pthread_mutex_lock(&self.map_lock)
            try:
                self._drain(False)
                self._unmap_pool()
                pthread_mutex_lock(&self.lock)
                self.policy.idle_trimmed = True
                pthread_mutex_unlock(&self.lock)
            finally:
                pthread_mutex_unlock(&self.map_lock)

    def drain(self, bint wait=False):
        """Unmap pending pages whose fence is done (wait=True: wait for every fence)."""
        self._check_usable()
        with nogil:
            pthread_mutex_lock(&self.map_lock)
            try:
                self._drain(wait)
            finally:
                pthread_mutex_unlock(&self.map_lock)

    def refresh_physical(self):
        """Ask the backend for its free physical memory now (a driver call on CUDA)."""
        self._check_usable()
        with nogil:
            pthread_mutex_lock(&self.map_lock)
            try:
                self._refresh_physical()
            finally:
                pthread_mutex_unlock(&self.map_lock)

    def start(self):
        """Start the background thread (daemon). No-op when it runs."""
        self._check_usable()
        self.policy._start(self)

    def stop(self):
        """Stop the background thread and wait for it (it exits within one driver batch). Does
        nothing in a forked child (the thread is not there)."""
        self.policy._stop(self)

    @property
    def capacity_pages(self) -> int:
        """Page ids [0, capacity_pages) may be handed out."""
        return self.led.capacity

    @property
    def max_reserved(self) -> int:
        """Returned pages beyond this many pooled ones are unmapped."""
        return self.led.max_reserved

    @property
    def limit_pages(self) -> int:
        """In-use + pool never exceed it; -1 no limit."""
        return self.led.limit

    @property
    def running(self) -> bool:
        return self.policy.thread is not None

    @property
    def min_reserved(self) -> int:
        """The background thread keeps the pool at least this big (pages)."""
        return self.policy.min_reserved

    @property
    def refill_target(self) -> int:
        """Pool size a refill round aims at, in [min_reserved, max_reserved]."""
        return self.policy.refill_target

    @property
    def idle_trim_s(self) -> float:
        """Trim the pool after this many seconds without take/return; 0 off."""
        return self.policy.idle_trim_s

    def close(self):
        """Stop the thread, wait for pending fences, unmap the pool and the pending pages, drop
        the budget gate; then every method but stats() and the checks raises KVCachedClosedError.
        Pages in use stay mapped (the BlockAllocator frees them first: BlockAllocator.close).
        Idempotent; does nothing in a forked child (Note [Fork and close]). Raises the first
        failure of the teardown after marking the allocator closed."""
        if not lifecycle_live(&self.life):
            return
        try:
            self.stop()
            self.trim()
            with nogil:
                pthread_mutex_lock(&self.map_lock)
                try:
                    self._drain(True)
                    self.backend.release_cached_above(0)
                finally:
                    pthread_mutex_unlock(&self.map_lock)
        finally:
            with nogil:
                pthread_mutex_lock(&self.map_lock)
                pthread_mutex_lock(&self.lock)
                lifecycle_close(&self.life)
                self.policy.has_gate = False
                pthread_mutex_unlock(&self.lock)
            self.policy.gate_acquire = None
            self.policy.gate_release = None
            pthread_mutex_unlock(&self.map_lock)

    def stats(self) -> dict:
        """A consistent snapshot of the counts and counters (taken under one lock)."""
        self._check_not_forked()
        return _stats(self)

    def page_states(self):
        """numpy uint8 copy of every page id's state (0 outside, 1 free, 2 pool, 3 used,
        4 pending, 5 transit), taken under the locks."""
        import numpy as np
        arr = np.empty(self.num_table_pages, dtype=np.uint8)
        cdef uint8_t[::1] view = arr
        self._check_not_forked()
        with nogil:
            pthread_mutex_lock(&self.map_lock)
            pthread_mutex_lock(&self.lock)
            memcpy(&view[0], self.led.state, self.num_table_pages)
            pthread_mutex_unlock(&self.lock)
            pthread_mutex_unlock(&self.map_lock)
        return arr

    def check_invariants(self):
        """O(pages log pages): the page ledger's check — each set's own, then the states across
        them and the table's mapped bits (kvcached.core.pagesets) — and no id in transit while
        map_lock is held. Raises AssertionError naming the first broken invariant."""
        cdef char msg[256]
        cdef int rc, transit
        self._check_not_forked()
        with nogil:
            pthread_mutex_lock(&self.map_lock)
            pthread_mutex_lock(&self.lock)
            rc = ledger_check(&self.led, self.table.mapped, self.table.num_mapped, msg, sizeof(msg))
            transit = self.led.num_transit
            pthread_mutex_unlock(&self.lock)
            pthread_mutex_unlock(&self.map_lock)
        if rc != 0:
            raise AssertionError((<bytes>msg).decode())
        assert transit == 0, f"{transit} page ids in transit while map_lock is held"
        return True


cdef dict _stats(PageAllocator pa):
    # PageAllocator.stats(): every count and counter, read under one hold of `lock`
    cdef int v[10]
    cdef uint64_t c[15]
    cdef size_t phys
    with nogil:
        pthread_mutex_lock(&pa.lock)
        v[0] = pa.led.capacity; v[1] = pa.led.free_set.num; v[2] = pa.led.num_used; v[3] = pa.led.pool.num
        v[4] = pending_num(&pa.led.pending); v[5] = pa.led.num_transit; v[6] = pa.led.limit; v[7] = pa.table.num_mapped
        c[0] = pa.num_maps; c[1] = pa.num_unmaps; c[2] = pa.num_pool_hits; c[3] = pa.num_slow_path
        c[4] = pa.num_oom; c[5] = pa.num_fences; c[6] = pa.policy.num_idle_trims; c[7] = pa.num_refills
        c[8] = pa.activity; c[9] = <uint64_t>pa.led.pool.weight_sum
        c[10] = pa.policy.num_pool_waits; c[11] = pa.pages_taken; v[8] = pa.policy.refill_target
        v[9] = pa.led.pending.num_retry; c[12] = pa.num_unmap_failures
        c[13] = pa.num_refill_failures; c[14] = pa.policy.num_bg_rounds
        phys = pa.phys_snapshot
        pthread_mutex_unlock(&pa.lock)
    return {
        "capacity_pages": v[0], "free": v[1], "in_use": v[2], "reserved": v[3],
        "pending_unmap": v[4], "transit": v[5], "limit_pages": v[6], "mapped": v[7],
        "reserved_weight": c[9], "free_physical_bytes": phys, "page_bytes": pa.page_bytes,
        "min_reserved": pa.policy.min_reserved, "max_reserved": pa.led.max_reserved,
        "num_maps": c[0], "num_unmaps": c[1], "num_pool_hits": c[2], "num_slow_path": c[3],
        "num_oom": c[4], "num_fences": c[5], "num_idle_trims": c[6], "num_refills": c[7],
        "num_take_return": c[8], "num_pool_waits": c[10], "pages_taken": c[11],
        "refill_target": v[8], "unmap_retries": v[9], "num_unmap_failures": c[12],
        "num_refill_failures": c[13], "num_bg_rounds": c[14],
    }


# Note [Page allocator states]
# Every page id is in exactly one state: outside (at/above capacity, or weight 0), free, pool,
# used, pending, transit. Transit exists only while the holder of map_lock maps or unmaps the id,
# with `lock` released so that the pool fast path, stats and returns go on during the driver call.
# A take checks capacity (free ids, the limit) before anything changes and moves ids to transit;
# if mapping reports out of memory (or the budget gate refuses), exactly those ids go back where
# they were — pool ids onto the pool in their old order, free ids into the free set — so the
# caller sees the allocator as before. resize and limits hold map_lock too, so no transit id can
# be dropped under a mapper; the refill still re-checks the limit after mapping, because
# set_limit_pages changes it under `lock` alone, before it waits for map_lock to trim the pool.
#
# Note [Mapping in transit]
# A slow take and a refill chunk map free ids the same way, in _map_free_ids: pop the k lowest
# free ids into transit under `lock`, release it, ask the budget gate, map (map_lock held, so no
# one else maps or unmaps), take `lock` again and settle, then release the gate's bytes of what
# went back unmapped. Only what a success means differs: a take's ids become used (with the pool
# ids it took first), a refill's go into the pool as far as max_reserved and the limit still
# allow. A failure (the gate refused, out of memory, an error) undoes both the same way. Ids
# that leave transit after an unmap or a failed map are settled by one loop, ledger_settle_unmapped.
#
# Note [Failed unmap]
# An unmap the driver refuses (host: ENOMEM at vm.max_map_count, where every mmap fails, even one
# that would lower the count) must not lose the page id: before, _unmap_ids raised before the id
# went back, so it stayed in transit for good, and its limit headroom and budget bytes with it.
# Now the page table reports such ids instead of raising (PageTable.unmap_pages returns how many,
# marking each mapped = 2: only unmapping may follow), and the allocator keeps them mapped and
# counted — state pending, on the ring's retry list rather than behind a fence, holding their budget bytes —
# until the next drain (background thread every 10 ms, slow takes, drain(), trim()) unmaps them.
# The budget gate gets back exactly the pages that were unmapped. A free whose pages cannot be
# unmapped therefore succeeds (the blocks are free); the failure shows in stats()
# (unmap_retries, num_unmap_failures) and in the table's last_unmap_error. The same path takes
# the page ids that the undo of a failed map could not unmap (Note [Page table]): they are never
# put back in the free set while anything of them is still mapped.
#
# Note [Deferred unmap]
# On CUDA, freeing a block only means the engine will not *queue* more work on it; kernels queued
# before may still read it. So pages beyond the pool are not unmapped at once: return_pages records
# one fence (an event on `stream`) per call and queues the pages behind it; they are unmapped when
# it is done — checked by later returns and slow takes (cuEventQuery, ~1 us, only on the slow path)
# and by the background thread every 10 ms while any are pending. Never a device synchronize. On the
# host the fence is done at once and the same path unmaps immediately. Pages reused from the pool
# need no fence: the engine orders a block's reuse after its last use, as with any cache. Pages
# that leave the pool to be unmapped (limit, trim, pool bounds, resize, the idle trim, a failed
# take's overflow) do: a kernel queued before the free may still be reading them. _pool_out
# records one fence as they leave, which covers the work queued before every free of them, and
# queues them in the same ring; the pool's fast path records nothing. Before, the pool was
# unmapped at once, and on CUDA a side-stream kernel reading a freed block faulted after
# free -> set_memory_limit(0). A tensor-parallel follower waits for its own device's fence before
# it unmaps (Backend.wait_for_stream): rank 0's fence covers only rank 0's device.
