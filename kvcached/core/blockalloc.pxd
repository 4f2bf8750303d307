# The C-level contract of kvcached.core.blockalloc, the hot path's top: BlockAllocator (free slots per
# page, best fit, a per-block allocated bit) over pagealloc's PageAllocator, with its pages by free
# count in a freebuckets struct and what callers pass checked by blockargs.
# Every field commented, every cdef's failure mode stated: `except -1` raises; out of memory is
# the value _OOM (1, from vmm), never an exception; `noexcept` is bookkeeping only (never a
# driver call). It cimports pagealloc (and through it pagetable and vmm), freebuckets and
# blockargs; nothing cimports it.

from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from cpython.ref cimport PyObject

from kvcached.core._posix cimport pthread_mutex_t
from kvcached.core cimport pagealloc, vmm
from kvcached.core.freebuckets cimport FreeBuckets

# Lock order: see pagealloc.pxd (BlockAllocator.lock comes first).

cdef enum:
    _BAD_ID = 3         # BlockAllocator._free_locked: an id is unknown / not allocated / repeated

cdef enum:
    # BlockAllocator.block_state[block_id]
    _BS_FREE = 0        # a valid id, not allocated (its page may or may not be mapped)
    _BS_ALLOCATED = 1   # handed out by alloc
    _BS_INVALID = 2     # in no page's interval (straddles two pages, or beyond the last page)
    _BS_HELD = 3        # allocated on behalf of try_to_reserve, not yet handed out
    _BS_MARK = 4        # transient, inside free(): seen once in this call


cdef class BlockSlots:
    # Which ids are free and where. Bookkeeping only (every method noexcept, no driver, no lock of
    # its own): BlockAllocator, its subclass, holds its `lock` around every call and read.
    cdef readonly int num_pages                 # the page table's page ids
    cdef readonly int32_t max_block_id          # ids are < max_block_id
    cdef readonly int64_t id_to_page_num        # page of block b = b * num // den
    cdef readonly int64_t id_to_page_den        # (the denominator)
    cdef readonly int max_blocks_per_page       # largest page_num_blocks
    cdef readonly int64_t total_blocks          # sum of page_num_blocks
    cdef int32_t* page_first                    # [page] first block id of the page's interval
    cdef int32_t* page_blocks                   # [page] blocks in the interval
    cdef int64_t* slot_base                     # [page] where the page's free-id stack starts in `slots`
    cdef int32_t* slots                         # free-id stacks, one per page, total_blocks long
    cdef int32_t* page_free                     # [page] free ids of an owned page (stack height)
    cdef uint8_t* page_owned                    # [page] 1: taken from the page allocator and not returned
    cdef uint8_t* page_mark                     # [page] scratch inside _free_locked: touched in this call
    cdef uint8_t* page_adopted                  # [page] 1: ever taken, so its ids may sit in id_objs
    cdef uint8_t* block_state                   # [block] one of _BS_*
    cdef FreeBuckets buckets                    # partially used owned pages, each filed under page_free (> 0)
    cdef int64_t partial_free                   # free ids in owned pages
    cdef int64_t num_allocated                  # ids handed out by alloc (held ids not counted)
    cdef int32_t* held                          # try_to_reserve's ids, a stack
    cdef int64_t num_held                       # ids in `held`
    cdef int num_owned                          # owned pages
    cdef int32_t* page_buf                      # page ids to/from the page allocator
    cdef uint64_t num_allocs                    # successful allocs, ever
    cdef uint64_t num_frees                     # successful frees, ever

    cdef int _init_slots(self, first, count, int64_t id_to_page_num, int64_t id_to_page_den,
                         int64_t max_block_id) except -1                            # 0, or raises MemoryError
    cdef void _adopt(self, int32_t page_id) noexcept nogil                          # a new page's ids onto its free stack
    cdef int _take_from(self, int32_t page_id, int k, int32_t* out) noexcept nogil  # k ids off a page's stack
    cdef int _hold(self, int n, const int32_t* ids) noexcept nogil                  # the ids just allocated become held
    cdef int _place(self, int n, int h, int np_new, int32_t* out) noexcept nogil    # -> unneeded new pages, in page_buf
    cdef int _free_locked(self, int n, const int32_t* ids, int* n_empty, int64_t* bad) noexcept nogil  # 0 / _BAD_ID (nothing freed)


cdef class BlockAllocator(BlockSlots):
    cdef vmm.Lifecycle life                     # live / closed / forked: Note [Fork and close]
    cdef readonly pagealloc.PageAllocator pages           # hands out and takes back whole pages
    cdef pthread_mutex_t lock                   # guards this object's and BlockSlots' state; see Note [Allocator locks]
    cdef PyObject** id_objs                     # [block] the int object alloc hands out for it, or NULL (GIL)
    cdef int32_t id_objs_len                    # ids below this use id_objs; Note [Block id objects] in blockargs
    cdef public bint debug_checks               # check_invariants() after every public call
    cdef uint64_t num_failed_allocs             # allocs that returned None, ever
    cdef readonly uint64_t num_failed_blocks    # the blocks those allocs asked for, ever (demand under a budget; read without the lock)
    cdef int num_inflight                       # allocs taking pages without the lock (Note [Allocator locks])

    # each says what it raises (`noexcept` ones are bookkeeping under `lock`)
    cdef int _alloc_locked(self, int n, int32_t* out, bint may_block, bint use_held) except -1 nogil  # 0 / _OOM / _NEED_SLOW, or raises
    cdef int _lock(self) except -1                                                   # 0; GIL held, waits without it
    cdef int _check_live(self) except -1                                             # 0, or raises KVCachedClosedError (closed / forked)
    cdef int _check_not_forked(self) except -1                                       # 0, or raises KVCachedClosedError
    cdef int _clear_locked(self) except -1                                           # 0, or raises MemoryError (nothing freed)
    cdef int _run_alloc(self, int n, int32_t* out, bint use_held, bint hold=*) except -1   # 0 / _OOM, or raises; GIL held
    cdef long long _checked_count(self, object n, str what) except -2   # n in [0, total_blocks], -1 above it (a failed alloc counted); ValueError if negative
    cdef int _run_free(self, int n, const int32_t* ids) except -1                    # 0, or raises BlockStateError (nothing freed); GIL held
    cdef list _id_list(self, long long count, int32_t* out)                          # ids just allocated as a list; MemoryError with them freed
    cdef int _return_pages(self, int ne) except -1                                   # page_buf[0..ne) back; never raises past the free
