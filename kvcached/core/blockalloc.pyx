# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, auto_pickle=False
"""kvcached.core.blockalloc: block ids over whole pages, the hot path's top layer.

BlockAllocator: free slots per page, best fit, a per-block allocated bit; its bookkeeping of which
ids are free and where is its base class BlockSlots, over the pages-by-free-count struct of
kvcached.core.freebuckets, and what callers pass is checked and converted by kvcached.core.blockargs.
It stands on
kvcached.core.pagealloc (PageAllocator: free page ids, reserved pool, deferred unmap, limits; its
RefillPolicy) over kvcached.core.pagetable (PageTable: what one page id maps, all-or-nothing) over
kvcached.core.vmm (checked driver calls, the backends and their handle cache). Calls into them are
vtable calls through those .pxd contracts; nothing here touches their locks.

Glossary: range = virtual reservation; page = physical mapping unit (one page id backs one
mapping per segment); block = KV slot; pool = mapped but unused pages.

Every cdef function says how it fails: ``except -1`` raises (driver and syscall errors), and out of
memory is the value ``_OOM`` (1), never an exception, so callers can roll back and return None.
"""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset
from cpython.list cimport PyList_GET_SIZE, PyList_New
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_CheckExact
from cpython.ref cimport Py_XDECREF, PyObject

from kvcached.core._posix cimport (
    pthread_mutex_destroy, pthread_mutex_init, pthread_mutex_lock, pthread_mutex_trylock,
    pthread_mutex_unlock,
)
from kvcached.core.vmm cimport (
    _OOM, lifecycle_check, lifecycle_check_owned, lifecycle_close, lifecycle_init, lifecycle_live, lifecycle_name,
    lifecycle_owned,
)
from kvcached.core cimport pagealloc
from kvcached.core.pagealloc cimport _NEED_SLOW, _PS_USED, _max_new_pages
from kvcached.core.freebuckets cimport (
    buckets_at_least, buckets_check, buckets_free, buckets_highest, buckets_init, buckets_insert, buckets_remove,
)
from kvcached.core.blockargs cimport (
    ID_CACHE_MAX, check_bookkeeping_fits, count_of, ids_from_list, int32_view_source, kvc_fill_id_list,
    page_intervals,
)

from operator import index as _index

from kvcached.errors import BlockStateError, KVCachedConfigError, MappingError

# BlockAllocator: free slots per page, best fit, a per-block allocated bit. See Note [Block
# placement], Note [Allocator locks], Note [try_to_reserve]; what callers pass is checked and
# converted by blockargs (Note [Block id objects], Note [Bookkeeping memory], Note [Counts and ids
# past int32] there), the pages by free count are freebuckets' (Note [Free buckets]).

cdef enum:
    _STACK_IDS = 512     # requests up to this many ids use a stack buffer, not malloc


cdef int32_t* _id_buffer(Py_ssize_t n, int32_t* stack) except NULL:
    # Where n ids go: `stack` (_STACK_IDS long) when they fit, else a malloc'd buffer that the
    # caller frees (it is not `stack`); MemoryError when malloc fails.
    cdef int32_t* buf
    if n <= _STACK_IDS:
        return stack
    buf = <int32_t*>malloc(n * sizeof(int32_t))
    if buf == NULL:
        raise MemoryError
    return buf


