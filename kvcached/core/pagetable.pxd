# The C-level contract of kvcached.core.pagetable: what one page id maps, through a backend of vmm.
# Every field commented, every cdef's failure mode stated: `except -1` raises; out of memory is
# the value _OOM (1), never an exception; `noexcept` is bookkeeping only. pagealloc and blockalloc cimport this file.

from libc.stdint cimport int32_t, uint8_t, uint64_t, uintptr_t

from kvcached.core._posix cimport pthread_mutex_t
from kvcached.core.vmm cimport Backend, Lifecycle

cdef class PageTable:
    # Lock rule: `lock` serialises map_pages, unmap_pages, set_mirror and close; it is only ever
    # waited on without the GIL, and a failure path (the undo, the mirror) takes the GIL while
    # holding it. The page allocator above also holds its map_lock around every call.
    cdef pthread_mutex_t lock                   # see the lock rule
    cdef Lifecycle life                         # live / closed / forked: Note [Fork and close]
    cdef readonly uint64_t num_rollback_failures  # undo steps of failed maps that failed too
    cdef readonly object last_rollback_error    # the latest of them
    cdef readonly uint64_t num_unmap_failures   # segment unmaps the driver refused (the segment stayed mapped)
    cdef readonly object last_unmap_error       # the latest of them
    cdef readonly Backend backend               # maps, unmaps and hands out the physical handles
    cdef readonly int num_pages                 # page ids are [0, num_pages)
    cdef readonly int num_segments              # mappings per page id
    cdef readonly size_t map_bytes              # bytes of each mapping
    cdef readonly int num_mapped                # page ids mapped now (1 or 2 in `mapped`)
    cdef readonly bint zero_page                # unmapped page ids show a shared read-only zero page
    cdef list ranges                            # keeps the segments' ranges alive
    cdef uintptr_t* segment_base                # segment i of page p is at segment_base[i] + p * map_bytes
    cdef uint64_t* handles                      # [page * num_segments + segment]; 0 = none
    cdef uint8_t* mapped                        # per page id: 0 unmapped, 1 mapped, 2 partly unmapped after a failure (unmap only)
    cdef uint64_t zero_handle                   # the shared zero page (0 when zero_page is off)
    cdef readonly object mirror                 # repeats maps/unmaps on peers, or None (Note [Mirrored page table])

    # the data path (callers: the page allocator, under its map_lock; the ids are valid and checked)
    cdef int map_pages(self, const int32_t* page_ids, int n) except -1 nogil    # 0 / _OOM (every table as before), or raises; mirrored
    cdef int unmap_pages(self, const int32_t* page_ids, int n) except -1 nogil  # how many the driver refused (marked 2), or raises; mirrored
    # internals; all take or assume `lock` as their docstring says
    cdef int _map_mirrored(self, const int32_t* page_ids, int n) except -1      # 0 / _OOM, or raises; GIL held
    cdef int _map_local(self, const int32_t* page_ids, int n) except -1 nogil   # 0 / _OOM, or raises after its undo; this table only
    cdef int _unmap_mirrored(self, const int32_t* page_ids, int n) except -1    # as unmap_pages; GIL held
    cdef int _unmap_local(self, const int32_t* page_ids, int n) except -1 nogil # as unmap_pages, this table only
    cdef int _check_usable(self) except -1 nogil                                # 0, or raises KVCachedClosedError (closed / forked)
    cdef int _map_forward(self, const int32_t* page_ids, int n, int* pages_done, int* segments_done,
                          int* stage) except -1 nogil                           # 0 / _OOM, or raises; progress in the out-params
    cdef int _undo_map(self, const int32_t* page_ids, int pages_done, int segments_done, int stage,
                       int cached_before, bint raising) except -1 nogil         # 0, or raises its first failure unless `raising`
    cdef int _map_rollback(self, const int32_t* page_ids, int pages_done, int segments_done,
                           int stage) except -1                                 # tries every step, raises the first failure; GIL held
    cdef object _unmap_segment_caught(self, int32_t page_id, int segment, object first)   # never raises: returns the first failure
    cdef bint _page_has_handles(self, int32_t page_id) noexcept nogil           # a segment of the page still holds a handle
    cdef int _unmap_segment(self, int32_t page_id, int segment) except -1 nogil # 0, 1 driver refused (stays), or raises
    cdef int _remap_zero(self, uintptr_t address) except -1 nogil               # 0, or raises (out of memory included)
    cdef int _close_locked(self) except -1                                      # tries every page, raises the first failure
    cdef int _small_ids(self, page_ids, bint want_mapped, int32_t* out) except -2   # count, -1 not a small list; raises MappingError
    cdef object _checked_ids(self, page_ids, bint want_mapped)                  # int32 array, or raises MappingError
