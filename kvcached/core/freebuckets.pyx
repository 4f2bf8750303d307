# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, auto_pickle=False
"""kvcached.core.freebuckets: pages filed by how many free ids they hold (Note [Free buckets]).

The block allocator files each partially used page under its free count, so that best fit ("the
page with the fewest free ids that still holds r") and "the emptiest page" are a bit scan. The
operations are ``cdef inline`` in freebuckets.pxd (the hot path pays no call); this module holds
what is not hot: making and freeing the struct, its invariant check, and PageBuckets, the struct
with a Python surface whose every call checks its arguments (for tests and tools).
"""

from libc.stdint cimport int32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc


cdef int buckets_init(FreeBuckets* b, int num_pages, int max_count) noexcept nogil:
    cdef int i
    b.num_pages = num_pages
    b.max_count = max_count
    b.words = (max_count + 1 + 63) // 64
    b.head = <int32_t*>malloc((max_count + 1) * sizeof(int32_t))
    b.next = <int32_t*>malloc(max(1, num_pages) * sizeof(int32_t))
    b.prev = <int32_t*>malloc(max(1, num_pages) * sizeof(int32_t))
    b.bits = <uint64_t*>calloc(b.words, sizeof(uint64_t))
    if b.head == NULL or b.next == NULL or b.prev == NULL or b.bits == NULL:
        buckets_free(b)
        return -1
    for i in range(max_count + 1):
        b.head[i] = -1
    for i in range(num_pages):
        b.next[i] = -1
        b.prev[i] = -1
    return 0


cdef void buckets_free(FreeBuckets* b) noexcept nogil:
    free(b.head)
    free(b.next)
    free(b.prev)
    free(b.bits)
    b.head = b.next = b.prev = NULL
    b.bits = NULL


cdef int buckets_check(const FreeBuckets* b, const int32_t* counts) except -1:
    """Every bucket a well-linked list whose bit says whether it is empty; page p in bucket
    counts[p] when counts[p] > 0 and in none otherwise (its links -1). O(pages + max_count)."""
    cdef int f, steps, p
    cdef int32_t q, before
    seen = {}
    for f in range(b.max_count + 1):
        q, before, steps = b.head[f], -1, 0
        while q >= 0:
            assert q < b.num_pages, f"bucket {f} links to page {q}, past the {b.num_pages} pages"
            assert q not in seen, f"page {q} is in bucket {f} and in bucket {seen.get(q)} (or twice in one)"
            assert b.prev[q] == before, f"bucket {f}: page {q} links back to {b.prev[q]}, not {before}"
            assert counts[q] == f, f"page {q} with {counts[q]} free ids is in bucket {f}"
            seen[q] = f
            before, q = q, b.next[q]
            steps += 1
        bit = (b.bits[f >> 6] >> (f & 63)) & 1
        assert bit == (steps > 0), f"bucket {f} holds {steps} pages but its bit is {bit}"
    for f in range(b.max_count + 1, b.words * 64):
        assert not (b.bits[f >> 6] >> (f & 63)) & 1, f"bit {f} is set, past the last bucket {b.max_count}"
    for p in range(b.num_pages):
        if p not in seen:
            assert counts[p] <= 0, f"page {p} with {counts[p]} free ids is in no bucket"
            assert b.next[p] == -1 and b.prev[p] == -1, f"page {p} is in no bucket but links to {b.prev[p]} / {b.next[p]}"
    return 0


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


# Note [Free buckets]
# A heap or a sorted list of pages by free count costs O(log pages) per change and a search for
# best fit; the free counts are small integers (at most the blocks of a page), so each count gets
# its own doubly linked list of pages (insert and remove O(1), no search) and a bitmap says which
# lists are non-empty: best fit is the lowest set bit at or above r, the emptiest page the highest
# set bit, both O(max_count / 64) word scans (one word up to 63 blocks per page). A page with no
# free id (full) or not taken is in no list. The struct is the owner's: the block allocator
# changes it under its lock and checks it against its per-page free counts.
