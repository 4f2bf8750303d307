# The C-level contract of kvcached.core.pagesets: where each page id of a PageAllocator is. The
# three sets of ids — FreeSet (unmapped ids, lowest first), PoolStack (mapped, unused ids) and
# PendingRing (mapped ids waiting for their fence, and the ids whose unmap failed) — and
# PageLedger, which holds them with each id's state and the counts across them (Note [Page
# allocator states] in pagealloc.pyx). Each is a C struct whose operations are `cdef inline`
# here, compiled into the caller, so the pool fast path pays no call; each set has its own
# invariant check (in pagesets.pyx). Every function is `noexcept` bookkeeping under the owner's
# lock; the caller checks the preconditions each states. It cimports nothing of kvcached;
# refill and pagealloc cimport it.

from libc.stdint cimport int32_t, int64_t, uint8_t, uintptr_t

cdef enum:
    _NEED_SLOW = 2      # a fast (GIL-held, driver-free) worker could not serve: retry the slow way

cdef enum:
    # PageLedger.state[page_id]; every page id of the table is in exactly one state
    _PS_OUTSIDE = 0     # not handed out: at or above capacity, or holds no block (weight 0)
    _PS_FREE = 1        # below capacity, unmapped, in the free set
    _PS_POOL = 2        # mapped, unused: the reserved pool
    _PS_USED = 3        # mapped, handed out by take_pages / take_blocks
    _PS_PENDING = 4     # returned, still mapped until its fence is done (then unmapped)
    _PS_TRANSIT = 5     # being mapped or unmapped by the holder of the allocator's map_lock

cdef enum:
    _NO_LIMIT = 1 << 30     # ledger_headroom without a limit: more than any table's page ids


cdef struct FreeSet:
    # the free page ids: a Fenwick tree over ids [0, size) holding 1 and the weight per free id
    int32_t* count              # [1..size] tree nodes: free ids in each node's range
    int64_t* weight_sum         # [1..size] tree nodes: their weights
    const int32_t* weight       # [id] the weight of each id (the owner's array; unchanged while the id is in)
    int size                    # ids are [0, size)
    int top                     # highest power of two <= size
    int num                     # ids in the set


cdef struct PoolStack:
    # the pool: mapped, unused ids, a stack (the top is the most recently returned)
    int32_t* ids                # [0, num): ids[num - 1] is the top
    const int32_t* weight       # [id] the weight of each id (the owner's array)
    int num                     # ids in the pool
    int64_t weight_sum          # sum of their weights


cdef struct PendingRing:
    # mapped ids waiting for a fence (FIFO batches, one fence each), and the retry list: ids
    # whose unmap failed, pending with no fence (Note [Failed unmap] in pagealloc.pyx)
    int32_t* ids                # ring of fenced ids, oldest first, each batch contiguous
    int head                    # index of the oldest fenced id in ids
    int num_fenced              # fenced ids in the ring
    uintptr_t* fence            # ring of batches: the fence of each (the ring owns it)
    int32_t* count              # ring of batches: ids in each (> 0)
    int batch_head              # index of the oldest batch
    int num_batches             # batches in the ring
    int32_t* retry              # [0, num_retry): ids whose unmap failed
    int num_retry               # ids in retry
    int size                    # capacity of each ring and of the retry list: ids are [0, size)


cdef struct PageLedger:
    # every page id's state, the three sets holding them and the counts across them (the owner's
    # `lock` guards it all); ids in transit are in no set, counted in num_transit
    uint8_t* state              # [id] one of _PS_*
    int32_t* weight             # [id] blocks the id holds (1 until a BlockAllocator binds them)
    FreeSet free_set            # the _PS_FREE ids
    PoolStack pool              # the _PS_POOL ids
    PendingRing pending         # the _PS_PENDING ids
    int size                    # ids are [0, size): the page table's num_pages
    int capacity                # ids [0, capacity) may be handed out
    int max_reserved            # returned ids beyond this many pooled ones are unmapped
    int limit                   # used + pool + transit never exceed it; -1 no limit
    int num_used                # _PS_USED ids
    int num_transit             # _PS_TRANSIT ids
    int refill_transit          # of those, ids a refill is mapping for the pool
    int64_t refill_transit_weight   # their weights (available_weight counts them as pool)


