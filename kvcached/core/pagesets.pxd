# The C-level contract of kvcached.core.pagesets: the three sets of page ids a PageAllocator
# keeps — FreeSet (unmapped ids, lowest first), PoolStack (mapped, unused ids) and PendingRing
# (mapped ids waiting for their fence, and the ids whose unmap failed). Each is a C struct whose
# operations are `cdef inline` here, compiled into the caller, so the pool fast path pays no
# call; each has its own invariant check (in pagesets.pyx). A set holds ids only: the state of
# each id and the counts across the sets are the allocator's (Note [Page allocator states] in
# pagealloc.pyx). Every function is `noexcept` bookkeeping under the owner's lock; the caller
# checks the preconditions each states. It cimports nothing of kvcached; pagealloc cimports it.

from libc.stdint cimport int32_t, int64_t, uint8_t, uintptr_t


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
