# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, auto_pickle=False
"""kvcached.core.pagealloc: whole pages for the block allocator above it.

PageAllocator hands out free page ids, keeps the reserved pool, defers unmaps behind fences and
applies limits. Its three sets of page ids — the free set, the pool, the pending ring with the
unmap retries — are kvcached.core.pagesets' structs, each with its own check; the allocator keeps
each id's state across them, the ids in transit, the limits and the locks. RefillPolicy decides when the pool is refilled or trimmed (its background thread,
the refill target, idle trim and the budget gate: Note [Refill policy]).

It stands on kvcached.core.pagesets (inline struct operations, compiled in here) and
kvcached.core.pagetable (PageTable: what one page id maps, all-or-nothing) over
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
    CLOCK_MONOTONIC, _now, clock_gettime, pthread_cond_broadcast, pthread_cond_destroy,
    pthread_cond_init, pthread_cond_signal, pthread_cond_timedwait, pthread_cond_wait, pthread_condattr_destroy,
    pthread_condattr_init, pthread_condattr_setclock, pthread_condattr_t, pthread_mutex_destroy, pthread_mutex_init,
    pthread_mutex_lock, pthread_mutex_trylock, pthread_mutex_unlock, timespec, usleep,
)
from kvcached.core.pagesets cimport (
    freeset_check, freeset_count_for_weight, freeset_init, freeset_members, freeset_pop_lowest, freeset_release,
    freeset_update, freeset_weight_of_lowest, pending_check, pending_copy, pending_init, pending_num,
    pending_oldest_fence, pending_pop, pending_push, pending_release, pending_retry, pending_take_retries, pool_check,
    pool_drop, pool_init, pool_pop, pool_push, pool_release,
)
from kvcached.core.vmm cimport (
    _OOM, lifecycle_check, lifecycle_check_owned, lifecycle_close, lifecycle_init, lifecycle_live, lifecycle_name,
    lifecycle_owned,
)

import threading as _threading

from kvcached.checks import as_int
from kvcached.errors import KVCachedConfigError, MappingError


# PageAllocator: free page ids, the reserved pool, deferred unmap, resize, limits; the mechanisms
# its RefillPolicy (below) drives. See Note [Page allocator states], Note [Mapping in transit],
# Note [Deferred unmap], Note [Failed unmap], Note [Refill policy].

cdef int64_t _MAX_NEW_PAGES = (<int64_t>1) << 62


cdef int64_t _max_new_pages(object value) except -2:
    """The max_new_pages argument of the available_* queries: -1 (no cap) or a page count."""
    if type(value) is int and -1 <= value <= _MAX_NEW_PAGES:
        return value
    return as_int(value, "max_new_pages", minimum=-1, maximum=_MAX_NEW_PAGES,
                  hint="pass the pages that may still be mapped (e.g. budget free bytes // page bytes), or -1 for no cap")


cdef class PageAllocator:
    """Hands out mapped page ids of one PageTable, keeping a pool of mapped, unused ones.

    Page ids live in exactly one state (Note [Page allocator states]): free (unmapped, below
    capacity), pool (mapped, unused), used (handed out), pending (returned, unmapped once the GPU
    work queued before the return has finished), or outside (above capacity). The free set is a
    Fenwick tree rather than a plain stack so that the lowest ids go first (a shrink finds the top
    ids free more often) and so that "the weight of the next k pages" — the blocks they hold,
    needed by available_blocks() — is an O(log pages) query. When the pool is refilled or
    trimmed is its RefillPolicy's decision; this class holds the mechanisms (Note [Refill policy]).

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
        self.limit_pages = -1
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
        cdef int p
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
        self.capacity_pages = capacity
        self.max_reserved = max_reserved
        self.policy.min_reserved = min_reserved
        self.policy.refill_target = min_reserved
        self.policy.idle_trim_s = idle_trim_s
        self.page_bytes = page_table.num_segments * page_table.map_bytes
        self.state = <uint8_t*>calloc(P, sizeof(uint8_t))
        self.weight = <int32_t*>malloc(max(1, P) * sizeof(int32_t))
        self.scratch = <int32_t*>malloc(max(1, P) * sizeof(int32_t))
        if (self.state == NULL or self.weight == NULL or self.scratch == NULL
                or freeset_init(&self.free_set, P, self.weight) != 0 or pool_init(&self.pool, P, self.weight) != 0
                or pending_init(&self.pending, P) != 0):
            raise MemoryError("no memory for the page allocator")
        for p in range(P):
            self.weight[p] = 1
        for p in range(capacity):
            self.state[p] = _PS_FREE
            freeset_update(&self.free_set, p, 1)
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
        if own and self.pending.fence != NULL and self.backend is not None:
            for i in range(self.pending.num_batches):
                try:
                    self.backend._release_fence(self.pending.fence[(self.pending.batch_head + i) % self.pending.size])
                except Exception:
                    pass
        freeset_release(&self.free_set)
        pool_release(&self.pool)
        pending_release(&self.pending)
        free(self.state)
        free(self.weight)
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

    # -- moving ids between the sets (under lock) --------------------------------------------
    cdef void _release_page(self, int32_t page_id) noexcept nogil:
        # an unmapped id goes back to the free set, or outside when above capacity (under lock)
        if page_id < self.capacity_pages and self.weight[page_id] > 0:
            self.state[page_id] = _PS_FREE
            freeset_update(&self.free_set, page_id, 1)
        else:
            self.state[page_id] = _PS_OUTSIDE

    cdef void _push_pool(self, int n, const int32_t* ids) noexcept nogil:
        # ids[0..n) onto the pool's top, in that order (under lock; the caller moves the counts
        # of the state they leave)
        cdef int i
        for i in range(n):
            self.state[ids[i]] = _PS_POOL
            pool_push(&self.pool, ids[i])

    cdef void _unpop_pool(self, int n, const int32_t* ids) noexcept nogil:
        # undo taking ids[0..n) off the pool's top, in that order (under lock)
        cdef int i
        for i in range(n - 1, -1, -1):
            self._push_pool(1, ids + i)

    cdef void _to_transit(self, int n, const int32_t* ids) noexcept nogil:
        # ids the caller took out of their set go into transit (under lock)
        cdef int i
        for i in range(n):
            self.state[ids[i]] = _PS_TRANSIT
        self.num_transit += n

    cdef int _settle_unmapped(self, int n, const int32_t* ids) noexcept nogil:
        """Ids in transit after an unmap or a failed map (hold lock): each goes back to the free
        set, or — when the driver left any of it mapped (the table still marks it) — pending, on
        the unmap retries, still counted. Returns how many went back unmapped; the caller takes
        them off num_transit. See Note [Failed unmap]."""
        cdef int i, unmapped = 0
        for i in range(n):
            if self.table.mapped[ids[i]]:
                self.state[ids[i]] = _PS_PENDING
                pending_retry(&self.pending, ids[i])
            else:
                self._release_page(ids[i])
                unmapped += 1
        return unmapped

    cdef void _queue_pending_locked(self, int n, const int32_t* ids, uintptr_t fence) noexcept nogil:
        # n > 0 mapped ids wait behind one fence (the ring owns it), unmapped by _drain (hold lock)
        cdef int i
        for i in range(n):
            self.state[ids[i]] = _PS_PENDING
        pending_push(&self.pending, n, ids, fence)
        self.num_fences += 1

    # -- taking pages -------------------------------------------------------------------------
    cdef int _take_pool_locked(self, int64_t need, bint by_weight, int32_t* out, int* n_out) noexcept nogil:
        cdef int k = 0
        cdef int64_t got = 0
        cdef int32_t p
        if (self.pool.weight_sum if by_weight else self.pool.num) < need:
            return _NEED_SLOW
        while got < need:
            p = pool_pop(&self.pool)
            self.state[p] = _PS_USED
            out[k] = p
            k += 1
            got += self.weight[p] if by_weight else 1
        self.num_used += k
        n_out[0] = k
        self.num_pool_hits += 1
        self.pages_taken += k
        self.activity += 1
        self.policy.idle_trimmed = False
        if self.policy.bg_running and self.pool.num < self.policy.refill_target:
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
        cdef int np, k, i, pooled
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
            rest = need - (self.pool.weight_sum if by_weight else self.pool.num)
            if by_weight:
                k = freeset_count_for_weight(&self.free_set, rest)
            else:
                k = <int>rest if rest <= self.free_set.num else -1
            if k >= 0 and self.limit_pages >= 0 and \
                    self.num_used + self.pool.num + self.num_transit + k > self.limit_pages:
                k = -1
            if k < 0:
                self.num_oom += 1
                pthread_mutex_unlock(&self.lock)
                return _OOM
            np = self.pool.num
            for i in range(np):
                out[i] = pool_pop(&self.pool)
                self.state[out[i]] = _PS_USED
            self.num_used += np
            self.activity += 1
            self.policy.idle_trimmed = False
            if self._map_free_ids(out, np, k, False, &pooled) != 0:
                if np:      # returns may have filled the pool while we mapped: back within max_reserved
                    self._pool_out(self.max_reserved, self.num_table_pages)
                self._refresh_physical()
                return _OOM
            n_out[0] = np + k
            return 0
        finally:
            pthread_mutex_unlock(&self.map_lock)

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
            ids[i] = freeset_pop_lowest(&self.free_set)
            if into_pool:
                self.refill_transit_weight += self.weight[ids[i]]
        self._to_transit(k, ids)
        if into_pool:
            self.refill_transit += k
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
                self.refill_transit -= k
                for i in range(k):
                    self.refill_transit_weight -= self.weight[ids[i]]
            if finished and rc == 0 and into_pool:
                # a limit set, or returns that filled the pool, while we mapped win: keep only
                # what still fits (the pool never exceeds max_reserved)
                fits = max(0, min(k, self.max_reserved - self.pool.num))
                if self.limit_pages >= 0:
                    fits = max(0, min(fits, self.limit_pages - self.num_used - self.pool.num - (self.num_transit - k)))
                self._push_pool(fits, ids)
                self.num_transit -= fits
                self.num_maps += k
                self.num_refills += 1
                pooled[0] = fits
                if fits:
                    pthread_cond_broadcast(&self.policy.pool_cv)
            elif finished and rc == 0:
                for i in range(k):
                    self.state[ids[i]] = _PS_USED
                self.num_used += k
                self.num_transit -= k
                self.num_maps += k
                self.pages_taken += np + k
                if self.policy.bg_running and self.pool.num < self.policy.refill_target:
                    pthread_cond_signal(&self.policy.wake)     # the slow path emptied the pool: refill now
            else:
                unmapped = self._settle_unmapped(k, ids)
                self.num_transit -= k
                if into_pool:
                    self.num_refill_failures += 1
                else:
                    self.num_used -= np
                    self._unpop_pool(np, out)
                    self.num_oom += 1
            pthread_mutex_unlock(&self.lock)
            if gated and unmapped:
                self.policy._gate_release(unmapped, self.page_bytes)
        return rc

    # -- returning pages ----------------------------------------------------------------------
    cdef int return_pages_fast(self, int n, const int32_t* ids) noexcept nogil:
        """Put n used pages into the pool if all fit (pool <= max_reserved, limit respected).
        Returns 0, or _NEED_SLOW with nothing changed. No driver call, no Python. Takes lock."""
        pthread_mutex_lock(&self.lock)
        if self.pool.num + n > self.max_reserved or (
                self.limit_pages >= 0 and self.num_used + self.pool.num + self.num_transit > self.limit_pages):
            pthread_mutex_unlock(&self.lock)
            return _NEED_SLOW
        self._push_pool(n, ids)
        self.num_used -= n
        self.activity += 1
        self.policy.idle_trimmed = False
        pthread_mutex_unlock(&self.lock)
        return 0

    cdef int return_pages(self, int n, const int32_t* ids) except -1 nogil:
        """Pages that became empty (each used; the caller checked): into the pool up to
        max_reserved (and the limit), the rest pending behind one fence recorded on `stream`,
        unmapped once it is done (Note [Deferred unmap]). Call without the GIL. Takes lock, and
        map_lock only if free (a busy one means someone else will drain)."""
        cdef int k = -1, room
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
                self._push_pool(n, ids)
                self.num_used -= n
                pthread_mutex_unlock(&self.lock)
        pthread_mutex_lock(&self.lock)
        room = self.max_reserved - self.pool.num
        if self.limit_pages >= 0:
            room = min(room, self.limit_pages - (self.num_used - n) - self.pool.num - self.num_transit)
        k = max(0, min(n, room))
        self._push_pool(k, ids)
        if n > k:
            self._queue_pending_locked(n - k, ids + k, fence)
        self.num_used -= n
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

    cdef int _discard_used(self, int n, int32_t* ids) except -1 nogil:
        """Unmap pages in use that their taker cannot hand out (its BlockAllocator was closed
        while it mapped them). Takes map_lock and lock."""
        if n <= 0:
            return 0
        pthread_mutex_lock(&self.map_lock)
        try:
            pthread_mutex_lock(&self.lock)
            self._to_transit(n, ids)
            self.num_used -= n
            pthread_mutex_unlock(&self.lock)
            self._unmap_ids(n, ids)
        finally:
            pthread_mutex_unlock(&self.map_lock)
        return 0

    # -- unmapping (the holder of map_lock) ---------------------------------------------------
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
            unmapped = self._settle_unmapped(n, ids)
            self.num_transit -= n
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
            if self.pending.num_batches == 0:
                c = pending_take_retries(&self.pending, self.scratch)
                self._to_transit(c, self.scratch)
                pthread_mutex_unlock(&self.lock)
                return self._unmap_ids(c, self.scratch)
            fence = pending_oldest_fence(&self.pending)
            pthread_mutex_unlock(&self.lock)
            if self.backend._fence_done(fence) != 1:
                if not wait_all:
                    return 0
                usleep(50)
                continue
            pthread_mutex_lock(&self.lock)
            c = pending_pop(&self.pending, self.scratch)
            self._to_transit(c, self.scratch)
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
            keep = self.pool.num if self.limit_pages < 0 else max(0, self.limit_pages - self.num_used - self.num_transit)
        n = pool_drop(&self.pool, below, keep, self.scratch)
        self._to_transit(n, self.scratch)
        pthread_mutex_unlock(&self.lock)
        if n == 0:
            return 0
        try:
            self.backend._record_fence(self.stream, &fence)
            k = 0
        finally:
            pthread_mutex_lock(&self.lock)
            self.num_transit -= n
            if k == 0:
                self._queue_pending_locked(n, self.scratch, fence)
            else:
                self._push_pool(n, self.scratch)     # no fence: nothing may be unmapped
            pthread_mutex_unlock(&self.lock)
        return self._drain(False)

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
                k = min(self.policy.refill_target - self.pool.num, self.free_set.num, chunk)
                if self.limit_pages >= 0:
                    k = min(k, self.limit_pages - self.num_used - self.pool.num - self.num_transit)
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

    # -- the weights (BlockAllocator) ---------------------------------------------------------
    cdef int _bind_weights(self, const int32_t* weights) except -1:
        """Set each page's weight (the blocks it holds); pages of weight 0 are never handed out.
        Only before any page was taken or pooled. Raises KVCachedConfigError otherwise."""
        cdef int p
        cdef bint busy
        with nogil:
            pthread_mutex_lock(&self.map_lock)
            pthread_mutex_lock(&self.lock)
            busy = (self.weights_bound or self.num_used or self.pool.num or pending_num(&self.pending)
                    or self.num_transit)
            if not busy:
                for p in range(self.num_table_pages):
                    if self.state[p] == _PS_FREE:
                        freeset_update(&self.free_set, p, -1)
                    self.weight[p] = weights[p]
                    self.state[p] = _PS_OUTSIDE
                    if p < self.capacity_pages:
                        self._release_page(p)
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
        k = self.free_set.num
        if self.limit_pages >= 0:
            k = min(k, <int64_t>self.limit_pages - self.num_used - self.pool.num - self.num_transit)
        k = min(k, free_phys // <int64_t>self.page_bytes - self.refill_transit)
        if max_new_pages >= 0:
            k = min(k, max_new_pages)
        k = max(0, k)
        # pages the refill is mapping reach the pool, and a caller short of pages waits for them
        if by_weight:
            k = self.pool.weight_sum + self.refill_transit_weight + freeset_weight_of_lowest(&self.free_set, <int>k)
        else:
            k += self.pool.num + self.refill_transit
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
                if not 0 <= ids[i] < self.num_table_pages or self.state[ids[i]] != _PS_USED:
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
            self.limit_pages = limit_pages
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
                self.max_reserved = max_reserved
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
        cdef int p, old
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
                old = self.capacity_pages
                if num_pages < old:
                    for p in range(num_pages, old):
                        if self.state[p] == _PS_USED:
                            busy = True
                            break
                if not busy:
                    if num_pages < old:
                        for p in range(num_pages, old):
                            if self.state[p] == _PS_FREE:
                                freeset_update(&self.free_set, p, -1)
                                self.state[p] = _PS_OUTSIDE
                    self.capacity_pages = num_pages
                    for p in range(old, num_pages):
                        if self.state[p] == _PS_OUTSIDE:
                            self._release_page(p)
                    self.policy._wake_locked()
                pthread_mutex_unlock(&self.lock)
                if not busy and num_pages < old:
                    self._pool_out(self.max_reserved, num_pages)
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
                self._pool_out(0, self.num_table_pages)
                self.backend.release_cached_above(0)
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
        cdef int v[10]
        cdef uint64_t c[15]
        cdef size_t phys
        self._check_not_forked()
        with nogil:
            pthread_mutex_lock(&self.lock)
            v[0] = self.capacity_pages; v[1] = self.free_set.num; v[2] = self.num_used; v[3] = self.pool.num
            v[4] = pending_num(&self.pending); v[5] = self.num_transit; v[6] = self.limit_pages; v[7] = self.table.num_mapped
            c[0] = self.num_maps; c[1] = self.num_unmaps; c[2] = self.num_pool_hits; c[3] = self.num_slow_path
            c[4] = self.num_oom; c[5] = self.num_fences; c[6] = self.policy.num_idle_trims; c[7] = self.num_refills
            c[8] = self.activity; c[9] = <uint64_t>self.pool.weight_sum
            c[10] = self.policy.num_pool_waits; c[11] = self.pages_taken; v[8] = self.policy.refill_target
            v[9] = self.pending.num_retry; c[12] = self.num_unmap_failures
            c[13] = self.num_refill_failures; c[14] = self.policy.num_bg_rounds
            phys = self.phys_snapshot
            pthread_mutex_unlock(&self.lock)
        return {
            "capacity_pages": v[0], "free": v[1], "in_use": v[2], "reserved": v[3],
            "pending_unmap": v[4], "transit": v[5], "limit_pages": v[6], "mapped": v[7],
            "reserved_weight": c[9], "free_physical_bytes": phys, "page_bytes": self.page_bytes,
            "min_reserved": self.policy.min_reserved, "max_reserved": self.max_reserved,
            "num_maps": c[0], "num_unmaps": c[1], "num_pool_hits": c[2], "num_slow_path": c[3],
            "num_oom": c[4], "num_fences": c[5], "num_idle_trims": c[6], "num_refills": c[7],
            "num_take_return": c[8], "num_pool_waits": c[10], "pages_taken": c[11],
            "refill_target": v[8], "unmap_retries": v[9], "num_unmap_failures": c[12],
            "num_refill_failures": c[13], "num_bg_rounds": c[14],
        }

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
            memcpy(&view[0], self.state, self.num_table_pages)
            pthread_mutex_unlock(&self.lock)
            pthread_mutex_unlock(&self.map_lock)
        return arr

    def check_invariants(self):
        """O(pages log pages): each set's own check (the free set's tree, the pool stack, the
        pending ring: kvcached.core.pagesets), then what ties them together: every id in exactly
        one state, each set holding exactly the ids of its state, the counts agreeing, and the
        mapped ids exactly pool + used + pending (the table's bits). Raises AssertionError naming
        the first broken one."""
        import numpy as np
        cdef int P = self.num_table_pages, n = max(1, P)
        state, mapped, free_ids = (np.zeros(n, dtype=np.uint8) for _ in range(3))
        weight, pool, pend = (np.zeros(n, dtype=np.int32) for _ in range(3))
        cdef uint8_t[::1] vs = state, vm = mapped, vf = free_ids
        cdef int32_t[::1] vw = weight, vp = pool, vq = pend
        cdef int v[8]
        cdef char msg[256]
        cdef int rc
        self._check_not_forked()
        with nogil:
            pthread_mutex_lock(&self.map_lock)
            pthread_mutex_lock(&self.lock)
            rc = freeset_check(&self.free_set, msg, sizeof(msg))
            if rc == 0:
                rc = pool_check(&self.pool, P, msg, sizeof(msg))
            if rc == 0:
                rc = pending_check(&self.pending, msg, sizeof(msg))
            memcpy(&vs[0], self.state, P)
            memcpy(&vm[0], self.table.mapped, P)
            memcpy(&vw[0], self.weight, P * sizeof(int32_t))
            memcpy(&vp[0], self.pool.ids, self.pool.num * sizeof(int32_t))
            pending_copy(&self.pending, &vq[0])
            freeset_members(&self.free_set, &vf[0])
            v[0] = self.free_set.num; v[1] = self.pool.num; v[2] = self.num_used; v[3] = pending_num(&self.pending)
            v[4] = self.num_transit; v[5] = self.capacity_pages; v[6] = self.table.num_mapped
            pthread_mutex_unlock(&self.lock)
            pthread_mutex_unlock(&self.map_lock)
        if rc != 0:
            raise AssertionError((<bytes>msg).decode())
        state, mapped, weight, free_ids = state[:P], mapped[:P], weight[:P], free_ids[:P]
        counts = np.bincount(state, minlength=6)
        assert counts[_PS_FREE] == v[0], f"free ids {counts[_PS_FREE]} != num_free {v[0]}"
        assert counts[_PS_POOL] == v[1], f"pool ids {counts[_PS_POOL]} != num_pool {v[1]}"
        assert counts[_PS_USED] == v[2], f"used ids {counts[_PS_USED]} != num_used {v[2]}"
        assert counts[_PS_PENDING] == v[3], f"pending ids {counts[_PS_PENDING]} != num_pending {v[3]}"
        assert counts[_PS_TRANSIT] == 0 == v[4], f"ids in transit with map_lock held: {counts[_PS_TRANSIT]}, {v[4]}"
        assert (state[pool[:v[1]]] == _PS_POOL).all(), "pool stack disagrees with states"
        assert (state[pend[:v[3]]] == _PS_PENDING).all(), "pending ring disagrees with states"
        is_free = state == _PS_FREE
        assert (free_ids.astype(bool) == is_free).all(), "free set disagrees with the states"
        is_mapped = np.isin(state, (_PS_POOL, _PS_USED, _PS_PENDING))
        assert (mapped[state != _PS_PENDING] != 2).all(), "a page id partly unmapped after a failure is not pending"
        assert (is_mapped == (mapped != 0)).all(), \
            f"mapped ids {np.flatnonzero(mapped).tolist()} != pool+used+pending {np.flatnonzero(is_mapped).tolist()}"
        assert int(is_mapped.sum()) == v[6], "table num_mapped disagrees"
        assert (np.flatnonzero(is_free) < v[5]).all(), "a free id lies at or above capacity"
        assert (weight[is_free] > 0).all(), "a free id holds no block"
        outside_low = np.flatnonzero((state == _PS_OUTSIDE)[:v[5]])
        assert (weight[outside_low] == 0).all(), f"ids {outside_low.tolist()} below capacity are lost"
        assert (state[v[5]:] != _PS_USED).all() and (state[v[5]:] != _PS_FREE).all(), "in use/free above capacity"
        return True


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
# that leave transit after an unmap or a failed map are settled by one loop, _settle_unmapped.
#
# Note [Failed unmap]
# An unmap the driver refuses (host: ENOMEM at vm.max_map_count, where every mmap fails, even one
# that would lower the count) must not lose the page id: before, _unmap_ids raised before the id
# went back, so it stayed in transit for good, and its limit headroom and budget bytes with it.
# Now the page table reports such ids instead of raising (PageTable.unmap_pages returns how many,
# marking each mapped = 2: only unmapping may follow), and the allocator keeps them mapped and
# counted — state pending, in retry_ids rather than the fence ring, holding their budget bytes —
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
# unmapped at once, and on the H200 a side-stream kernel reading a freed block faulted after
# free -> set_memory_limit(0). A tensor-parallel follower waits for its own device's fence before
# it unmaps (Backend.wait_for_stream): rank 0's fence covers only rank 0's device.

# RefillPolicy: when the reserved pool is refilled and trimmed — the background thread, its
# wake-up, the refill target, idle trim, the budget gate. The mechanisms it drives (map a chunk
# into the pool, drain deferred unmaps, pool out) are PageAllocator's. See Note [Refill policy],
# Note [Background thread], Note [Proactive refill].


cdef class RefillPolicy:
    """The refill policy of one PageAllocator: its background thread and the rules it follows.

    Owned by the allocator (one each, made with it, never shared) and never held by anything
    else but the thread it runs, so that the policy can be a plain C struct behind one pointer
    on the pool fast path. It keeps no reference to the allocator: every method takes it as an
    argument (Note [Refill policy]). Its fields are guarded by the allocator's ``lock`` (it has
    none of its own); the same lock rule holds: methods say which of the allocator's locks they
    take, and the budget gate is called holding map_lock only.
    """

    def __cinit__(self, *args, **kwargs):
        cdef pthread_condattr_t attr
        pthread_condattr_init(&attr)
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC)
        pthread_cond_init(&self.wake, &attr)
        pthread_cond_init(&self.pool_cv, &attr)
        pthread_condattr_destroy(&attr)
        lifecycle_init(&self.life)
        self.thread = None
        self.gate_acquire = None
        self.gate_release = None

    def __dealloc__(self):
        if lifecycle_owned(&self.life):      # a forked child touches nothing: Note [Fork and close]
            pthread_cond_destroy(&self.wake)
            pthread_cond_destroy(&self.pool_cv)

    # -- called by the allocator under its lock -------------------------------------------------
    cdef void _wake_locked(self) noexcept nogil:
        """Wake the background thread, if it runs (hold the allocator's lock)."""
        if self.bg_running:
            pthread_cond_signal(&self.wake)

    cdef void _set_floor_locked(self, int min_reserved) noexcept nogil:
        """New pool minimum; the target starts again from it (hold the allocator's lock)."""
        self.min_reserved = min_reserved
        self.refill_target = min_reserved
        self._wake_locked()

    cdef bint _refill_covers(self, PageAllocator pa, int64_t need, bint by_weight) noexcept nogil:
        # would the pool, once the running refill round reaches its target, hold `need`? (under
        # lock; pages in transit are not counted, so it errs towards "no")
        cdef int k = min(self.refill_target - pa.pool.num, pa.free_set.num)
        if k <= 0:
            return False
        if by_weight:
            return pa.pool.weight_sum + freeset_weight_of_lowest(&pa.free_set, k) >= need
        return pa.pool.num + k >= need

    cdef int _wait_for_refill(self, PageAllocator pa, int64_t need, bint by_weight, int32_t* out, int* n_out) noexcept nogil:
        """The pool is short: while the background thread is refilling it and its round will
        cover `need`, wait for its pages instead of mapping (Note [Proactive refill]). Returns 0
        with the pages taken from the pool, or _NEED_SLOW (nothing taken: map them yourself).
        Call without the GIL and without map_lock. Takes pa.lock."""
        cdef int rc = _NEED_SLOW
        cdef bint waited = False
        pthread_mutex_lock(&pa.lock)
        while self.bg_refilling and not self.bg_stopping:
            if pa._take_pool_locked(need, by_weight, out, n_out) == 0:
                rc = 0
                break
            if not self._refill_covers(pa, need, by_weight):
                break
            waited = True
            pthread_cond_wait(&self.pool_cv, &pa.lock)
        if waited:
            self.num_pool_waits += 1
        pthread_mutex_unlock(&pa.lock)
        return rc

    # -- the budget gate (called holding map_lock only) ----------------------------------------
    cdef int _gate_acquire(self, int n, size_t page_bytes) except -1 nogil:
        if n <= 0 or not self.has_gate:
            return 1
        with gil:
            return 1 if self.gate_acquire(<size_t>n * page_bytes) else 0

    cdef int _gate_release(self, int n, size_t page_bytes) except -1 nogil:
        if n <= 0 or not self.has_gate:
            return 0
        with gil:
            self.gate_release(<size_t>n * page_bytes)
        return 0

    # -- the background thread's work ----------------------------------------------------------
    cdef int _refill(self, PageAllocator pa) except -1 nogil:
        """One refill round: map free ids into the pool, one page per map_lock hold, up to
        refill_target; then set the next round's target from the demand seen during this one.
        Callers short of pages wait for it (bg_refilling). See Note [Proactive refill]."""
        cdef uint64_t taken0, short0
        cdef int got, chunk
        cdef bint failed = False
        pthread_mutex_lock(&pa.lock)
        if self.bg_stopping or self.idle_trimmed:
            pthread_mutex_unlock(&pa.lock)
            return 0
        taken0 = pa.pages_taken
        short0 = pa.num_slow_path + self.num_pool_waits
        self.bg_refilling = True
        pthread_mutex_unlock(&pa.lock)
        # a mirrored table pays a message per map call: the whole round in one (Note [Proactive refill])
        chunk = 1 if pa.table.mirror is None else pa.num_table_pages
        try:
            got = 1
            while got > 0:
                got = pa._map_into_pool(chunk, &failed)
        finally:
            pthread_mutex_lock(&pa.lock)
            self.bg_refilling = False
            if failed:
                self.bg_backoff = True      # out of memory or the gate refused: a full period first
            if pa.num_slow_path + self.num_pool_waits > short0:
                # the pool ran short while we refilled: keep what was taken meanwhile in stock too
                self.refill_target = <int>min(<uint64_t>pa.max_reserved,
                                              max(<uint64_t>self.refill_target,
                                                  <uint64_t>self.min_reserved + pa.pages_taken - taken0))
            elif pa.pages_taken == taken0:
                self.refill_target = self.min_reserved       # demand stopped: back to the minimum
            pthread_cond_broadcast(&self.pool_cv)
            pthread_mutex_unlock(&pa.lock)
        return 0

    cdef int _bg_step(self, PageAllocator pa) except -1 nogil:
        """One round of the background thread: sleep until woken or a period passes, then drain,
        apply the idle policy or refill, refresh the physical figure. Returns 1 to exit."""
        cdef double now, period
        cdef timespec deadline
        cdef bint want, idle
        cdef uint64_t act
        pthread_mutex_lock(&pa.lock)
        if not self.bg_stopping:
            want = (not self.idle_trimmed and pa.pool.num < self.refill_target and pa.free_set.num > 0
                    and (pa.limit_pages < 0
                         or pa.num_used + pa.pool.num + pa.num_transit < pa.limit_pages))
            if self.bg_backoff or not want:
                # pending fences and unmap retries are looked at every 10 ms, never in a busy loop
                period = 0.01 if pa.pending.num_batches > 0 or pa.pending.num_retry > 0 else 0.1
                if self.idle_trim_s > 0 and not self.idle_trimmed and pa.pool.num > 0:
                    period = max(0.001, min(period, self.bg_active_time + self.idle_trim_s - _now()))
                clock_gettime(CLOCK_MONOTONIC, &deadline)
                deadline.tv_sec += <long>period
                deadline.tv_nsec += <long>((period - <long>period) * 1e9)
                if deadline.tv_nsec >= 1000000000:
                    deadline.tv_sec += 1
                    deadline.tv_nsec -= 1000000000
                pthread_cond_timedwait(&self.wake, &pa.lock, &deadline)
            self.bg_backoff = False
        if self.bg_stopping:
            pthread_mutex_unlock(&pa.lock)
            return 1
        act = pa.activity
        idle = self.idle_trim_s > 0 and not self.idle_trimmed
        pthread_mutex_unlock(&pa.lock)
        now = _now()
        if act != self.bg_seen_activity:
            self.bg_seen_activity = act
            self.bg_active_time = now
            idle = False
        idle = idle and now - self.bg_active_time >= self.idle_trim_s
        pthread_mutex_lock(&pa.map_lock)
        try:
            pa._drain(False)
            if idle:
                pa._pool_out(0, pa.num_table_pages)
                pa.backend.release_cached_above(0)
                pthread_mutex_lock(&pa.lock)
                self.refill_target = self.min_reserved
                if pa.activity == act:
                    self.idle_trimmed = True
                self.num_idle_trims += 1
                pthread_mutex_unlock(&pa.lock)
            if now - pa.phys_time >= 0.005:
                pa._refresh_physical()
        finally:
            pthread_mutex_unlock(&pa.map_lock)
        if not idle:
            self._refill(pa)
        pthread_mutex_lock(&pa.lock)
        self.num_bg_rounds += 1
        pthread_mutex_unlock(&pa.lock)
        return 0

    def _run(self, PageAllocator pa not None):
        # The whole loop runs without the GIL (taking it back after every round would make the
        # thread wait a switch interval behind a busy Python caller); only errors come back here.
        while True:
            try:
                with nogil:
                    while self._bg_step(pa) == 0:
                        pass
                return
            except BaseException as exc:  # keep serving; the owner reads last_error
                pa.last_error = exc
                with nogil:
                    pthread_mutex_lock(&pa.lock)
                    self.bg_backoff = True
                    pthread_mutex_unlock(&pa.lock)

    # -- start and stop (GIL held) -------------------------------------------------------------
    cdef int _start(self, PageAllocator pa) except -1:
        """Start the background thread (daemon) for `pa`; no-op when it runs."""
        if self.thread is not None:
            return 0
        self.bg_stopping = False
        self.bg_running = True
        self.thread = _threading.Thread(target=self._run, args=(pa,), name="kvcached-page-allocator", daemon=True)
        self.thread.start()
        return 0

    cdef int _stop(self, PageAllocator pa) except -1:
        """Stop the background thread and wait for it; nothing in a forked child."""
        thread = self.thread
        if thread is None or not lifecycle_owned(&self.life):
            return 0
        with nogil:
            pthread_mutex_lock(&pa.lock)
            self.bg_stopping = True
            pthread_cond_signal(&self.wake)
            pthread_cond_broadcast(&self.pool_cv)
            pthread_mutex_unlock(&pa.lock)
        thread.join()
        self.thread = None
        self.bg_running = False
        return 0