# -- allocation and the checks (pagesets.pyx): each check is O(size), returns 0, or -1 with the
# first broken invariant written to msg (cap bytes); none takes a lock ---------------------------
cdef int freeset_init(FreeSet* s, int size, const int32_t* weight) noexcept nogil     # 0, or -1 out of memory; empty
cdef void freeset_release(FreeSet* s) noexcept nogil
cdef int freeset_check(const FreeSet* s, char* msg, size_t cap) noexcept nogil        # each id in at most once, sums = recount
cdef void freeset_members(const FreeSet* s, uint8_t* out) noexcept nogil               # out[id] = 1 if id is in, else 0
cdef int pool_init(PoolStack* s, int size, const int32_t* weight) noexcept nogil     # 0, or -1 out of memory; empty
cdef void pool_release(PoolStack* s) noexcept nogil
cdef int pool_check(const PoolStack* s, int size, char* msg, size_t cap) noexcept nogil   # ids in range, no duplicate, weight sum
cdef int pool_drop(PoolStack* s, int below, int keep, int32_t* out) noexcept nogil  # ids >= below, then the top ones past keep -> out; how many
cdef int pending_init(PendingRing* r, int size) noexcept nogil                       # 0, or -1 out of memory; empty
cdef void pending_release(PendingRing* r) noexcept nogil                             # frees the arrays, not the fences
cdef int pending_check(const PendingRing* r, char* msg, size_t cap) noexcept nogil    # batch counts sum to the ids, no duplicate
cdef int pending_copy(const PendingRing* r, int32_t* out) noexcept nogil             # every pending id (ring, then retries); how many
cdef int ledger_init(PageLedger* L, int size, int capacity, int max_reserved) noexcept nogil   # 0, or -1 out of memory; weights 1, ids below capacity free
cdef void ledger_release(PageLedger* L) noexcept nogil                              # frees the arrays and the sets, not the pending fences
cdef int ledger_check(const PageLedger* L, const uint8_t* mapped, int num_mapped, char* msg, size_t cap) noexcept nogil  # each set's check, then across them and the table's mapped bits
cdef int ledger_settle_unmapped(PageLedger* L, int n, const int32_t* ids, const uint8_t* mapped) noexcept nogil  # transit ids -> free / retry; how many unmapped
cdef bint ledger_resize(PageLedger* L, int capacity) noexcept nogil                 # False (nothing changed) if an id at or above it is used
cdef bint ledger_bind_weights(PageLedger* L, const int32_t* weights) noexcept nogil # False (nothing changed) unless every id is free or outside


# -- the free set --------------------------------------------------------------------------------
cdef inline void freeset_update(FreeSet* s, int32_t page_id, int sign) noexcept nogil:
    # add (sign 1, the id is not in) or remove (sign -1, the id is in) one id
    cdef int i = page_id + 1
    cdef int64_t w = <int64_t>s.weight[page_id] * sign
    while i <= s.size:
        s.count[i] += sign
        s.weight_sum[i] += w
        i += i & (-i)
    s.num += sign


cdef inline int32_t freeset_pop_lowest(FreeSet* s) noexcept nogil:
    # remove and return the lowest id (num > 0)
    cdef int pos = 0, step = s.top
    while step:
        if pos + step <= s.size and s.count[pos + step] < 1:
            pos += step
        step >>= 1
    freeset_update(s, pos, -1)
    return pos


cdef inline int freeset_count_for_weight(const FreeSet* s, int64_t need) noexcept nogil:
    # how many of the lowest ids it takes to hold `need` (> 0) weight; -1 if all of them do not
    cdef int pos = 0, step = s.top, k = 0
    cdef int64_t rest = need
    while step:
        if pos + step <= s.size and s.weight_sum[pos + step] < rest:
            pos += step
            rest -= s.weight_sum[pos]
            k += s.count[pos]
        step >>= 1
    if pos >= s.size:
        return -1
    return k + 1


cdef inline int64_t freeset_weight_of_lowest(const FreeSet* s, int k) noexcept nogil:
    # total weight of the k lowest ids (0 <= k <= num)
    cdef int pos = 0, step = s.top, rest = k
    cdef int64_t total = 0
    if k <= 0:
        return 0
    while step:
        if pos + step <= s.size and s.count[pos + step] < rest:
            pos += step
            rest -= s.count[pos]
            total += s.weight_sum[pos]
        step >>= 1
    return total + s.weight[pos]


# -- the pool ------------------------------------------------------------------------------------
cdef inline void pool_push(PoolStack* s, int32_t page_id) noexcept nogil:
    # onto the top (the id is not in; at most size ids in all)
    s.ids[s.num] = page_id
    s.num += 1
    s.weight_sum += s.weight[page_id]


cdef inline int32_t pool_pop(PoolStack* s) noexcept nogil:
    # remove and return the top id (num > 0)
    cdef int32_t page_id
    s.num -= 1
    page_id = s.ids[s.num]
    s.weight_sum -= s.weight[page_id]
    return page_id


# -- the pending ring ----------------------------------------------------------------------------
cdef inline int pending_num(const PendingRing* r) noexcept nogil:
    # every pending id: fenced and retried
    return r.num_fenced + r.num_retry


