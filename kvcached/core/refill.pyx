# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, auto_pickle=False
"""kvcached.core.refill: when a page allocator's reserved pool is refilled and trimmed.

RefillPolicy is the decision half of a PageAllocator: its background thread and its wake-up, the
refill target, idle trim, waiting for a running round, and the budget gate asked before every
mapping. The mechanisms it drives — map a chunk into the pool, drain deferred unmaps, unmap the
pool, refresh the free-physical-memory figure — are the allocator's. It is its own module, apart
from kvcached.core.pagealloc, so that each stays a size one can read (the policy and its Notes
were a third of that module); being below pagealloc without a cimport cycle, it sees the
allocator as a Refillable: the locks, the page ledger and the few counters it reads, and those
mechanisms as cdef methods, which pagealloc's PageMapper (and its subclass PageAllocator)
define. The calls go through the vtable, off the pool fast path; the fast path itself only reads
the policy's fields. See Note [Refill policy].

It stands on kvcached.core.pagesets (the ledger, inline), kvcached.core.pagetable and
kvcached.core.vmm; kvcached.core.pagealloc is the only module above it.
"""

from libc.stdint cimport int32_t, int64_t, uint64_t

from kvcached.core._posix cimport (
    CLOCK_MONOTONIC, _now, clock_gettime, pthread_cond_broadcast, pthread_cond_destroy, pthread_cond_init,
    pthread_cond_signal, pthread_cond_timedwait, pthread_cond_wait, pthread_condattr_destroy, pthread_condattr_init,
    pthread_condattr_setclock, pthread_condattr_t, pthread_mutex_lock, pthread_mutex_unlock, timespec,
)
from kvcached.core.pagesets cimport _NEED_SLOW, freeset_weight_of_lowest, ledger_headroom
from kvcached.core.vmm cimport lifecycle_init, lifecycle_owned

from kvcached._threads import start_daemon


