# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, auto_pickle=False
"""kvcached.core.blockalloc: block ids over whole pages, the hot path's top layer.

BlockAllocator: free slots per page, best fit, a per-block allocated bit. It stands on
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
from cpython.ref cimport Py_INCREF, Py_XDECREF, PyObject

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

from kvcached.errors import BlockStateError, KVCachedConfigError, MappingError



# BlockAllocator: free slots per page, best fit, a per-block allocated bit. See Note [Block
# placement], Note [Allocator locks], Note [try_to_reserve], Note [Block id objects],
# Note [Bookkeeping memory], Note [Counts and ids past int32].

from cpython.list cimport PyList_New, PyList_GET_SIZE, PyList_GET_ITEM
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_CheckExact
from operator import index as _index

cdef extern from *:
    """
    static inline int kvc_ctz64(unsigned long long x) { return __builtin_ctzll(x); }
    static inline int kvc_clz64(unsigned long long x) { return __builtin_clzll(x); }
    /* Fill list[0..n) with the ints ids[0..n), reusing the allocator's id objects (see
       Note [Block id objects]); an id at or above cache_len gets a new int. -1 with
       MemoryError set when an int cannot be made (the list's remaining items stay NULL). */
    static inline int kvc_fill_id_list(PyObject* list, const int32_t* ids, Py_ssize_t n,
                                       PyObject** cache, int32_t cache_len) {
        for (Py_ssize_t i = 0; i < n; i++) {
            int32_t b = ids[i];
            PyObject* o;
            if (b < cache_len) {
                o = cache[b];
                if (o == NULL) {
                    o = PyLong_FromLong(b);
                    if (o == NULL) return -1;
                    cache[b] = o;
                }
                Py_INCREF(o);
            } else {
                o = PyLong_FromLong(b);
                if (o == NULL) return -1;
            }
            PyList_SET_ITEM(list, i, o);
        }
        return 0;
    }
    /* out[i] = list[i] for i = start, start + 1, ... while the item is an exact int in
       [0, max_id): returns the index of the first item that is not (n when none), for the
       caller's slow path (numpy ints, bad ids). Borrowed items, no exception set. */
    static inline Py_ssize_t kvc_ids_from_list(PyObject* list, Py_ssize_t start, Py_ssize_t n,
                                               int32_t* out, int32_t max_id) {
        for (Py_ssize_t i = start; i < n; i++) {
            PyObject* o = PyList_GET_ITEM(list, i);
            int overflow;
            long long v;
            if (!PyLong_CheckExact(o)) return i;
            v = PyLong_AsLongLongAndOverflow(o, &overflow);
            if (overflow || v < 0 || v >= max_id) return i;
            out[i] = (int32_t)v;
        }
        return n;
    }
    """
    int kvc_ctz64(unsigned long long x) noexcept nogil
    int kvc_clz64(unsigned long long x) noexcept nogil
    int kvc_fill_id_list(object lst, const int32_t* ids, Py_ssize_t n, PyObject** cache,
                         int32_t cache_len) except -1
    Py_ssize_t kvc_ids_from_list(object lst, Py_ssize_t start, Py_ssize_t n, int32_t* out,
                                 int32_t max_id) noexcept

cdef enum:
    _ID_CACHE_MAX = 1 << 22     # ids below this reuse one int object each; Note [Block id objects]

cdef enum:
    _STACK_IDS = 512     # requests up to this many ids use a stack buffer, not malloc


cdef object _int32_view_source(object buf):
    # numpy arrays and anything with the buffer protocol as they are; torch CPU tensors via .numpy()
    try:
        view = memoryview(buf)
    except TypeError:
        if hasattr(buf, "numpy"):
            return _int32_view_source(buf.numpy())
        raise
    if view.format.lstrip("@=<>!") == "?":      # other dtypes fail the int32 view (ValueError)
        raise TypeError("the id buffer holds bools, not block ids; pass a contiguous int32 buffer "
                        "(numpy.int32, torch.int32, array.array('i'))")
    return buf


cdef long long _count(object n, str what, int* overflow) except? -1:
    """A block count from an int-like n that is not an exact int (numpy and torch ints); bools
    and floats refused. Past int64 it sets overflow (the sign) as PyLong_AsLongLongAndOverflow
    does; see Note [Counts and ids past int32]."""
    if isinstance(n, bool) or getattr(n, "dtype", None) is not None and str(n.dtype) == "bool":
        raise TypeError(f"{what}(n={n!r}): n must be an integer count, not a bool")
    return PyLong_AsLongLongAndOverflow(_index(n), overflow)


cdef int32_t _block_id(object item, int32_t max_block_id) except -1:
    """A block id from an item kvc_ids_from_list left: an int-like that is not an exact int
    (numpy, torch ints) or one out of [0, max_block_id), of any size. Bools refused."""
    if isinstance(item, bool):
        raise TypeError(f"block id {item!r} is a bool, not a block id; nothing was freed.")
    v = _index(item)
    if not 0 <= v < max_block_id:
        raise BlockStateError(
            f"block id {v} is not a block id of this allocator (valid: [0, {max_block_id})); nothing was freed.")
    return <int32_t>v


cdef object _host_headroom():
    """(bytes, what) this process can still allocate, the least of the figures the system gives
    (See Note [Bookkeeping memory]); None when it gives none."""
    import os
    import resource
    figures = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    figures.append((int(line.split()[1]) * 1024, "the available physical memory (MemAvailable)"))
                    break
    except OSError:
        pass
    if not figures:
        try:
            figures.append((os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "the free physical memory"))
        except (ValueError, OSError):
            pass
    try:
        with open("/proc/self/cgroup") as f:
            path = next((line.strip()[3:] for line in f if line.startswith("0::")), None)
        if path is not None:
            base = "/sys/fs/cgroup" + path.rstrip("/")
            with open(base + "/memory.max") as f:
                top = f.read().strip()
            if top != "max":
                with open(base + "/memory.current") as f:
                    current = int(f.read())
                figures.append((int(top) - current, f"the cgroup's memory.max ({top} bytes, {current} in use)"))
    except (OSError, ValueError):
        pass
    try:
        with open("/proc/self/statm") as f:
            fields = f.read().split()
        in_use = {resource.RLIMIT_AS: int(fields[0]) * resource.getpagesize(),
                  resource.RLIMIT_DATA: int(fields[5]) * resource.getpagesize()}
    except (OSError, IndexError, ValueError):
        in_use = {}
    for limit, name in ((resource.RLIMIT_AS, "RLIMIT_AS"), (resource.RLIMIT_DATA, "RLIMIT_DATA")):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY and limit in in_use:
            figures.append((soft - in_use[limit], f"the {name} limit ({soft} bytes, {in_use[limit]} in use)"))
    return min(figures) if figures else None


cdef class BlockAllocator:
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

        Host memory: its arrays only, ~9 bytes per block id (Note [Bookkeeping memory]); the
        checks and the set-up are O(pages) beyond them.

        Raises KVCachedConfigError when the arrays have the wrong length, an interval is
        negative or past max_block_id, a block of page p's interval maps to another page, the
        arrays would not fit in the host memory the process can still allocate (checked before
        any is allocated), or the page allocator already serves another BlockAllocator."""
        import numpy as np
        cdef int P = pages.num_table_pages
        cdef int p, i
        cdef int64_t base = 0
        first = np.asarray(page_first_block, dtype=np.int64).reshape(-1)
        count = np.asarray(page_num_blocks, dtype=np.int64).reshape(-1)
        if first.size != P or count.size != P:
            raise KVCachedConfigError(
                f"page_first_block / page_num_blocks have {first.size} / {count.size} entries; the page "
                f"table has {P} page ids: give one entry per page id.")
        if id_to_page_num < 1 or id_to_page_den < 1:
            raise KVCachedConfigError(
                f"id_to_page_num={id_to_page_num}, id_to_page_den={id_to_page_den} must both be >= 1 "
                f"(dense layouts: block_bytes, page_bytes; sparse ids: 1, ids_per_page).")
        if not 0 <= max_block_id < (1 << 31):
            raise KVCachedConfigError(f"max_block_id={max_block_id} must be in [0, 2**31)")
        if (count < 0).any():
            bad = int(np.flatnonzero(count < 0)[0])
            raise KVCachedConfigError(f"page {bad} has page_num_blocks={int(count[bad])} < 0")
        used = count > 0
        if ((first < 0) | (first + count > max_block_id))[used].any():
            bad = int(np.flatnonzero(used & ((first < 0) | (first + count > max_block_id)))[0])
            raise KVCachedConfigError(
                f"page {bad}'s ids [{int(first[bad])}, {int(first[bad] + count[bad])}) fall outside [0, {max_block_id})")
        # b * num // den never decreases with b, so an interval maps to its page when both of
        # its ends do: O(pages), where one entry per block cost ~32 bytes (Note [Bookkeeping memory])
        lo = np.where(used, first, 0)
        hi = np.where(used, first + count - 1, 0)
        if used.any() and max(int(hi.max()), 1) * id_to_page_num >= (1 << 62):
            raise KVCachedConfigError("block_id * id_to_page_num overflows 62 bits; reduce the ratio")
        page_ids = np.arange(P, dtype=np.int64)
        bad_lo = used & (lo * id_to_page_num // id_to_page_den != page_ids)
        bad_hi = used & (hi * id_to_page_num // id_to_page_den != page_ids)
        if (bad_lo | bad_hi).any():
            p = int(np.flatnonzero(bad_lo | bad_hi)[0])
            b = int(lo[p] if bad_lo[p] else hi[p])
            raise KVCachedConfigError(
                f"block {b} is in page {p}'s interval but maps to page {b * id_to_page_num // id_to_page_den} "
                f"by ({b} * {id_to_page_num}) // {id_to_page_den}: the intervals and the ratio disagree.")
        total = int(count.sum())
        most_per_page = int(count.max()) if P else 0
        id_cache = min(max_block_id, _ID_CACHE_MAX)
        needed = (P * (3 * sizeof(int32_t) + sizeof(int64_t) + 3 * sizeof(uint8_t) + 3 * sizeof(int32_t))
                  + max_block_id * sizeof(uint8_t) + 2 * total * sizeof(int32_t)
                  + (most_per_page + 1) * sizeof(int32_t) + (most_per_page + 64) // 64 * sizeof(uint64_t)
                  + id_cache * sizeof(PyObject*))
        headroom = _host_headroom()
        if headroom is not None and needed > headroom[0]:
            raise KVCachedConfigError(
                f"{total} blocks (ids below {max_block_id}, {P} pages) need {needed} bytes "
                f"({needed / (1 << 30):.1f} GiB) of host memory for the block allocator's bookkeeping (9 bytes per block id, 8 more per id below "
                f"{_ID_CACHE_MAX}), but {max(0, headroom[0])} bytes are left under {headroom[1]}: ask for fewer blocks "
                f"(num_blocks), or give the process more memory.")
        self.pages = pages
        self.num_pages = P
        self.max_block_id = <int32_t>max_block_id
        self.id_to_page_num = id_to_page_num
        self.id_to_page_den = id_to_page_den
        self.total_blocks = total
        self.max_blocks_per_page = most_per_page
        self.page_first = <int32_t*>calloc(P, sizeof(int32_t))
        self.page_blocks = <int32_t*>calloc(P, sizeof(int32_t))
        self.slot_base = <int64_t*>calloc(P, sizeof(int64_t))
        self.slots = <int32_t*>malloc(max(1, self.total_blocks) * sizeof(int32_t))
        self.page_free = <int32_t*>calloc(P, sizeof(int32_t))
        self.page_owned = <uint8_t*>calloc(P, sizeof(uint8_t))
        self.page_mark = <uint8_t*>calloc(max(1, P), sizeof(uint8_t))
        self.block_state = <uint8_t*>malloc(max(1, max_block_id) * sizeof(uint8_t))
        self.bucket_head = <int32_t*>malloc((self.max_blocks_per_page + 1) * sizeof(int32_t))
        self.page_next = <int32_t*>malloc(P * sizeof(int32_t))
        self.page_prev = <int32_t*>malloc(P * sizeof(int32_t))
        self.bucket_words = (self.max_blocks_per_page + 1 + 63) // 64
        self.bucket_bits = <uint64_t*>calloc(self.bucket_words, sizeof(uint64_t))
        self.held = <int32_t*>malloc(max(1, self.total_blocks) * sizeof(int32_t))
        self.page_buf = <int32_t*>malloc(max(1, P) * sizeof(int32_t))
        self.id_objs_len = <int32_t>min(max_block_id, _ID_CACHE_MAX)
        self.id_objs = <PyObject**>calloc(max(1, self.id_objs_len), sizeof(PyObject*))
        self.page_adopted = <uint8_t*>calloc(max(1, P), sizeof(uint8_t))
        if (self.page_first == NULL or self.page_blocks == NULL or self.slot_base == NULL or self.slots == NULL
                or self.page_free == NULL or self.page_owned == NULL or self.page_mark == NULL or self.block_state == NULL
                or self.bucket_head == NULL or self.page_next == NULL or self.page_prev == NULL
                or self.bucket_bits == NULL or self.held == NULL or self.page_buf == NULL
                or self.id_objs == NULL or self.page_adopted == NULL):
            raise MemoryError("no memory for the block allocator")
        memset(self.block_state, _BS_INVALID, max_block_id)
        for i in range(self.max_blocks_per_page + 1):
            self.bucket_head[i] = -1
        weights = np.ascontiguousarray(count, dtype=np.int32)
        cdef int32_t[::1] w = weights
        for p in range(P):
            self.page_first[p] = <int32_t>first[p] if count[p] > 0 else 0
            self.page_blocks[p] = w[p]
            self.slot_base[p] = base
            base += w[p]
            memset(self.block_state + self.page_first[p], _BS_FREE, w[p])
            if self.page_first[p] < self.id_objs_len:     # touched now, not by an alloc: Note [Block id objects]
                memset(self.id_objs + self.page_first[p], 0,
                       min(w[p], self.id_objs_len - self.page_first[p]) * sizeof(PyObject*))
            self.page_next[p] = -1
            self.page_prev[p] = -1
        from kvcached.config import settings
        self.debug_checks = settings().debug_checks
        if P:
            pages._bind_weights(&w[0])

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
        free(self.page_adopted)
        free(self.page_first)
        free(self.page_blocks)
        free(self.slot_base)
        free(self.slots)
        free(self.page_free)
        free(self.page_owned)
        free(self.page_mark)
        free(self.block_state)
        free(self.bucket_head)
        free(self.page_next)
        free(self.page_prev)
        free(self.bucket_bits)
        free(self.held)
        free(self.page_buf)
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

    # -- buckets of partially used pages, by free count (under lock) -------------------------
    cdef void _bucket_insert(self, int32_t page_id, int count) noexcept nogil:
        cdef int32_t head = self.bucket_head[count]
        self.page_prev[page_id] = -1
        self.page_next[page_id] = head
        if head >= 0:
            self.page_prev[head] = page_id
        self.bucket_head[count] = page_id
        self.bucket_bits[count >> 6] |= (<uint64_t>1) << (count & 63)

    cdef void _bucket_remove(self, int32_t page_id, int count) noexcept nogil:
        cdef int32_t prev = self.page_prev[page_id], nxt = self.page_next[page_id]
        if prev >= 0:
            self.page_next[prev] = nxt
        else:
            self.bucket_head[count] = nxt
            if nxt < 0:
                self.bucket_bits[count >> 6] &= ~((<uint64_t>1) << (count & 63))
        if nxt >= 0:
            self.page_prev[nxt] = prev
        self.page_prev[page_id] = -1
        self.page_next[page_id] = -1

    cdef int _bucket_at_least(self, int count) noexcept nogil:
        """The smallest non-empty bucket >= count, or -1."""
        cdef int w = count >> 6
        cdef uint64_t bits
        if w >= self.bucket_words:
            return -1
        bits = self.bucket_bits[w] & ((~(<uint64_t>0)) << (count & 63))
        while True:
            if bits:
                return (w << 6) + kvc_ctz64(bits)
            w += 1
            if w >= self.bucket_words:
                return -1
            bits = self.bucket_bits[w]

    cdef int _bucket_highest(self) noexcept nogil:
        """The largest non-empty bucket (the emptiest partially used page's free count), or -1."""
        cdef int w = self.bucket_words - 1
        while w >= 0:
            if self.bucket_bits[w]:
                return (w << 6) + 63 - kvc_clz64(self.bucket_bits[w])
            w -= 1
        return -1

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
        self._bucket_insert(page_id, c)

    cdef int _take_from(self, int32_t page_id, int k, int32_t* out) noexcept nogil:
        # k ids off the page's free stack (k <= its free count); re-bucket it
        cdef int i, f = self.page_free[page_id]
        cdef int32_t* stack = self.slots + self.slot_base[page_id]
        cdef int32_t b
        self._bucket_remove(page_id, f)
        for i in range(k):
            b = stack[f - 1 - i]
            out[i] = b
            self.block_state[b] = _BS_ALLOCATED
        f -= k
        self.page_free[page_id] = f
        self.partial_free -= k
        if f > 0:
            self._bucket_insert(page_id, f)
        return k

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
                    return _OOM
            elif self.pages.take_pool(r - self.partial_free, True, self.page_buf, &np_new) != 0:
                return _NEED_SLOW
        self._place(n, h, np_new, out)          # nothing can fail from here on
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
                f = self._bucket_highest()
                if f <= 0:
                    break
                pos += self._take_from(self.bucket_head[f], f, out + pos)
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
                f = self._bucket_highest()
                if rem <= f:
                    f = self._bucket_at_least(<int>rem)
                    pos += self._take_from(self.bucket_head[f], <int>rem, out + pos)
                    rem = 0
                else:
                    pos += self._take_from(self.bucket_head[f], f, out + pos)
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
                        self._bucket_remove(p, f)
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
                self._bucket_insert(p, f)
        self.num_allocated -= n
        self.num_frees += 1
        n_empty[0] = ne
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

    cdef int _hold(self, int n, const int32_t* ids) noexcept nogil:
        # try_to_reserve: the ids just allocated become held (under lock)
        cdef int i
        for i in range(n):
            self.block_state[ids[i]] = _BS_HELD
            self.held[self.num_held] = ids[i]
            self.num_held += 1
        self.num_allocated -= n
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

    # -- Python surface -------------------------------------------------------------------------
    def alloc(self, n):
        """Exactly `n` distinct block ids (a list of int), or None when the pages cannot be
        had (out of memory, limit, capacity) — never a partial result; state unchanged on None.

        Cost: O(n + pages touched); the pool fast path makes no driver call and keeps the GIL.
        An n above total_blocks, of any size, is None at once (Note [Counts and ids past int32]).
        Raises ValueError for n < 0, TypeError for an n that is not an integer (1.5, True)."""
        cdef int32_t stack_ids[_STACK_IDS]
        cdef int32_t* out = stack_ids
        cdef int rc, i
        cdef long long count
        self._check_live()
        count = self._checked_count(n, "alloc")
        if count <= 0:
            return [] if count == 0 else None
        if count > _STACK_IDS:
            out = <int32_t*>malloc(count * sizeof(int32_t))
            if out == NULL:
                raise MemoryError
        try:
            rc = self._run_alloc(count, out, True)
            if rc != 0:
                return None
            result = PyList_New(count)
            try:
                kvc_fill_id_list(result, out, count, self.id_objs, self.id_objs_len)
            except MemoryError:
                self._run_free(count, out)          # never a partial result: give the ids back
                raise
            if self.debug_checks:
                self.check_invariants()
            return result
        finally:
            if out != stack_ids:
                free(out)

    def alloc_into(self, buf) -> bool:
        """Fill a caller's contiguous int32 buffer (numpy array, CPU tensor, array.array) with
        len(buf) distinct ids: True, or False with nothing changed (buffer contents undefined)."""
        self._check_live()
        cdef int32_t[::1] view = _int32_view_source(buf)
        cdef int n = <int>view.shape[0]
        if n == 0:
            return True
        return self._run_alloc(n, &view[0], True) == 0

    def free(self, ids):
        """Free the given ids (any iterable of int). Raises BlockStateError — with nothing freed —
        for an id that is unknown, not allocated, or repeated. Pages that become empty go back
        to the page allocator (pool, or unmapped after their fence). O(len(ids))."""
        cdef int32_t stack_ids[_STACK_IDS]
        cdef int32_t* buf = stack_ids
        cdef Py_ssize_t n, i
        self._check_live()
        if not isinstance(ids, list):
            ids = list(ids)
        n = PyList_GET_SIZE(ids)
        if n == 0:
            return
        if n > _STACK_IDS:
            buf = <int32_t*>malloc(n * sizeof(int32_t))
            if buf == NULL:
                raise MemoryError
        try:
            # exact ints in range in one C loop; the others one by one (numpy ints, or raise)
            i = kvc_ids_from_list(ids, 0, n, buf, self.max_block_id)
            while i < n:
                buf[i] = _block_id(<object>PyList_GET_ITEM(ids, i), self.max_block_id)
                i = kvc_ids_from_list(ids, i + 1, n, buf, self.max_block_id)
            self._run_free(<int>n, buf)
            if self.debug_checks:
                self.check_invariants()
        finally:
            if buf != stack_ids:
                free(buf)

    def free_from(self, buf):
        """free() for a contiguous int32 buffer (numpy array, CPU tensor), without Python ints."""
        self._check_live()
        cdef const int32_t[::1] view = _int32_view_source(buf)
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

    cdef long long _checked_count(self, object n, str what) except -2:
        # alloc's and try_to_reserve's count: n in [0, total_blocks]; -1 for one above it, of any
        # size (a failed alloc, counted, nothing else changed: the caller answers None / False);
        # raises ValueError for a negative one. See Note [Counts and ids past int32].
        cdef int overflow = 0
        cdef long long count = PyLong_AsLongLongAndOverflow(n, &overflow) if PyLong_CheckExact(n) \
            else _count(n, what, &overflow)
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

    @property
    def num_free_in_owned_pages(self) -> int:
        return self.partial_free

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
                "num_failed_allocs": self.num_failed_allocs, "pages": self.pages.stats(),
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
        cdef int P = self.num_pages, p, f
        cdef int32_t q
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
            buckets = {}
            for f in range(1, self.max_blocks_per_page + 1):
                members = []
                q = self.bucket_head[f]
                while q >= 0:
                    members.append(q)
                    assert len(members) <= P, f"bucket {f} loops"
                    q = self.page_next[q]
                bit = (self.bucket_bits[f >> 6] >> (f & 63)) & 1
                assert bool(bit) == bool(members), f"bucket {f}: bit {bit}, members {members}"
                buckets[f] = members
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
        in_bucket = {}
        for f, members in buckets.items():
            for q in members:
                assert q not in in_bucket, f"page {q} in two buckets"
                in_bucket[q] = f
        total_free = 0
        for p in range(P):
            ids = state[first[p]:first[p] + count[p]]
            if owned[p]:
                free_ids = first[p] + np.flatnonzero(ids == _BS_FREE)
                assert stacks[p] == free_ids.tolist(), f"page {p}: free stack {stacks[p]} != free ids {free_ids.tolist()}"
                assert 0 <= pfree[p] < count[p], f"owned page {p} has {pfree[p]} of {count[p]} free (empty pages go back)"
                assert in_bucket.get(p, 0) == pfree[p], f"page {p} with {pfree[p]} free is in bucket {in_bucket.get(p)}"
                total_free += pfree[p]
            else:
                assert (ids == _BS_FREE).all(), f"page {p} is not owned (maybe unmapped) but holds live ids"
                assert pfree[p] == 0 and p not in in_bucket, f"page {p} not owned yet counted"
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
# Buckets are doubly linked lists per free count plus a bitmap of non-empty ones, so steps 1-2 are
# O(1) bit scans per page touched (max_blocks_per_page / 64 words) and the whole is O(n + pages).
# Within a page, ids come off a stack of its free ids, lowest first on a fresh page.
#
# Note [try_to_reserve]
# try_to_reserve(n) allocates n blocks now, into a held stack, so their pages are mapped; the next
# alloc calls take held blocks first (no page work at all), free_reserved() frees whatever is still
# held, and available_blocks() counts them. Calls accumulate. Held ids are not the caller's:
# freeing one raises BlockStateError.
#
# Note [Block id objects]
# alloc returns a list of Python ints, and above 256 each new int is a heap object: making and
# later destroying them cost ~15 ns each, 4 of the ~6.5 us of alloc(256)+free on the CPU machine,
# more than all the bookkeeping. So the allocator keeps one int object per block id below
# _ID_CACHE_MAX, made the first time the id is handed out, and hands out new references to it:
# ints are immutable, so sharing them is invisible to callers (only `is` could tell). The table
# is calloc'ed (untouched parts cost no memory); what is used costs 8 bytes of pointer and one
# 32-byte int per id ever handed out (2.5 MB for 64K blocks), released with the allocator. Only
# pages ever adopted can hold cached ids, so __dealloc__ walks just those. Filled and read with
# the GIL held (alloc builds its list with it), so no lock is needed.
# The entries of every id a page can hand out are written once at construction, so that the
# memory behind them is faulted in then: a page fault in alloc waits behind the refill thread's
# driver calls, which hold the process's address-space lock (on the H200, every 4th alloc(16)
# of the page-grouped ramp took 10-25 µs, its ids being 4096 apart, one fresh OS page per page
# id). Sparse ids touch one OS page per page id below _ID_CACHE_MAX (at most 4 MiB).
#
# Note [Bookkeeping memory]
# The allocator's host memory is its arrays: per block id one state byte (max_block_id of them,
# written at construction), per usable block 4 bytes of free stack and 4 of held stack (allocated
# up front but only touched as pages are adopted and blocks held), 8 bytes of id-object table per
# id below _ID_CACHE_MAX (written at construction, Note [Block id objects]), and ~35 bytes per
# page. The constructor's checks used numpy arrays of one int64 per block — ~32 bytes per block
# at their peak — so KVCacheManager(10**9, ...) asked for ~32 GB and was killed by the OOM killer
# without a word; they now look at each page's first and last id only (b * num // den never
# decreases with b), O(pages). Before allocating, the constructor compares the arrays' total with
# what the process can still allocate: the kernel's MemAvailable, the cgroup's memory.max less
# its use, and the RLIMIT_AS / RLIMIT_DATA soft limits less the process's size, and refuses with
# the figures (KVCachedConfigError) rather than die midway. The whole total is compared, touched
# or not: what is reserved counts against the limits now and is touched as the cache fills.
#
# Note [Counts and ids past int32]
# Counts arrive as Python ints of any size. alloc and try_to_reserve read them with
# PyLong_AsLongLongAndOverflow (one call, no exception on the way) and compare with total_blocks
# before sizing anything by them: a count above it, up to 2**64 and past, can never be served, so
# it is the contract's "more than is available" — None / False at once, counted as a failed
# alloc, nothing else changed — where a C int argument raised a bare OverflowError and a count
# just below 2**31 had a buffer of 4 bytes per id malloc'ed first. Negative counts of any size
# raise ValueError naming n. free converts a list of exact ints in range in one C loop
# (kvc_ids_from_list, borrowed items, no reference counting), leaving numpy ints and ids out of
# range, of any size, to _block_id, which raises BlockStateError naming the id.
