# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, auto_pickle=False
"""kvcached.core._probes: test hooks for the core's C structs, apart from the production modules.

The page allocator's sets (pagesets: FreeSet, PoolStack, PendingRing, PageLedger) and the block
allocator's FreeBuckets are C structs with inline operations, invisible to Python. The functions
and the class here drive one of them at a time from Python, so that tests can run seeded random
operations against a model and corrupt a field to see its check fail, without an allocator.
Nothing in the package imports this module.
"""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free

from kvcached.core.freebuckets cimport (
    FreeBuckets, buckets_at_least, buckets_check, buckets_free, buckets_highest, buckets_init, buckets_insert,
    buckets_remove,
)
from kvcached.core.pagesets cimport (
    _PS_FREE, _PS_USED, FreeSet, PageLedger, PendingRing, PoolStack, freeset_check, freeset_count_for_weight,
    freeset_members, freeset_pop_lowest, freeset_update, freeset_weight_of_lowest, ledger_check, ledger_init,
    ledger_release, pending_check, pending_copy, pending_oldest_fence, pending_pop, pending_push, pending_retry,
    pending_take_retries, pool_check, pool_drop, pool_pop, pool_push,
)


# -- the page allocator's sets: one operation on a set held in plain numpy arrays -----------------
# Each set's fields live in a dict of numpy arrays and ints, made by its new_* function; a step
# builds the C struct over them, runs `op`, and writes the ints back. Corrupt a field of the dict
# and "check" must raise. Nothing in the allocator calls them.

cdef int _raise_unless_ok(int rc, const char* msg) except -1:
    if rc != 0:
        raise AssertionError((<bytes>msg).decode())
    return 0


def new_free_set(weight) -> dict:
    """An empty free set over len(weight) > 0 ids of these weights."""
    import numpy as np
    size = len(weight)
    return {"count": np.zeros(size + 1, np.int32), "weight_sum": np.zeros(size + 1, np.int64),
            "weight": np.array(weight, np.int32), "size": size, "top": 1 << (size.bit_length() - 1), "num": 0}


def free_set_step(dict f, str op, int64_t arg=0):
    """op: "add" / "remove" id, "pop_lowest", "count_for_weight" need, "weight_of_lowest" k,
    "members" (a uint8 array), "check" (raises AssertionError)."""
    import numpy as np
    cdef int32_t[::1] count = f["count"], weight = f["weight"]
    cdef int64_t[::1] weight_sum = f["weight_sum"]
    cdef uint8_t[::1] members
    cdef FreeSet s
    cdef char msg[256]
    s.count, s.weight_sum, s.weight = &count[0], &weight_sum[0], &weight[0]
    s.size, s.top, s.num = f["size"], f["top"], f["num"]
    out = None
    if op == "add" or op == "remove":
        freeset_update(&s, <int32_t>arg, 1 if op == "add" else -1)
    elif op == "pop_lowest":
        out = freeset_pop_lowest(&s)
    elif op == "count_for_weight":
        out = freeset_count_for_weight(&s, arg)
    elif op == "weight_of_lowest":
        out = freeset_weight_of_lowest(&s, <int>arg)
    elif op == "members":
        out = np.zeros(s.size, np.uint8)
        members = out
        freeset_members(&s, &members[0])
    elif op == "check":
        _raise_unless_ok(freeset_check(&s, msg, sizeof(msg)), msg)
    else:
        raise ValueError(f"unknown free set op {op!r}; use add, remove, pop_lowest, count_for_weight, "
                         f"weight_of_lowest, members or check")
    f["num"] = s.num
    return out


def new_pool(weight) -> dict:
    """An empty pool over len(weight) > 0 ids of these weights."""
    import numpy as np
    return {"ids": np.zeros(len(weight), np.int32), "weight": np.array(weight, np.int32), "num": 0, "weight_sum": 0}