cdef class Refillable:
    """What a RefillPolicy reads and drives: a page allocator's locks, its page ledger, the
    counters the policy's rules read, and the mechanisms below, which pagealloc's PageMapper and
    PageAllocator define (Note [Refill policy]). Not made on its own."""

    cdef int _take_pool_locked(self, int64_t need, bint by_weight, int32_t* out, int* n_out) noexcept nogil:
        return _NEED_SLOW

    cdef int _map_into_pool(self, int chunk, bint* failed) except -1 nogil:
        with gil:
            raise NotImplementedError("Refillable._map_into_pool: PageMapper defines it")

    cdef int _drain(self, bint wait_all) except -1 nogil:
        with gil:
            raise NotImplementedError("Refillable._drain: PageMapper defines it")

    cdef int _unmap_pool(self) except -1 nogil:
        with gil:
            raise NotImplementedError("Refillable._unmap_pool: PageMapper defines it")

    cdef int _refresh_physical(self) except -1 nogil:
        with gil:
            raise NotImplementedError("Refillable._refresh_physical: PageMapper defines it")


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

    cdef bint _refill_covers(self, Refillable pa, int64_t need, bint by_weight) noexcept nogil:
        # would the pool, once the running refill round reaches its target, hold `need`? (under
        # lock; pages in transit are not counted, so it errs towards "no")
        cdef int k = min(self.refill_target - pa.led.pool.num, pa.led.free_set.num)
        if k <= 0:
            return False
        if by_weight:
            return pa.led.pool.weight_sum + freeset_weight_of_lowest(&pa.led.free_set, k) >= need
        return pa.led.pool.num + k >= need

    cdef int _wait_for_refill(self, Refillable pa, int64_t need, bint by_weight, int32_t* out, int* n_out) noexcept nogil:
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
    cdef int _refill(self, Refillable pa) except -1 nogil:
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
                self.refill_target = <int>min(<uint64_t>pa.led.max_reserved,
                                              max(<uint64_t>self.refill_target,
                                                  <uint64_t>self.min_reserved + pa.pages_taken - taken0))
            elif pa.pages_taken == taken0:
                self.refill_target = self.min_reserved       # demand stopped: back to the minimum
            pthread_cond_broadcast(&self.pool_cv)
            pthread_mutex_unlock(&pa.lock)
        return 0

    cdef int _bg_step(self, Refillable pa) except -1 nogil:
        """One round of the background thread: sleep until woken or a period passes, then drain,
        apply the idle policy or refill, refresh the physical figure. Returns 1 to exit."""
        cdef double now, period
        cdef timespec deadline
        cdef bint want, idle
        cdef uint64_t act
        pthread_mutex_lock(&pa.lock)
        if not self.bg_stopping:
            want = (not self.idle_trimmed and pa.led.pool.num < self.refill_target and pa.led.free_set.num > 0
                    and ledger_headroom(&pa.led) > 0)
            if self.bg_backoff or not want:
                # pending fences and unmap retries are looked at every 10 ms, never in a busy loop
                period = 0.01 if pa.led.pending.num_batches > 0 or pa.led.pending.num_retry > 0 else 0.1
                if self.idle_trim_s > 0 and not self.idle_trimmed and pa.led.pool.num > 0:
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
                pa._unmap_pool()
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

    def _run(self, Refillable pa not None):
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
    cdef int _start(self, Refillable pa) except -1:
        """Start the background thread (daemon) for `pa`; no-op when it runs."""
        if self.thread is not None:
            return 0
        self.bg_stopping = False
        self.bg_running = True
        self.thread = start_daemon(self._run, "kvcached-page-allocator", (pa,))
        return 0

    cdef int _stop(self, Refillable pa) except -1:
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
# PageAllocator keeps the mechanisms — the page ledger, mapping a chunk into the pool
# (_map_into_pool), draining deferred unmaps, unmapping the pool — and RefillPolicy decides when
# they run: the background thread and its wake-up, the refill target, idle trim, waiting for a
# running round, and the budget gate asked before every mapping. The allocator owns its policy
# (made in __cinit__, never replaced, never None) and the policy holds no reference back: each
# of its methods gets the allocator as an argument. A stored back-reference would make a cycle
# that only the cyclic collector breaks, delaying the unmaps of a dropped allocator's teardown;
# while the thread runs, its Thread object holds both, as the bound method did before.
# The policy lives in its own module, below the allocator's: the argument is typed Refillable,
# a base class declared here with the fields the policy reads and the mechanisms as cdef
# methods, which pagealloc's PageMapper (the driver work) and PageAllocator define; a cimport of
# pagealloc here would be a cycle, which Cython forbids. The mechanisms are vtable calls, made by the thread and by
# short callers, never on the pool fast path.
# The policy has no lock of its own: its fields are guarded by the allocator's `lock`, and its
# condition variables are waited on with that lock, so the lock order is unchanged and the pool
# fast path pays one pointer load (self.policy) for the activity mark and the wake-up check —
# no call, no Python, no second lock. The allocator reads the policy's refill_target and flags
# under its lock where a mechanism needs them (the slow take's wake-up, a chunk's size).
#
# Note [Background thread]
# The thread sleeps on a condition variable, woken when a take leaves the pool under
# refill_target — the pool fast path and the slow path alike (a slow take empties the pool; not
# waking there left the pool empty for half a period (median) while every alloc mapped pages
# itself; benchmarks/HISTORY.md) — on returns that queue pending pages, and on limit / resize /
# pool bounds / stop; otherwise it wakes after 100 ms, or 10 ms while unmaps are pending or waiting
# for a retry (Note [Failed unmap]). It never spins: with nothing to map it always sleeps. Each
# round: drain done fences and retry failed unmaps; if idle_trim_s passed with no take/return,
# unmap the pool and release cached handles (and do not refill until the next activity); otherwise
# refill the pool towards refill_target (Note [Proactive refill]) — ids taken from the free set
# under `lock`, mapped with only map_lock held, and pooled under `lock` again, keeping only what
# the limit and max_reserved still allow. It refreshes the free-physical-memory figure at most
# every 5 ms, so available_pages() never calls the driver. After a failed refill it sleeps one full
# period before trying again. Tests wait on its counters (num_bg_rounds, num_refill_failures).
#
# Note [Proactive refill]
# A caller that finds the pool short pays for a mapping (for one compound page ~100x an alloc
# from the pool, and per_layer 60-70x more again; benchmarks/README.md, bench_manager and
# bench_vmm), so the background thread works to keep that rare:
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
