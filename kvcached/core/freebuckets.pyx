# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, auto_pickle=False
"""kvcached.core.freebuckets: pages filed by how many free ids they hold (Note [Free buckets]).

The block allocator files each partially used page under its free count, so that best fit ("the
page with the fewest free ids that still holds r") and "the emptiest page" are a bit scan. The
operations are ``cdef inline`` in freebuckets.pxd (the hot path pays no call); this module holds
what is not hot: making and freeing the struct and its invariant check. PageBuckets, the struct
with a Python surface for tests, lives apart in _probes.pyx.
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


# Note [Free buckets]
# A heap or a sorted list of pages by free count costs O(log pages) per change and a search for
# best fit; the free counts are small integers (at most the blocks of a page), so each count gets
# its own doubly linked list of pages (insert and remove O(1), no search) and a bitmap says which
# lists are non-empty: best fit is the lowest set bit at or above r, the emptiest page the highest
# set bit, both O(max_count / 64) word scans (one word up to 63 blocks per page). A page with no
# free id (full) or not taken is in no list. The struct is the owner's: the block allocator
# changes it under its lock and checks it against its per-page free counts.