def pool_step(dict f, str op, int64_t arg=0, int64_t keep=0):
    """op: "push" id, "pop" (the id), "drop" below keep (the ids dropped), "check" (raises
    AssertionError)."""
    cdef int32_t[::1] ids = f["ids"], weight = f["weight"]
    cdef int32_t[::1] dropped
    cdef PoolStack s
    cdef char msg[256]
    cdef int n
    s.ids, s.weight, s.num, s.weight_sum = &ids[0], &weight[0], f["num"], f["weight_sum"]
    out = None
    if op == "push":
        pool_push(&s, <int32_t>arg)
    elif op == "pop":
        out = pool_pop(&s)
    elif op == "drop":
        import numpy as np
        buf = np.zeros(ids.shape[0], np.int32)
        dropped = buf
        n = pool_drop(&s, <int>arg, <int>keep, &dropped[0])
        out = buf[:n].tolist()
    elif op == "check":
        _raise_unless_ok(pool_check(&s, <int>ids.shape[0], msg, sizeof(msg)), msg)
    else:
        raise ValueError(f"unknown pool op {op!r}; use push, pop, drop or check")
    f["num"], f["weight_sum"] = s.num, s.weight_sum
    return out


def new_pending_ring(int size) -> dict:
    """An empty pending ring for ids [0, size), size > 0."""
    import numpy as np
    return {"ids": np.zeros(size, np.int32), "fence": np.zeros(size, np.uint64), "count": np.zeros(size, np.int32),
            "retry": np.zeros(size, np.int32), "size": size,
            "head": 0, "num_fenced": 0, "batch_head": 0, "num_batches": 0, "num_retry": 0}


_RING_INTS = ("head", "num_fenced", "batch_head", "num_batches", "num_retry")


def pending_step(dict f, str op, ids=(), uint64_t fence=0):
    """op: "push" ids behind fence, "pop" (the oldest batch: fence, ids), "retry" ids,
    "take_retries" (the ids), "copy" (every pending id), "check" (raises AssertionError)."""
    import numpy as np
    cdef int32_t[::1] ring_ids = f["ids"], count = f["count"], retry = f["retry"]
    cdef uint64_t[::1] fences = f["fence"]
    cdef int32_t[::1] buf = np.array(list(ids) + [0] * f["size"], np.int32)
    cdef PendingRing r
    cdef char msg[256]
    cdef int i, n
    r.ids, r.count, r.retry, r.fence = &ring_ids[0], &count[0], &retry[0], <uintptr_t*>&fences[0]
    r.size = f["size"]
    r.head, r.num_fenced, r.batch_head, r.num_batches, r.num_retry = (f[k] for k in _RING_INTS)
    out = None
    if op == "push":
        pending_push(&r, len(ids), &buf[0], fence)
    elif op == "pop":
        out = pending_oldest_fence(&r)
        n = pending_pop(&r, &buf[0])
        out = (out, [buf[i] for i in range(n)])
    elif op == "retry":
        for i in range(len(ids)):
            pending_retry(&r, buf[i])
    elif op == "take_retries" or op == "copy":
        n = pending_take_retries(&r, &buf[0]) if op == "take_retries" else pending_copy(&r, &buf[0])
        out = [buf[i] for i in range(n)]
    elif op == "check":
        _raise_unless_ok(pending_check(&r, msg, sizeof(msg)), msg)
    else:
        raise ValueError(f"unknown pending ring op {op!r}; use push, pop, retry, take_retries, copy or check")
    for k, v in zip(_RING_INTS, (r.head, r.num_fenced, r.batch_head, r.num_batches, r.num_retry)):
        f[k] = v
    return out