# Note [Refill policy]
# PageAllocator keeps the mechanisms — the free set, pool push and pop, mapping a chunk into the
# pool (_map_into_pool), draining deferred unmaps, pooling out — and RefillPolicy decides when
# they run: the background thread and its wake-up, the refill target, idle trim, waiting for a
# running round, and the budget gate asked before every mapping. The allocator owns its policy
# (made in __cinit__, never replaced, never None) and the policy holds no reference back: each
# of its methods gets the allocator as an argument. A stored back-reference would make a cycle
# that only the cyclic collector breaks, delaying the unmaps of a dropped allocator's teardown;
# while the thread runs, its Thread object holds both, as the bound method did before.
# The policy has no lock of its own: its fields are guarded by the allocator's `lock`, and its
# condition variables are waited on with that lock, so the lock order is unchanged and the pool
# fast path pays one pointer load (self.policy) for the activity mark and the wake-up check —
# no call, no Python, no second lock. The allocator reads the policy's refill_target and flags
# under its lock where a mechanism needs them (the slow take's wake-up, a chunk's size).
#
# Note [Background thread]
# The thread sleeps on a condition variable, woken when a take leaves the pool under
# refill_target — the pool fast path and the slow path alike (a slow take empties the pool; not
# waking there left the pool empty for half a period, 50 ms median on the H200, while every alloc
# mapped pages itself) — on returns that queue pending pages, and on limit / resize / pool bounds
# / stop; otherwise it wakes after 100 ms, or 10 ms while unmaps are pending or waiting for a retry
# (Note [Failed unmap]). It never spins: with nothing to map it always sleeps. Each round: drain
# done fences and retry failed unmaps; if idle_trim_s passed with no take/return, unmap the pool
# and release cached handles (and do not refill until the next activity); otherwise refill the
# pool towards refill_target (Note [Proactive refill]) — ids taken from the free set under `lock`,
# mapped with only map_lock held, and pooled under `lock` again, keeping only what the limit and
# max_reserved still allow. It refreshes the free-physical-memory figure at most every 5 ms, so
# available_pages() never calls the driver. After a failed refill it sleeps one full period
# before trying again. Tests wait on its counters (num_bg_rounds, num_refill_failures).
#
# Note [Proactive refill]
# A caller that finds the pool short pays for a mapping (30 us on the H200 for one compound page,
# 64x that per_layer), so the background thread works to keep that rare:
#  - It refills towards `refill_target`, not just min_reserved: a round that saw callers go short
#    (a slow take or a wait) raises the target by the pages taken during the round, up to
#    max_reserved, so under sustained growth the stock covers what is consumed while one round
#    maps; a round during which nothing was taken puts it back to min_reserved (so does an idle
#    trim or set_pool_bounds). The pool never exceeds max_reserved, as before; it may sit above
#    min_reserved after a burst until used or idle-trimmed.
#  - A round maps one page per map_lock hold and pools it at once (broadcasting pool_cv), so a
#    page is usable as soon as it is mapped, not when the whole round ends. Under a mirrored
#    table (Note [Mirrored page table]) every map call costs a round trip to the peer ranks, so
#    there a round maps all it needs in one call: one message per round, not one per page.
#  - A caller short of pages while a round runs that will cover its need waits on pool_cv for the
#    round's pages (num_pool_waits) instead of taking map_lock: before, it queued behind the
#    round on map_lock, then re-took it ahead of the thread and mapped its own pages, so callers
#    and the thread took turns and most of a ramp's allocs paid for a mapping. A round that fails
#    or ends, and stop(), broadcast pool_cv, so a waiter then falls back to mapping itself.
# Lock order is unchanged: the waiter holds only `lock` (released in the wait) and maybe the
# BlockAllocator's lock, which the thread never takes.