cdef class BlockSlots:
    """Which block ids are free, and where: per page its interval of ids and, while owned (taken
    from the page allocator), a stack of its free ids; per block its state; the held stack; the
    partially used pages by free count (Note [Free buckets] in freebuckets); the counts. Pure
    bookkeeping: the subclass BlockAllocator holds the lock around every call, talks to the page
    allocator and checks the whole (check_invariants). Placement: Note [Block placement]."""

    def __init__(self, *args, **kwargs):
        raise TypeError("BlockSlots is BlockAllocator's bookkeeping: make a BlockAllocator")

    cdef int _init_slots(self, first, count, int64_t id_to_page_num, int64_t id_to_page_den,
                         int64_t max_block_id) except -1:
        """The arrays for the checked intervals (first, count: blockargs.page_intervals), every
        id free, no page owned. Raises MemoryError (the arrays made so far freed by __dealloc__)."""
        cdef int P = len(count), p
        cdef int64_t base = 0
        self.num_pages = P
        self.max_block_id = <int32_t>max_block_id
        self.id_to_page_num = id_to_page_num
        self.id_to_page_den = id_to_page_den
        self.total_blocks = int(count.sum())
        self.max_blocks_per_page = int(count.max()) if P else 0
        self.page_first = <int32_t*>calloc(max(1, P), sizeof(int32_t))
        self.page_blocks = <int32_t*>calloc(max(1, P), sizeof(int32_t))
        self.slot_base = <int64_t*>calloc(max(1, P), sizeof(int64_t))
        self.slots = <int32_t*>malloc(max(1, self.total_blocks) * sizeof(int32_t))
        self.page_free = <int32_t*>calloc(max(1, P), sizeof(int32_t))
        self.page_owned = <uint8_t*>calloc(max(1, P), sizeof(uint8_t))
        self.page_mark = <uint8_t*>calloc(max(1, P), sizeof(uint8_t))
        self.page_adopted = <uint8_t*>calloc(max(1, P), sizeof(uint8_t))
        self.block_state = <uint8_t*>malloc(max(1, max_block_id) * sizeof(uint8_t))
        self.held = <int32_t*>malloc(max(1, self.total_blocks) * sizeof(int32_t))
        self.page_buf = <int32_t*>malloc(max(1, P) * sizeof(int32_t))
        if (self.page_first == NULL or self.page_blocks == NULL or self.slot_base == NULL or self.slots == NULL
                or self.page_free == NULL or self.page_owned == NULL or self.page_mark == NULL
                or self.page_adopted == NULL or self.block_state == NULL or self.held == NULL or self.page_buf == NULL
                or buckets_init(&self.buckets, P, self.max_blocks_per_page) != 0):
            raise MemoryError("no memory for the block allocator")
        memset(self.block_state, _BS_INVALID, max_block_id)
        for p in range(P):
            self.page_first[p] = <int32_t>first[p] if count[p] > 0 else 0
            self.page_blocks[p] = <int32_t>count[p]
            self.slot_base[p] = base
            base += count[p]
            memset(self.block_state + self.page_first[p], _BS_FREE, self.page_blocks[p])
        return 0

    def __dealloc__(self):
        free(self.page_first)
        free(self.page_blocks)
        free(self.slot_base)
        free(self.slots)
        free(self.page_free)
        free(self.page_owned)
        free(self.page_mark)
        free(self.page_adopted)
        free(self.block_state)
        free(self.held)
        free(self.page_buf)
        buckets_free(&self.buckets)

    cdef void _adopt(self, int32_t page_id) noexcept nogil:
        # a page just taken from the page allocator: all its ids free, lowest on top
        cdef int i, c = self.page_blocks[page_id]
        cdef int32_t first = self.page_first[page_id]
        cdef int32_t* stack = self.slots + self.slot_base[page_id]
        for i in range(c):
            stack[i] = first + c - 1 - i
        self.page_owned[page_id] = 1
        self.page_adopted[page_id] = 1
        self.page_free[page_id] = c
        self.partial_free += c
        self.num_owned += 1
        buckets_insert(&self.buckets, page_id, c)

    cdef int _take_from(self, int32_t page_id, int k, int32_t* out) noexcept nogil:
        # k ids off the page's free stack (k <= its free count); re-bucket it
        cdef int i, f = self.page_free[page_id]
        cdef int32_t* stack = self.slots + self.slot_base[page_id]
        cdef int32_t b
        buckets_remove(&self.buckets, page_id, f)
        for i in range(k):
            b = stack[f - 1 - i]
            out[i] = b
            self.block_state[b] = _BS_ALLOCATED
        f -= k
        self.page_free[page_id] = f
        self.partial_free -= k
        if f > 0:
            buckets_insert(&self.buckets, page_id, f)
        return k

    cdef int _hold(self, int n, const int32_t* ids) noexcept nogil:
        # try_to_reserve: the ids just allocated become held (under lock)
        cdef int i
        for i in range(n):
            self.block_state[ids[i]] = _BS_HELD
            self.held[self.num_held] = ids[i]
            self.num_held += 1
        self.num_allocated -= n
        return 0

    cdef int _place(self, int n, int h, int np_new, int32_t* out) noexcept nogil:
        """Hand out n ids into out: h held ones, then from the owned pages and the np_new new
        pages in page_buf (Note [Block placement]); the caller made sure they hold enough. New
        pages that turn out not to be needed (frees came in while they were mapped) are not
        adopted: they are moved to page_buf[0..L) and L is returned, for the caller to give back."""
        cdef int pos, j, f, k, left = 0
        cdef int64_t rem
        cdef int32_t p
        for j in range(h):
            self.num_held -= 1
            out[j] = self.held[self.num_held]
            self.block_state[out[j]] = _BS_ALLOCATED
        pos = h
        if np_new > 0:
            # every partially used page in full (emptiest first), then the new pages in order
            while True:
                f = buckets_highest(&self.buckets)
                if f <= 0:
                    break
                pos += self._take_from(self.buckets.head[f], f, out + pos)
            for j in range(np_new):
                p = self.page_buf[j]
                if pos >= n:
                    self.page_buf[left] = p
                    left += 1
                    continue
                self._adopt(p)
                k = min(self.page_blocks[p], n - pos)
                pos += self._take_from(p, k, out + pos)
        else:
            rem = n - h
            while rem > 0:
                f = buckets_highest(&self.buckets)
                if rem <= f:
                    f = buckets_at_least(&self.buckets, <int>rem)
                    pos += self._take_from(self.buckets.head[f], <int>rem, out + pos)
                    rem = 0
                else:
                    pos += self._take_from(self.buckets.head[f], f, out + pos)
                    rem -= f
        self.num_allocated += n
        self.num_allocs += 1
        return left

    cdef int _free_locked(self, int n, const int32_t* ids, int* n_empty, int64_t* bad) noexcept nogil:
        """Free ids[0..n): returns 0 with the pages that became empty in page_buf[0..n_empty)
        (no longer owned; the caller returns them), or _BAD_ID with nothing changed and
        bad = [id, reason] (0 unknown, 1 not allocated, 2 repeated in this call)."""
        cdef int i, j, f, ne = 0, nt = 0
        cdef int32_t b, p
        cdef uint8_t s
        for i in range(n):
            b = ids[i]
            s = self.block_state[b] if 0 <= b < self.max_block_id else _BS_INVALID
            if s != _BS_ALLOCATED:
                bad[0] = b
                bad[1] = 0 if s == _BS_INVALID else (2 if s == _BS_MARK else 1)
                for j in range(i):
                    self.block_state[ids[j]] = _BS_ALLOCATED
                return _BAD_ID
            self.block_state[b] = _BS_MARK
        # Group by page in one pass: consecutive ids of one page skip the division, and each
        # page leaves its bucket once, on first touch, and re-enters it once at the end.
        p = -1
        for i in range(n):
            b = ids[i]
            self.block_state[b] = _BS_FREE
            if p < 0 or <uint32_t>(b - self.page_first[p]) >= <uint32_t>self.page_blocks[p]:
                p = <int32_t>((<int64_t>b * self.id_to_page_num) // self.id_to_page_den)
                if not self.page_mark[p]:
                    self.page_mark[p] = 1
                    f = self.page_free[p]
                    if f > 0:
                        buckets_remove(&self.buckets, p, f)
                    self.page_buf[nt] = p
                    nt += 1
            f = self.page_free[p]
            self.slots[self.slot_base[p] + f] = b
            self.page_free[p] = f + 1
        self.partial_free += n
        for j in range(nt):
            p = self.page_buf[j]
            self.page_mark[p] = 0
            f = self.page_free[p]
            if f == self.page_blocks[p]:
                self.page_buf[ne] = p
                ne += 1
                self.page_owned[p] = 0
                self.partial_free -= f
                self.page_free[p] = 0
                self.num_owned -= 1
            else:
                buckets_insert(&self.buckets, p, f)
        self.num_allocated -= n
        self.num_frees += 1
        n_empty[0] = ne
        return 0


cdef class BlockAllocator(BlockSlots):
    """Hands out KV block ids over the pages of one PageAllocator; layout-agnostic.

    Page p holds the ids [page_first_block[p], page_first_block[p] + page_num_blocks[p]) (counts
    may differ per page; a block straddling two pages belongs to none and is never handed out),
    and block b lies in page (b * id_to_page_num) // id_to_page_den. Each owned page keeps a
    stack of its free ids, and partially used pages sit in buckets by free count with a bitmap of
    non-empty buckets — rather than a heap or a sorted list — so that best fit and "emptiest
    page" are a bit scan and every step is O(1) (Note [Block placement]).

    Thread-safe: one lock, see Note [Allocator locks]. After close(), and in a forked child,
    every method raises KVCachedClosedError (Note [Fork and close]).
    """

    def __cinit__(self, *args, **kwargs):
        pthread_mutex_init(&self.lock, NULL)
        lifecycle_init(&self.life)

    def __init__(self, pagealloc.PageAllocator pages not None, page_first_block, page_num_blocks, int64_t id_to_page_num,
                 int64_t id_to_page_den, int64_t max_block_id):
        """pages: a fresh PageAllocator (no page taken yet; the weights are bound here);
        page_first_block, page_num_blocks: one entry per page id of its table; block b lies in
        page (b * id_to_page_num) // id_to_page_den; max_block_id: ids are below it.

        Host memory: its arrays only, ~9 bytes per block id (Note [Bookkeeping memory] in blockargs); the
        checks and the set-up are O(pages) beyond them.

        Raises KVCachedConfigError when the arrays have the wrong length, an interval is
        negative or past max_block_id, a block of page p's interval maps to another page, the
        arrays would not fit in the host memory the process can still allocate (checked before
        any is allocated), or the page allocator already serves another BlockAllocator."""
        cdef int P = pages.num_table_pages
        cdef int p
        first, count = page_intervals(page_first_block, page_num_blocks, P, id_to_page_num, id_to_page_den,
                                      max_block_id)
        total = int(count.sum())
        most_per_page = int(count.max()) if P else 0
        id_cache = min(max_block_id, ID_CACHE_MAX)
        needed = (P * (3 * sizeof(int32_t) + sizeof(int64_t) + 3 * sizeof(uint8_t) + 3 * sizeof(int32_t))
                  + max_block_id * sizeof(uint8_t) + 2 * total * sizeof(int32_t)
                  + (most_per_page + 1) * sizeof(int32_t) + (most_per_page + 64) // 64 * sizeof(uint64_t)
                  + id_cache * sizeof(PyObject*))
        check_bookkeeping_fits(needed, total, max_block_id, P)
        self.pages = pages
        self._init_slots(first, count, id_to_page_num, id_to_page_den, max_block_id)
        self.id_objs_len = <int32_t>id_cache
        self.id_objs = <PyObject**>calloc(max(1, self.id_objs_len), sizeof(PyObject*))
        if self.id_objs == NULL:
            raise MemoryError("no memory for the block allocator")
        for p in range(P):
            if self.page_first[p] < self.id_objs_len:     # touched now, not by an alloc: Note [Block id objects] in blockargs
                memset(self.id_objs + self.page_first[p], 0,
                       min(self.page_blocks[p], self.id_objs_len - self.page_first[p]) * sizeof(PyObject*))
        from kvcached.config import settings
        self.debug_checks = settings().debug_checks
        if P:
            pages._bind_weights(self.page_blocks)

    @classmethod
    def dense(cls, pagealloc.PageAllocator pages not None, int64_t block_bytes, page_bytes=None, max_block_id=None):
        """Dense ids: block b covers bytes [b * block_bytes, (b + 1) * block_bytes) of each buffer
        and page p the bytes [p * page_bytes, (p + 1) * page_bytes) (default: the table's
        map_bytes, i.e. one segment); blocks straddling two pages are never handed out.
        max_block_id defaults to every block that fits in the table's pages."""
        import numpy as np
        cdef int P = pages.num_table_pages
        pb = int(pages.table.map_bytes if page_bytes is None else page_bytes)
        if block_bytes < 1 or pb < 1:
            raise KVCachedConfigError(f"block_bytes={block_bytes} and page_bytes={pb} must be >= 1")
        top = P * pb // block_bytes if max_block_id is None else int(max_block_id)
        starts = np.arange(P, dtype=np.int64) * pb
        first = -(-starts // block_bytes)
        last = np.minimum((starts + pb) // block_bytes, top)
        count = np.maximum(last - first, 0)
        return cls(pages, np.where(count > 0, first, 0), count, block_bytes, pb, top)

    @classmethod
    def sparse(cls, pagealloc.PageAllocator pages not None, int ids_per_page, int blocks_per_page):
        """Sparse page-grouped ids: page p holds [p * ids_per_page, p * ids_per_page +
        blocks_per_page)."""
        import numpy as np
        cdef int P = pages.num_table_pages
        if not 1 <= blocks_per_page <= ids_per_page:
            raise KVCachedConfigError(f"need 1 <= blocks_per_page ({blocks_per_page}) <= ids_per_page ({ids_per_page})")
        first = np.arange(P, dtype=np.int64) * ids_per_page
        return cls(pages, first, np.full(P, blocks_per_page), 1, ids_per_page,
                   (P - 1) * ids_per_page + blocks_per_page)

    def __dealloc__(self):
        cdef int p
        cdef int32_t b, end
        if self.id_objs != NULL and self.page_adopted != NULL and self.page_first != NULL:
            # only pages ever adopted can have handed out (hence cached) ids
            for p in range(self.num_pages):
                if self.page_adopted[p]:
                    end = min(self.page_first[p] + self.page_blocks[p], self.id_objs_len)
                    for b in range(self.page_first[p], end):
                        Py_XDECREF(self.id_objs[b])
        free(self.id_objs)
        if lifecycle_owned(&self.life):       # in a forked child the lock may be held by a lost thread
            pthread_mutex_destroy(&self.lock)

    cdef int _check_live(self) except -1:
        """0 while live; raises KVCachedClosedError once closed or in a forked child."""
        if lifecycle_live(&self.life):
            return 0
        return lifecycle_check(
            &self.life, b"kvcached allocator (BlockAllocator)",
            b"its manager was closed or kvcached shut down: nothing can be allocated or freed through it; "
            b"make a new manager (get_kv_cache_manager or KVCacheManager).")

    @property
    def lifecycle(self) -> str:
        """"live", "closed" (close() was called) or "forked" (inherited by a forked child)."""
        return lifecycle_name(&self.life)

    def close(self):
        """Free every allocated and held block, then close the page allocator (stop its thread,
        unmap its pool and pending pages, drop its budget gate). Afterwards every method raises
        KVCachedClosedError; ids handed out before are no longer this allocator's. Idempotent; does
        nothing in a forked child (Note [Fork and close]). Raises the first failure of the
        teardown, the allocator closed all the same. Holds the lock throughout, so a call racing
        with close() either finishes before it or sees the allocator closed."""
        if not lifecycle_live(&self.life):
            return
        self._lock()
        try:
            if not lifecycle_live(&self.life):
                return
            lifecycle_close(&self.life)
            try:
                self._clear_locked()
            finally:
                self.pages.close()
        finally:
            pthread_mutex_unlock(&self.lock)

    # -- the workers (hold lock) -------------------------------------------------------------
    cdef int _alloc_locked(self, int n, int32_t* out, bint may_block, bint use_held) except -1 nogil:
        """n distinct ids into out[0..n). Returns 0; _OOM with nothing changed; or, when not
        may_block (GIL held: no driver call allowed), _NEED_SLOW with nothing changed if pages
        beyond the pool are needed. Policy: Note [Block placement]."""
        cdef int h = 0, pos, np_new = 0, j, f, k, rc
        cdef int64_t r, rem
        cdef int32_t p
        if use_held:
            h = <int>min(<int64_t>n, self.num_held)
        r = n - h
        if r > self.partial_free:
            if may_block:
                rc = self.pages.take_blocks(r - self.partial_free, self.page_buf, &np_new)
                if rc == _OOM:
                    self.num_failed_allocs += 1
                    self.num_failed_blocks += n
                    return _OOM
            elif self.pages.take_pool(r - self.partial_free, True, self.page_buf, &np_new) != 0:
                return _NEED_SLOW
        self._place(n, h, np_new, out)          # nothing can fail from here on
        return 0

    # -- lock helpers (Note [Allocator locks]) -------------------------------------------------
    cdef int _check_not_forked(self) except -1:
        # read-only surfaces (stats, checks) still answer on a closed allocator, never in a child
        return lifecycle_check_owned(&self.life, b"kvcached allocator (BlockAllocator)")

    cdef int _lock(self) except -1:
        # uncontended: take it without dropping the GIL; else wait with the GIL released
        if pthread_mutex_trylock(&self.lock) != 0:
            with nogil:
                pthread_mutex_lock(&self.lock)
        return 0

    cdef int _run_alloc(self, int n, int32_t* out, bint use_held, bint hold=False) except -1:
        """alloc's worker: the pool fast path under the lock with the GIL; else the pages are
        taken — refill wait, budget gate, driver map — without holding the lock, so frees and
        pool-served allocs of other threads go on meanwhile (Note [Allocator locks]). With
        `hold` (try_to_reserve), the ids become held before the lock is let go."""
        cdef int rc, np_new = 0, attempt, left
        cdef int64_t r, fresh_blocks, j
        cdef int32_t* fresh = NULL
        cdef bint locked
        self._lock()
        locked = True
        try:
            rc = self._alloc_locked(n, out, False, use_held)
            if rc != _NEED_SLOW:
                if rc == 0 and hold:
                    self._hold(n, out)
                return rc
            fresh = <int32_t*>malloc(max(1, self.num_pages) * sizeof(int32_t))
            if fresh == NULL:
                raise MemoryError
            for attempt in range(2):
                r = n - (min(<int64_t>n, self.num_held) if use_held else 0) - self.partial_free
                self.num_inflight += 1
                pthread_mutex_unlock(&self.lock)
                locked = False
                try:
                    with nogil:
                        rc = self.pages.take_blocks(r, fresh, &np_new)
                finally:
                    self._lock()
                    locked = True
                    self.num_inflight -= 1
                if rc == _OOM:
                    rc = self._alloc_locked(n, out, False, use_held)    # frees meanwhile may cover it
                    if rc == _NEED_SLOW:
                        self.num_failed_allocs += 1
                        self.num_failed_blocks += n
                        return _OOM
                    if rc == 0 and hold:
                        self._hold(n, out)
                    return rc
                if not lifecycle_live(&self.life):                # closed while we mapped
                    with nogil:
                        self.pages._discard_used(np_new, fresh)
                    self._check_live()
                r = n - (min(<int64_t>n, self.num_held) if use_held else 0)
                fresh_blocks = 0
                for j in range(np_new):
                    fresh_blocks += self.page_blocks[fresh[j]]
                if r <= self.partial_free + fresh_blocks:
                    if r <= self.partial_free:                    # frees came in: the new pages are not needed
                        self._place(n, n - <int>r, 0, out)
                        memcpy(self.page_buf, fresh, np_new * sizeof(int32_t))
                        left = np_new
                    else:
                        memcpy(self.page_buf, fresh, np_new * sizeof(int32_t))
                        left = self._place(n, n - <int>r, np_new, out)
                    if hold:
                        self._hold(n, out)
                    if left:
                        self._return_pages(left)
                    return 0
                # other threads took the free slots meanwhile: give the pages back, try again
                memcpy(self.page_buf, fresh, np_new * sizeof(int32_t))
                if np_new:
                    self._return_pages(np_new)
            # still overtaken: map under the lock, where nobody can take the slots away
            with nogil:
                rc = self._alloc_locked(n, out, True, use_held)
            if rc == 0 and hold:
                self._hold(n, out)
            return rc
        finally:
            if locked:
                pthread_mutex_unlock(&self.lock)
            free(fresh)

    cdef int _return_pages(self, int ne) except -1:
        """Give the pages that became empty (page_buf[0..ne)) back, under `lock`. The blocks are
        free already, so a driver failure while the page allocator unmaps is not raised to the
        caller of free: it is kept in pages.last_error, and the pages stay accounted for (pool,
        pending, or queued for an unmap retry: Note [Failed unmap])."""
        if self.pages.return_pages_fast(ne, self.page_buf) == 0:
            return 0
        try:
            with nogil:
                self.pages.return_pages(ne, self.page_buf)
        except Exception as exc:
            self.pages.last_error = exc
        return 0

    cdef int _run_free(self, int n, const int32_t* ids) except -1:
        cdef int rc, ne = 0
        cdef int64_t bad[2]
        self._lock()
        try:
            rc = self._free_locked(n, ids, &ne, bad)
            if rc == 0 and ne > 0:
                self._return_pages(ne)
        finally:
            pthread_mutex_unlock(&self.lock)
        if rc == _BAD_ID:
            self._check_live()               # closed while this call waited for the lock
        if rc == _BAD_ID:
            why = ("is not a block id of this allocator (out of range, or straddling two pages)",
                   "is not allocated (never allocated, already freed, or held by try_to_reserve)",
                   "appears more than once in this call")[bad[1]]
            raise BlockStateError(f"block id {bad[0]} {why}; nothing was freed.")
        return 0

    cdef list _id_list(self, long long count, int32_t* out):
        """The `count` ids just allocated into out, as alloc hands them out: a list of int, or
        MemoryError with the ids given back (never a partial result); checked in debug mode."""
        result = PyList_New(count)
        try:
            kvc_fill_id_list(result, out, count, self.id_objs, self.id_objs_len)
        except MemoryError:
            self._run_free(<int>count, out)
            raise
        if self.debug_checks:
            self.check_invariants()
        return result

    # -- Python surface -------------------------------------------------------------------------
    def alloc(self, n):
        """Exactly `n` distinct block ids (a list of int), or None when the pages cannot be
        had (out of memory, limit, capacity) — never a partial result; state unchanged on None.

        Cost: O(n + pages touched); the pool fast path makes no driver call and keeps the GIL.
        An n above total_blocks, of any size, is None at once (Note [Counts and ids past int32] in blockargs).
        Raises ValueError for n < 0, TypeError for an n that is not an integer (1.5, True)."""
        cdef int32_t stack_ids[_STACK_IDS]
        cdef int32_t* out
        cdef int rc, i
        cdef long long count
        self._check_live()
        count = self._checked_count(n, "alloc")
        if count <= 0:
            return [] if count == 0 else None
        out = _id_buffer(count, stack_ids)
        try:
            rc = self._run_alloc(count, out, True)
            if rc != 0:
                return None
            return self._id_list(count, out)
        finally:
            if out != stack_ids:
                free(out)

    def alloc_into(self, buf) -> bool:
        """Fill a caller's contiguous int32 buffer (numpy array, CPU tensor, array.array) with
        len(buf) distinct ids: True, or False with nothing changed (buffer contents undefined)."""
        self._check_live()
        cdef int32_t[::1] view = int32_view_source(buf)
        cdef int n = <int>view.shape[0]
        if n == 0:
            return True
        return self._run_alloc(n, &view[0], True) == 0

    def free(self, ids):
        """Free the given ids (any iterable of int). Raises BlockStateError — with nothing freed —
        for an id that is unknown, not allocated, or repeated. Pages that become empty go back
        to the page allocator (pool, or unmapped after their fence). O(len(ids))."""
        cdef int32_t stack_ids[_STACK_IDS]
        cdef int32_t* buf
        cdef Py_ssize_t n, i
        self._check_live()
        if not isinstance(ids, list):
            ids = list(ids)
        n = PyList_GET_SIZE(ids)
        if n == 0:
            return
        buf = _id_buffer(n, stack_ids)
        try:
            ids_from_list(ids, n, buf, self.max_block_id)
            self._run_free(<int>n, buf)
            if self.debug_checks:
                self.check_invariants()
        finally:
            if buf != stack_ids:
                free(buf)

    def free_from(self, buf):
        """free() for a contiguous int32 buffer (numpy array, CPU tensor), without Python ints."""
        self._check_live()
        cdef const int32_t[::1] view = int32_view_source(buf)
        if view.shape[0]:
            self._run_free(<int>view.shape[0], &view[0])

    def available_blocks(self, max_new_pages=-1) -> int:
        """Blocks alloc could hand out now: held ones, free slots in owned pages, and the blocks
        of the pages the page allocator could deliver (pool + lowest free ids, within the limit,
        the free physical memory figure and `max_new_pages`: at most that many pages beyond the
        ones already mapped, -1 no cap — a manager under a global budget passes the budget's
        free bytes // page bytes). alloc(available_blocks()) succeeds and
        alloc(available_blocks() + 1) returns None when nothing changes in between (exact on the
        host backend; on CUDA, pages whose unmap is pending are not counted). O(log pages).
        Raises KVCachedConfigError for a max_new_pages below -1 or not an integer."""
        cdef int64_t total, cap = -1
        self._check_live()
        if max_new_pages is not -1:
            cap = _max_new_pages(max_new_pages)
        self._lock()
        total = self.num_held + self.partial_free + self.pages.available_weight(True, cap)
        pthread_mutex_unlock(&self.lock)
        return total

    def try_to_reserve(self, n) -> bool:
        """Hold `n` more blocks aside (allocated now, so their pages are mapped) for the next
        allocs, which take held blocks first. True, or False with nothing changed. See
        Note [try_to_reserve]. An n above total_blocks is False at once, like alloc's None.
        Raises ValueError for n < 0, TypeError for an n that is not an integer."""
        cdef int32_t* out
        cdef int rc, i
        cdef long long count
        self._check_live()
        count = self._checked_count(n, "try_to_reserve")
        if count <= 0:
            return count == 0
        out = <int32_t*>malloc(count * sizeof(int32_t))
        if out == NULL:
            raise MemoryError
        try:
            rc = self._run_alloc(count, out, False, True)
        finally:
            free(out)
        return rc == 0

    def alloc_on(self, page_id, n):
        """`n` free ids of page `page_id`, which must be in use (mapped, holding live blocks): a
        list, or None with nothing changed when the page is not in use or has fewer free ids.
        Maps nothing, so no limit or budget applies: the destinations of moved blocks
        (KVCacheManager.plan_compaction). Raises MappingError for a page id out of range,
        ValueError / TypeError for a bad n. O(n)."""
        cdef int32_t stack_ids[_STACK_IDS]
        cdef int32_t* out
        cdef int32_t p
        cdef long long count
        self._check_live()
        page = _index(page_id)
        if not 0 <= page < self.num_pages:
            raise MappingError(f"page id {page} is out of range [0, {self.num_pages})")
        p = page
        count = self._checked_count(n, "alloc_on")
        if count <= 0:
            return [] if count == 0 else None
        out = _id_buffer(count, stack_ids)
        try:
            self._lock()
            if not self.page_owned[p] or self.page_free[p] < count:
                pthread_mutex_unlock(&self.lock)
                return None
            self._take_from(p, <int>count, out)
            self.num_allocated += count
            self.num_allocs += 1
            pthread_mutex_unlock(&self.lock)
            return self._id_list(count, out)
        finally:
            if out != stack_ids:
                free(out)

    cdef long long _checked_count(self, object n, str what) except -2:
        # alloc's and try_to_reserve's count: n in [0, total_blocks]; -1 for one above it, of any
        # size (a failed alloc, counted, nothing else changed: the caller answers None / False);
        # raises ValueError for a negative one. See Note [Counts and ids past int32] in blockargs.
        cdef int overflow = 0
        cdef long long count = PyLong_AsLongLongAndOverflow(n, &overflow) if PyLong_CheckExact(n) \
            else count_of(n, what, &overflow)
        if not overflow and 0 <= count <= self.total_blocks:
            return count
        if overflow < 0 or (not overflow and count < 0):
            raise ValueError(f"{what}(n={_index(n)}): n must be >= 0")
        self._lock()
        self.num_failed_allocs += 1
        pthread_mutex_unlock(&self.lock)
        return -1

    def free_reserved(self):
        """Free every held block (pages that become empty go back)."""
        cdef int64_t i, n
        cdef int ne = 0
        cdef int64_t bad[2]
        self._check_live()
        self._lock()
        try:
            n = self.num_held
            for i in range(n):
                self.block_state[self.held[i]] = _BS_ALLOCATED
            self.num_allocated += n
            self.num_held = 0
            if n:
                self._free_locked(<int>n, self.held, &ne, bad)
                if ne:
                    self._return_pages(ne)
        finally:
            pthread_mutex_unlock(&self.lock)

    def clear(self):
        """Free every allocated and held block. O(blocks of owned pages)."""
        self._check_live()
        self._lock()
        try:
            self._clear_locked()
        finally:
            pthread_mutex_unlock(&self.lock)

    cdef int _clear_locked(self) except -1:
        cdef int32_t* ids = <int32_t*>malloc(max(1, self.num_allocated + self.num_held) * sizeof(int32_t))
        cdef int64_t n = 0, b
        cdef int p, ne = 0
        cdef int64_t bad[2]
        if ids == NULL:
            raise MemoryError
        try:
            for p in range(self.num_pages):
                if self.page_owned[p]:
                    for b in range(self.page_first[p], self.page_first[p] + self.page_blocks[p]):
                        if self.block_state[b] == _BS_ALLOCATED or self.block_state[b] == _BS_HELD:
                            if self.block_state[b] == _BS_HELD:
                                self.num_allocated += 1
                            self.block_state[b] = _BS_ALLOCATED
                            ids[n] = <int32_t>b
                            n += 1
            self.num_held = 0
            if n:
                self._free_locked(<int>n, ids, &ne, bad)
                if ne:
                    self._return_pages(ne)
        finally:
            free(ids)
        return 0

    def resize(self, int num_pages) -> bool:
        """PageAllocator.resize under this allocator's lock: False (nothing changed) when pages
        holding live or held blocks lie at or above num_pages."""
        self._check_live()
        self._lock()
        try:
            return self.pages.resize(num_pages)
        finally:
            pthread_mutex_unlock(&self.lock)

    def trim(self):
        """Unmap the page allocator's pool and release cached handles."""
        self._check_live()
        self.pages.trim()

    def page_occupancy(self, page_ids=None) -> dict:
        """{page_id: (live blocks incl. held, blocks the page holds)} for owned pages (or the
        given ones)."""
        self._check_live()
        result = {}
        self._lock()
        try:
            pages = range(self.num_pages) if page_ids is None else page_ids
            for p in pages:
                if not 0 <= p < self.num_pages:
                    raise MappingError(f"page id {p} is out of range [0, {self.num_pages})")
                if page_ids is not None or self.page_owned[p]:
                    live = self.page_blocks[p] - self.page_free[p] if self.page_owned[p] else 0
                    result[p] = (live, self.page_blocks[p])
        finally:
            pthread_mutex_unlock(&self.lock)
        return result

    def stats(self) -> dict:
        """Block counts and counters, with the page allocator's stats under "pages". Answers on a
        closed allocator (the final figures); raises KVCachedClosedError in a forked child."""
        self._check_not_forked()
        self._lock()
        try:
            result = {
                "allocated": self.num_allocated, "held": self.num_held, "owned_pages": self.num_owned,
                "free_in_owned_pages": self.partial_free, "total_blocks": self.total_blocks,
                "num_allocs": self.num_allocs, "num_frees": self.num_frees,
                "num_failed_allocs": self.num_failed_allocs,
                "num_failed_blocks": self.num_failed_blocks, "pages": self.pages.stats(),
            }
        finally:
            pthread_mutex_unlock(&self.lock)
        return result

    def block_states(self):
        """numpy uint8 copy of every block id's state (0 free, 1 allocated, 2 invalid, 3 held)."""
        import numpy as np
        arr = np.empty(self.max_block_id, dtype=np.uint8)
        cdef uint8_t[::1] v = arr
        self._check_not_forked()
        self._lock()
        if self.max_block_id:
            memcpy(&v[0], self.block_state, self.max_block_id)
        pthread_mutex_unlock(&self.lock)
        return arr

    def check_invariants(self):
        """O(blocks + pages): every valid id is free (in an owned page's stack or in a page not
        owned), allocated or held, in exactly one place; per-page counts, buckets, bitmap and
        totals agree; owned pages are exactly the page allocator's used pages, hence mapped
        (mapped pages >= pages holding live blocks). Then the page allocator's own check.
        Raises AssertionError naming the first broken one."""
        import numpy as np
        cdef int P = self.num_pages, p
        self._check_not_forked()
        self._lock()
        try:
            state = np.array(<uint8_t[:max(1, self.max_block_id)]>self.block_state)[:self.max_block_id].copy()
            first = np.array(<int32_t[:max(1, P)]>self.page_first)[:P].copy()
            count = np.array(<int32_t[:max(1, P)]>self.page_blocks)[:P].copy()
            pfree = np.array(<int32_t[:max(1, P)]>self.page_free)[:P].copy()
            owned = np.array(<uint8_t[:max(1, P)]>self.page_owned)[:P].copy()
            held = [self.held[i] for i in range(self.num_held)]
            stacks = {p: sorted(self.slots[self.slot_base[p] + i] for i in range(self.page_free[p]))
                      for p in range(P) if self.page_owned[p]}
            buckets_check(&self.buckets, self.page_free)     # page p filed under page_free[p] when > 0
            totals = (self.num_allocated, self.num_held, self.partial_free, self.num_owned)
            inflight = self.num_inflight
            page_states = self.pages.page_states()
        finally:
            pthread_mutex_unlock(&self.lock)
        num_allocated, num_held, partial_free, num_owned = totals
        assert not (state == _BS_MARK).any(), "a transient mark survived a free"
        valid = np.zeros(self.max_block_id, dtype=bool)
        for p in range(P):
            valid[first[p]:first[p] + count[p]] = True
        assert ((state == _BS_INVALID) == ~valid).all(), "invalid ids disagree with the page intervals"
        assert int((state == _BS_ALLOCATED).sum()) == num_allocated, "num_allocated disagrees"
        assert len(held) == num_held == int((state == _BS_HELD).sum()), "held ids disagree"
        assert len(set(held)) == len(held) and all(state[b] == _BS_HELD for b in held), "held stack disagrees"
        assert int(owned.sum()) == num_owned, "num_owned disagrees"
        if inflight:        # allocs mapping pages without the lock hold used pages not adopted yet
            assert ((owned == 0) | (page_states == _PS_USED)).all(), "an owned page is not in use"
        else:
            assert ((owned != 0) == (page_states == _PS_USED)).all(), \
                "owned pages are not exactly the page allocator's used pages"
        total_free = 0
        for p in range(P):
            ids = state[first[p]:first[p] + count[p]]
            if owned[p]:
                free_ids = first[p] + np.flatnonzero(ids == _BS_FREE)
                assert stacks[p] == free_ids.tolist(), f"page {p}: free stack {stacks[p]} != free ids {free_ids.tolist()}"
                assert 0 <= pfree[p] < count[p], f"owned page {p} has {pfree[p]} of {count[p]} free (empty pages go back)"
                total_free += pfree[p]
            else:
                assert (ids == _BS_FREE).all(), f"page {p} is not owned (maybe unmapped) but holds live ids"
                assert pfree[p] == 0, f"page {p} not owned yet counted"
        assert total_free == partial_free, f"free in owned pages {total_free} != {partial_free}"
        self.pages.check_invariants()
        return True


# Note [Allocator locks]
# One pthread mutex per BlockAllocator guards all of its state; public methods take it, cdef
# workers assume it. It is only ever *waited on* with the GIL released (trylock first while holding
# the GIL, which is the uncontended case and costs ~20 ns), so a holder may take the GIL (budget
# gate, driver errors) without deadlock; a fast path that finds enough pages in the pool runs to
# the end with the GIL held and never calls the driver. An alloc that needs pages beyond the pool
# lets go of the lock while the page allocator waits for the refill, asks the budget gate and maps
# (tens of µs to ms): the pages it gets are its own (used, not yet adopted), so frees and
# pool-served allocs of other threads go on meanwhile. Back under the lock it checks that the
# pages still cover what it needs — frees may have made some unnecessary (given back at once),
# other allocs may have taken the free slots it counted on (then it gives the pages back and tries
# once more, and after that maps under the lock, so it cannot be overtaken for ever). try_to_reserve
# takes the same path, its ids turned held before the lock is let go. Lock order: BlockAllocator.lock -> PageAllocator.map_lock ->
# PageAllocator.lock -> Backend._lock; PageAllocator.lock is never held across a driver or Python
# call, so it may be waited on with the GIL held.
#
# Note [Block placement]
# alloc(n): held blocks (try_to_reserve) first. For the rest, r ids:
#  1. r <= free ids of the emptiest partially used page: best fit, the page with the fewest free
#     ids that still holds r (lowest non-empty bucket >= r), so large holes stay whole.
#  2. r <= all free ids in owned pages, but no page holds r: whole pages, emptiest first, until
#     the remainder fits one page, which is then best-fit. Emptiest first touches the fewest pages
#     and keeps a request's ids on few pages, so they empty together when it ends.
#  3. r > all free ids in owned pages: one take_blocks call for the missing ids (pool pages first,
#     then the lowest free page ids, mapped in one batch) before anything changes; on out of
#     memory alloc returns None, unchanged. Then every partially used page is filled and the new
#     pages are used in the order delivered: each but the last in full (take_blocks returns the
#     fewest pages that hold the missing ids).
# The buckets (Note [Free buckets] in freebuckets) make steps 1-2 bit scans per page touched
# (max_blocks_per_page / 64 words), so the whole is O(n + pages).
# Within a page, ids come off a stack of its free ids, lowest first on a fresh page.
#
# Note [try_to_reserve]
# try_to_reserve(n) allocates n blocks now, into a held stack, so their pages are mapped; the next
# alloc calls take held blocks first (no page work at all), free_reserved() frees whatever is still
# held, and available_blocks() counts them. Calls accumulate. Held ids are not the caller's:
# freeing one raises BlockStateError.