def ledger_check_step(state, weight, int capacity, mapped, pool_ids=(), pending_ids=(), num_used=None,
                      int num_transit=0):
    """Build a ledger over these per-id arrays — the free set from the free states, the pool and
    one pending batch from the ids given, num_used (default: the used states) — and run its
    check, which raises AssertionError naming the first broken invariant."""
    import numpy as np
    cdef uint8_t[::1] st = np.ascontiguousarray(state, np.uint8), mp = np.ascontiguousarray(mapped, np.uint8)
    cdef int32_t[::1] w = np.ascontiguousarray(weight, np.int32)
    cdef int32_t[::1] pend = np.array(list(pending_ids) + [0], np.int32)
    cdef PageLedger L
    cdef char msg[256]
    cdef int p, n = st.shape[0], rc
    if ledger_init(&L, n, capacity, n) != 0:
        ledger_release(&L)
        raise MemoryError
    try:
        for p in range(n):
            if L.state[p] == _PS_FREE:
                freeset_update(&L.free_set, p, -1)
            L.weight[p] = w[p]
            L.state[p] = st[p]
            if st[p] == _PS_FREE:
                freeset_update(&L.free_set, p, 1)
        for p in pool_ids:
            pool_push(&L.pool, p)
        if len(pending_ids):
            pending_push(&L.pending, len(pending_ids), &pend[0], 0)
        L.num_used = int((np.asarray(st) == _PS_USED).sum()) if num_used is None else num_used
        L.num_transit = num_transit
        rc = ledger_check(&L, &mp[0], int((np.asarray(mp) != 0).sum()), msg, sizeof(msg))
    finally:
        ledger_release(&L)
    _raise_unless_ok(rc, msg)


# -- the block allocator's free buckets ---------------------------------------------------------

cdef class PageBuckets:
    """FreeBuckets with a Python surface: each page filed under a count in [1, max_count] or
    in no bucket. Bad arguments raise ValueError naming them, nothing changed."""

    cdef FreeBuckets b
    cdef int32_t* counts                # [page] the bucket it is filed under; 0 none

    def __init__(self, int num_pages, int max_count):
        if num_pages < 0 or max_count < 1:
            raise ValueError(f"num_pages={num_pages} must be >= 0 and max_count={max_count} >= 1")
        buckets_free(&self.b)
        free(self.counts)
        self.counts = <int32_t*>calloc(max(1, num_pages), sizeof(int32_t))
        if self.counts == NULL or buckets_init(&self.b, num_pages, max_count) != 0:
            raise MemoryError(f"no memory for {num_pages} pages in {max_count} buckets")

    def __dealloc__(self):
        buckets_free(&self.b)
        free(self.counts)

    cdef int _page(self, int page_id) except -1:
        if not 0 <= page_id < self.b.num_pages:
            raise ValueError(f"page id {page_id} is out of range [0, {self.b.num_pages})")
        return 0

    def insert(self, int page_id, int count):
        """File page_id, in no bucket now, under count (1..max_count)."""
        self._page(page_id)
        if not 1 <= count <= self.b.max_count:
            raise ValueError(f"count {count} is out of range [1, {self.b.max_count}]")
        if self.counts[page_id]:
            raise ValueError(f"page {page_id} is in bucket {self.counts[page_id]} already; remove it first")
        buckets_insert(&self.b, page_id, count)
        self.counts[page_id] = count

    def remove(self, int page_id):
        """Take page_id out of its bucket."""
        self._page(page_id)
        if not self.counts[page_id]:
            raise ValueError(f"page {page_id} is in no bucket")
        buckets_remove(&self.b, page_id, self.counts[page_id])
        self.counts[page_id] = 0

    def at_least(self, int count) -> int:
        """The lowest non-empty bucket >= count (count >= 0), or -1."""
        if count < 0:
            raise ValueError(f"count {count} must be >= 0")
        return buckets_at_least(&self.b, count)

    def highest(self) -> int:
        """The highest non-empty bucket, or -1."""
        return buckets_highest(&self.b)

    def first(self, int count) -> int:
        """The first page of bucket `count` (the one filed last), or -1."""
        if not 0 <= count <= self.b.max_count:
            raise ValueError(f"count {count} is out of range [0, {self.b.max_count}]")
        return self.b.head[count]

    def check_invariants(self, counts=None):
        """buckets_check against the counts this object filed, or against `counts` (one per
        page, 0 for none) when given. Raises AssertionError naming the first disagreement."""
        cdef int32_t[::1] given
        if counts is None:
            return buckets_check(&self.b, self.counts) == 0
        import numpy as np
        arr = np.ascontiguousarray(counts, dtype=np.int32)
        if arr.shape != (self.b.num_pages,):
            raise ValueError(f"counts has shape {arr.shape}; give one count per page ({self.b.num_pages})")
        given = arr
        return buckets_check(&self.b, &given[0] if self.b.num_pages else self.counts) == 0