cdef inline void pending_push(PendingRing* r, int n, const int32_t* ids, uintptr_t fence) noexcept nogil:
    # n > 0 ids (none pending yet) as one batch behind `fence`, which the ring now owns
    cdef int i, tail = r.head + r.num_fenced
    for i in range(n):
        r.ids[(tail + i) % r.size] = ids[i]
    i = (r.batch_head + r.num_batches) % r.size
    r.fence[i] = fence
    r.count[i] = n
    r.num_batches += 1
    r.num_fenced += n


cdef inline uintptr_t pending_oldest_fence(const PendingRing* r) noexcept nogil:
    # the fence of the oldest batch (num_batches > 0)
    return r.fence[r.batch_head]


cdef inline int pending_pop(PendingRing* r, int32_t* out) noexcept nogil:
    # remove the oldest batch (num_batches > 0): its ids into out, returns how many; the caller
    # now owns its fence (read it first with pending_oldest_fence)
    cdef int i, c = r.count[r.batch_head]
    for i in range(c):
        out[i] = r.ids[(r.head + i) % r.size]
    r.head = (r.head + c) % r.size
    r.batch_head = (r.batch_head + 1) % r.size
    r.num_batches -= 1
    r.num_fenced -= c
    return c


cdef inline void pending_retry(PendingRing* r, int32_t page_id) noexcept nogil:
    # an id whose unmap failed (not pending yet) onto the retry list
    r.retry[r.num_retry] = page_id
    r.num_retry += 1


cdef inline int pending_take_retries(PendingRing* r, int32_t* out) noexcept nogil:
    # empty the retry list into out; returns how many
    cdef int i, c = r.num_retry
    for i in range(c):
        out[i] = r.retry[i]
    r.num_retry = 0
    return c


# -- the ledger: moving ids between the states ----------------------------------------------------
cdef inline int64_t ledger_headroom(const PageLedger* L) noexcept nogil:
    # ids that may still become mapped under the limit (negative after a lower limit; _NO_LIMIT
    # when there is none): the one limit rule of every take, return, refill and trim
    if L.limit < 0:
        return _NO_LIMIT
    return <int64_t>L.limit - L.num_used - L.pool.num - L.num_transit


cdef inline void ledger_free_or_outside(PageLedger* L, int32_t page_id) noexcept nogil:
    # an unmapped id (in no set) back to the free set, or outside when above capacity or weight 0
    if page_id < L.capacity and L.weight[page_id] > 0:
        L.state[page_id] = _PS_FREE
        freeset_update(&L.free_set, page_id, 1)
    else:
        L.state[page_id] = _PS_OUTSIDE


cdef inline void ledger_push_pool(PageLedger* L, int n, const int32_t* ids) noexcept nogil:
    # ids[0..n) onto the pool's top, in that order (the caller moves the count of the state they leave)
    cdef int i
    for i in range(n):
        L.state[ids[i]] = _PS_POOL
        pool_push(&L.pool, ids[i])


cdef inline void ledger_unpop_pool(PageLedger* L, int n, const int32_t* ids) noexcept nogil:
    # undo taking ids[0..n) off the pool's top, in that order
    cdef int i
    for i in range(n - 1, -1, -1):
        ledger_push_pool(L, 1, ids + i)


cdef inline int ledger_pop_pool(PageLedger* L, int64_t need, bint by_weight, int32_t* out) noexcept nogil:
    # pool ids from the top holding `need` (> 0) weight (blocks when by_weight, else ids) become
    # used, into out; returns how many, or 0 (nothing taken) if the pool holds less
    cdef int k = 0
    cdef int64_t got = 0
    cdef int32_t p
    if (L.pool.weight_sum if by_weight else L.pool.num) < need:
        return 0
    while got < need:
        p = pool_pop(&L.pool)
        L.state[p] = _PS_USED
        out[k] = p
        k += 1
        got += L.weight[p] if by_weight else 1
    L.num_used += k
    return k


cdef inline void ledger_to_transit(PageLedger* L, int n, const int32_t* ids) noexcept nogil:
    # ids the caller took out of their set go into transit
    cdef int i
    for i in range(n):
        L.state[ids[i]] = _PS_TRANSIT
    L.num_transit += n


cdef inline void ledger_transit_to_used(PageLedger* L, int n, const int32_t* ids) noexcept nogil:
    # ids in transit, now mapped, handed out
    cdef int i
    for i in range(n):
        L.state[ids[i]] = _PS_USED
    L.num_used += n
    L.num_transit -= n


cdef inline void ledger_queue_pending(PageLedger* L, int n, const int32_t* ids, uintptr_t fence) noexcept nogil:
    # n > 0 mapped ids (in no set) wait behind one fence, which the ring now owns
    cdef int i
    for i in range(n):
        L.state[ids[i]] = _PS_PENDING
    pending_push(&L.pending, n, ids, fence)
