# The C-level contract of kvcached.core.freebuckets: pages filed by how many free ids they hold, for
# the block allocator's best fit (Note [Free buckets] in freebuckets.pyx). A plain struct and
# `cdef inline` functions, so the hot path pays no call: every operation is O(1) but the two
# scans, O(max_count / 64) words. Bookkeeping only: nothing here takes a lock (the owner's lock
# guards the struct) or calls the driver. It cimports nothing of the core; blockalloc cimports it.

from libc.stdint cimport int32_t, uint64_t

cdef extern from *:
    """
    static inline int kvc_ctz64(unsigned long long x) { return __builtin_ctzll(x); }
    static inline int kvc_clz64(unsigned long long x) { return __builtin_clzll(x); }
    """
    int kvc_ctz64(unsigned long long x) noexcept nogil     # trailing zeros of x != 0
    int kvc_clz64(unsigned long long x) noexcept nogil     # leading zeros of x != 0

cdef struct FreeBuckets:
    # Bucket f is a doubly linked list of the pages filed under f; a page is in one bucket or none.
    int32_t* head               # [f] first page of bucket f; -1 empty (max_count + 1 entries)
    int32_t* next               # [page] next page of its bucket; -1 last, or in no bucket
    int32_t* prev               # [page] previous page of its bucket; -1 first, or in no bucket
    uint64_t* bits              # bit f set: bucket f not empty (`words` words)
    int words                   # 64-bit words of `bits`
    int num_pages               # length of next / prev
    int max_count               # largest f

cdef int buckets_init(FreeBuckets* b, int num_pages, int max_count) noexcept nogil   # 0, or -1 out of memory (nothing held)
cdef void buckets_free(FreeBuckets* b) noexcept nogil                               # frees the arrays; idempotent
cdef int buckets_check(const FreeBuckets* b, const int32_t* counts) except -1       # 0, or raises AssertionError


cdef inline void buckets_insert(FreeBuckets* b, int32_t page_id, int f) noexcept nogil:
    """File page_id (in no bucket) under f (0 <= f <= max_count)."""
    cdef int32_t first = b.head[f]
    b.prev[page_id] = -1
    b.next[page_id] = first
    if first >= 0:
        b.prev[first] = page_id
    b.head[f] = page_id
    b.bits[f >> 6] |= (<uint64_t>1) << (f & 63)


cdef inline void buckets_remove(FreeBuckets* b, int32_t page_id, int f) noexcept nogil:
    """Take page_id out of bucket f, the one it is filed under."""
    cdef int32_t before = b.prev[page_id], after = b.next[page_id]
    if before >= 0:
        b.next[before] = after
    else:
        b.head[f] = after
        if after < 0:
            b.bits[f >> 6] &= ~((<uint64_t>1) << (f & 63))
    if after >= 0:
        b.prev[after] = before
    b.prev[page_id] = -1
    b.next[page_id] = -1


cdef inline int buckets_at_least(const FreeBuckets* b, int f) noexcept nogil:
    """The lowest non-empty bucket >= f, or -1."""
    cdef int w = f >> 6
    cdef uint64_t word
    if w >= b.words:
        return -1
    word = b.bits[w] & ((~(<uint64_t>0)) << (f & 63))
    while True:
        if word:
            return (w << 6) + kvc_ctz64(word)
        w += 1
        if w >= b.words:
            return -1
        word = b.bits[w]


cdef inline int buckets_highest(const FreeBuckets* b) noexcept nogil:
    """The highest non-empty bucket, or -1."""
    cdef int w = b.words - 1
    while w >= 0:
        if b.bits[w]:
            return (w << 6) + 63 - kvc_clz64(b.bits[w])
        w -= 1
    return -1
