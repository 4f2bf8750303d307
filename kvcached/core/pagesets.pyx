# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, auto_pickle=False
"""kvcached.core.pagesets: where each page id of a PageAllocator is, with the checks.

FreeSet holds the unmapped ids below capacity as a Fenwick tree, so that the lowest go first and
"the weight of the k lowest" is O(log pages); PoolStack the mapped, unused ids (last returned,
first reused); PendingRing the mapped ids waiting for their fence, in batches, and the ids whose
unmap failed. PageLedger holds the three with each id's state and the counts across them, so
that the allocator's bookkeeping under its lock — moving ids between states, the one limit rule,
resize, binding weights — is written once, here, apart from its locks and driver calls. Their
operations are inline in pagesets.pxd (the pool fast path pays no call); this module allocates
them, does the rarer whole-table operations and checks each one's own invariant, the ledger's
across the sets and the page table's mapped bits (Note [Page allocator states] in pagealloc.pyx).

Test hooks that drive and corrupt the sets without an allocator live apart, in _probes.pyx.
"""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t, uintptr_t
from libc.stdio cimport snprintf
from libc.stdlib cimport calloc, free, malloc


# -- the free set --------------------------------------------------------------------------------
cdef int freeset_init(FreeSet* s, int size, const int32_t* weight) noexcept nogil:
    s.count = <int32_t*>calloc(size + 1, sizeof(int32_t))
    s.weight_sum = <int64_t*>calloc(size + 1, sizeof(int64_t))
    s.weight = weight
    s.size = size
    s.num = 0
    s.top = 1
    while s.top * 2 <= size:
        s.top *= 2
    return 0 if s.count != NULL and s.weight_sum != NULL else -1


cdef void freeset_release(FreeSet* s) noexcept nogil:
    free(s.count)
    free(s.weight_sum)
    s.count = NULL
    s.weight_sum = NULL


cdef inline int64_t _prefix(const FreeSet* s, int i, int64_t* weight) noexcept nogil:
    # ids in [0, i) by the tree; their weight into weight[0]
    cdef int64_t total = 0
    weight[0] = 0
    while i > 0:
        total += s.count[i]
        weight[0] += s.weight_sum[i]
        i -= i & (-i)
    return total


cdef int freeset_check(const FreeSet* s, char* msg, size_t cap) noexcept nogil:
    """Recount: each id in the set once or not at all, with its own weight, and num ids in all
    (O(size log size))."""
    cdef int p
    cdef int64_t c, w, below_w, total = 0
    for p in range(s.size):
        c = _prefix(s, p + 1, &w) - _prefix(s, p, &below_w)
        w -= below_w
        if c != 0 and c != 1:
            snprintf(msg, cap, "free set: page id %d is in it %lld times", p, <long long>c)
            return -1
        if w != c * s.weight[p]:
            snprintf(msg, cap, "free set: page id %d has weight %lld in the tree, %d in the weights",
                     p, <long long>w, <int>(c * s.weight[p]))
            return -1
        total += c
    if total != s.num:
        snprintf(msg, cap, "free set: the tree holds %lld ids, num says %d", <long long>total, s.num)
        return -1
    return 0


cdef void freeset_members(const FreeSet* s, uint8_t* out) noexcept nogil:
    cdef int p
    cdef int64_t w
    for p in range(s.size):
        out[p] = 1 if _prefix(s, p + 1, &w) != _prefix(s, p, &w) else 0


# -- the pool ------------------------------------------------------------------------------------
cdef int pool_init(PoolStack* s, int size, const int32_t* weight) noexcept nogil:
    s.ids = <int32_t*>malloc(max(1, size) * sizeof(int32_t))
    s.weight = weight
    s.num = 0
    s.weight_sum = 0
    return 0 if s.ids != NULL else -1


cdef void pool_release(PoolStack* s) noexcept nogil:
    free(s.ids)
    s.ids = NULL


cdef int pool_check(const PoolStack* s, int size, char* msg, size_t cap) noexcept nogil:
    """No id twice, every id below size, and weight_sum the sum of their weights."""
    cdef int i
    cdef int32_t p
    cdef int64_t total = 0
    cdef uint8_t* seen
    if not 0 <= s.num <= size:
        snprintf(msg, cap, "pool: %d ids, outside [0, %d]", s.num, size)
        return -1
    seen = <uint8_t*>calloc(max(1, size), 1)
    if seen == NULL:
        snprintf(msg, cap, "pool: no memory for the check")
        return -1
    for i in range(s.num):
        p = s.ids[i]
        if not 0 <= p < size or seen[p]:
            snprintf(msg, cap, "pool: page id %d at %d is out of range or repeated", p, i)
            free(seen)
            return -1
        seen[p] = 1
        total += s.weight[p]
    free(seen)
    if total != s.weight_sum:
        snprintf(msg, cap, "pool: weights sum to %lld, weight_sum says %lld", <long long>total, <long long>s.weight_sum)
        return -1
    return 0


cdef int pool_drop(PoolStack* s, int below, int keep, int32_t* out) noexcept nogil:
    """Remove the ids >= below (the others keep their order), then ids from the top until at
    most `keep` remain; they go to out, returns how many."""
    cdef int i, j = 0, n = 0
    cdef int32_t p
    for i in range(s.num):
        p = s.ids[i]
        if p >= below:
            out[n] = p
            n += 1
        else:
            s.ids[j] = p
            j += 1
    s.num = j
    while s.num > keep:
        s.num -= 1
        out[n] = s.ids[s.num]
        n += 1
    for i in range(n):
        s.weight_sum -= s.weight[out[i]]
    return n


# -- the pending ring ----------------------------------------------------------------------------
cdef int pending_init(PendingRing* r, int size) noexcept nogil:
    cdef int n = max(1, size)
    r.ids = <int32_t*>malloc(n * sizeof(int32_t))
    r.fence = <uintptr_t*>malloc(n * sizeof(uintptr_t))
    r.count = <int32_t*>malloc(n * sizeof(int32_t))
    r.retry = <int32_t*>malloc(n * sizeof(int32_t))
    r.size = n
    r.head = r.num_fenced = r.batch_head = r.num_batches = r.num_retry = 0
    return 0 if r.ids != NULL and r.fence != NULL and r.count != NULL and r.retry != NULL else -1


cdef void pending_release(PendingRing* r) noexcept nogil:
    free(r.ids)
    free(r.fence)
    free(r.count)
    free(r.retry)
    r.ids = r.retry = r.count = NULL
    r.fence = NULL


cdef int pending_copy(const PendingRing* r, int32_t* out) noexcept nogil:
    cdef int i
    for i in range(r.num_fenced):
        out[i] = r.ids[(r.head + i) % r.size]
    for i in range(r.num_retry):
        out[r.num_fenced + i] = r.retry[i]
    return r.num_fenced + r.num_retry


cdef int pending_check(const PendingRing* r, char* msg, size_t cap) noexcept nogil:
    """Counts in range, every batch non-empty, the batch counts sum to the fenced ids, and no
    id twice (ring and retries together)."""
    cdef int i, n
    cdef int64_t total = 0
    cdef int32_t p
    cdef int32_t* ids
    cdef uint8_t* seen
    if not (0 <= r.num_batches <= r.size and 0 <= r.num_fenced and 0 <= r.num_retry
            and r.num_fenced + r.num_retry <= r.size and 0 <= r.head < r.size and 0 <= r.batch_head < r.size):
        snprintf(msg, cap, "pending ring: %d batches, %d fenced ids, %d retries, heads %d/%d, outside its size %d",
                 r.num_batches, r.num_fenced, r.num_retry, r.head, r.batch_head, r.size)
        return -1
    for i in range(r.num_batches):
        n = r.count[(r.batch_head + i) % r.size]
        if n <= 0:
            snprintf(msg, cap, "pending ring: batch %d holds %d ids", i, n)
            return -1
        total += n
    if total != r.num_fenced:
        snprintf(msg, cap, "pending ring: batches hold %lld ids, num_fenced says %d", <long long>total, r.num_fenced)
        return -1
    ids = <int32_t*>malloc(r.size * sizeof(int32_t))
    seen = <uint8_t*>calloc(r.size, 1)
    if ids == NULL or seen == NULL:
        free(ids)
        free(seen)
        snprintf(msg, cap, "pending ring: no memory for the check")
        return -1
    n = pending_copy(r, ids)
    for i in range(n):
        p = ids[i]
        if not 0 <= p < r.size or seen[p]:
            snprintf(msg, cap, "pending ring: page id %d (pending #%d) is out of range or repeated", p, i)
            free(ids)
            free(seen)
            return -1
        seen[p] = 1
    free(ids)
    free(seen)
    return 0


# -- the ledger ----------------------------------------------------------------------------------
cdef int ledger_init(PageLedger* L, int size, int capacity, int max_reserved) noexcept nogil:
    cdef int p
    L.state = <uint8_t*>calloc(max(1, size), sizeof(uint8_t))
    L.weight = <int32_t*>malloc(max(1, size) * sizeof(int32_t))
    L.size = size
    L.capacity = capacity
    L.max_reserved = max_reserved
    L.limit = -1
    L.num_used = L.num_transit = L.refill_transit = 0
    L.refill_transit_weight = 0
    if (L.state == NULL or L.weight == NULL or freeset_init(&L.free_set, size, L.weight) != 0
            or pool_init(&L.pool, size, L.weight) != 0 or pending_init(&L.pending, size) != 0):
        return -1
    for p in range(size):
        L.weight[p] = 1
        ledger_free_or_outside(L, p)
    return 0


cdef void ledger_release(PageLedger* L) noexcept nogil:
    freeset_release(&L.free_set)
    pool_release(&L.pool)
    pending_release(&L.pending)
    free(L.state)
    free(L.weight)
    L.state = NULL
    L.weight = NULL


cdef int ledger_settle_unmapped(PageLedger* L, int n, const int32_t* ids, const uint8_t* mapped) noexcept nogil:
    """Ids in transit after an unmap or a failed map: each goes back to the free set, or — when
    the driver left any of it mapped (mapped[id], the table's bits) — pending, on the unmap
    retries, still counted. Returns how many went back unmapped; the caller takes all n off
    num_transit. See Note [Failed unmap] in pagealloc.pyx."""
    cdef int i, unmapped = 0
    for i in range(n):
        if mapped[ids[i]]:
            L.state[ids[i]] = _PS_PENDING
            pending_retry(&L.pending, ids[i])
        else:
            ledger_free_or_outside(L, ids[i])
            unmapped += 1
    return unmapped


cdef bint ledger_resize(PageLedger* L, int capacity) noexcept nogil:
    """Ids [0, capacity) may be handed out from now: free ids at or above it go outside, outside
    ids below it holding blocks become free. False, changing nothing, if an id at or above it is
    used; pool and pending ids above it are the caller's to unmap."""
    cdef int p, old = L.capacity
    for p in range(capacity, old):
        if L.state[p] == _PS_USED:
            return False
    for p in range(capacity, old):
        if L.state[p] == _PS_FREE:
            freeset_update(&L.free_set, p, -1)
            L.state[p] = _PS_OUTSIDE
    L.capacity = capacity
    for p in range(old, capacity):
        if L.state[p] == _PS_OUTSIDE:
            ledger_free_or_outside(L, p)
    return True


cdef bint ledger_bind_weights(PageLedger* L, const int32_t* weights) noexcept nogil:
    """Each id's weight from weights[0..size); ids of weight 0 go outside. False, changing
    nothing, unless every id is free or outside (none used, pooled, pending or in transit)."""
    cdef int p
    if L.num_used or L.pool.num or pending_num(&L.pending) or L.num_transit:
        return False
    for p in range(L.size):
        if L.state[p] == _PS_FREE:
            freeset_update(&L.free_set, p, -1)
        L.weight[p] = weights[p]
        L.state[p] = _PS_OUTSIDE
        if p < L.capacity:
            ledger_free_or_outside(L, p)
    return True


cdef int _check_states(const PageLedger* L, uint8_t* held, const uint8_t* mapped, int num_mapped,
                       char* msg, size_t cap) noexcept nogil:
    # held[id]: the state of the set holding the id (0 none); every id against its state
    cdef int p, i, n, s
    cdef int c[6]
    cdef int32_t* ids = <int32_t*>malloc(max(1, L.size) * sizeof(int32_t))
    if ids == NULL:
        snprintf(msg, cap, "ledger: no memory for the check")
        return -1
    freeset_members(&L.free_set, held)                      # 1 == _PS_FREE
    for i in range(L.pool.num):
        held[L.pool.ids[i]] = _PS_POOL if held[L.pool.ids[i]] == 0 else 255
    n = pending_copy(&L.pending, ids)
    for i in range(n):
        held[ids[i]] = _PS_PENDING if held[ids[i]] == 0 else 255
    free(ids)
    for i in range(6):
        c[i] = 0
    for p in range(L.size):
        s = L.state[p]
        if s > _PS_TRANSIT:
            snprintf(msg, cap, "ledger: page id %d has no state (%d)", p, s)
            return -1
        c[s] += 1
        if held[p] != (s if s == _PS_FREE or s == _PS_POOL or s == _PS_PENDING else 0):
            snprintf(msg, cap, "ledger: page id %d is in state %d but held by the set of state %d (255: two sets)",
                     p, s, held[p])
            return -1
        if (s == _PS_FREE or s == _PS_USED) and p >= L.capacity:
            snprintf(msg, cap, "ledger: page id %d is %s at or above capacity %d",
                     p, b"free" if s == _PS_FREE else b"in use", L.capacity)
            return -1
        if s == _PS_FREE and L.weight[p] <= 0:
            snprintf(msg, cap, "ledger: free page id %d holds no block", p)
            return -1
        if s == _PS_OUTSIDE and p < L.capacity and L.weight[p] != 0:
            snprintf(msg, cap, "ledger: page id %d below capacity is lost (outside, weight %d)", p, L.weight[p])
            return -1
        if (s == _PS_POOL or s == _PS_USED or s == _PS_PENDING) != (mapped[p] != 0) or (mapped[p] == 2 and s != _PS_PENDING):
            snprintf(msg, cap, "ledger: page id %d in state %d is %s in the table", p, s,
                     b"unmapped" if mapped[p] == 0 else (b"mapped" if mapped[p] == 1 else b"partly unmapped"))
            return -1
    if (c[_PS_FREE] != L.free_set.num or c[_PS_POOL] != L.pool.num or c[_PS_USED] != L.num_used
            or c[_PS_PENDING] != pending_num(&L.pending) or c[_PS_TRANSIT] != L.num_transit):
        snprintf(msg, cap, "ledger: states count free/pool/used/pending/transit %d/%d/%d/%d/%d, the counts say %d/%d/%d/%d/%d",
                 c[_PS_FREE], c[_PS_POOL], c[_PS_USED], c[_PS_PENDING], c[_PS_TRANSIT],
                 L.free_set.num, L.pool.num, L.num_used, pending_num(&L.pending), L.num_transit)
        return -1
    if c[_PS_POOL] + c[_PS_USED] + c[_PS_PENDING] != num_mapped:
        snprintf(msg, cap, "ledger: %d ids are pool, used or pending, the table maps %d",
                 c[_PS_POOL] + c[_PS_USED] + c[_PS_PENDING], num_mapped)
        return -1
    return 0


cdef int ledger_check(const PageLedger* L, const uint8_t* mapped, int num_mapped, char* msg, size_t cap) noexcept nogil:
    """Each set's own check, then across them (O(size log size)): every id in one state, each
    set holding exactly the ids of its state, the counts agreeing, free ids below capacity and
    holding blocks, no id below capacity lost, nothing free or used above it, and the mapped
    ids (the table's bits, its num_mapped) exactly pool + used + pending."""
    cdef int rc
    cdef uint8_t* held
    if (freeset_check(&L.free_set, msg, cap) != 0 or pool_check(&L.pool, L.size, msg, cap) != 0
            or pending_check(&L.pending, msg, cap) != 0):
        return -1
    held = <uint8_t*>calloc(max(1, L.size), 1)
    if held == NULL:
        snprintf(msg, cap, "ledger: no memory for the check")
        return -1
    rc = _check_states(L, held, mapped, num_mapped, msg, cap)
    free(held)
    return rc
