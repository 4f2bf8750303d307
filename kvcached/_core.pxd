# The C-level interface of kvcached._core: every field commented, every cdef method's failure mode
# stated (`except -1` raises; out of memory is the value _OOM = 1; `noexcept` is bookkeeping only).

from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from cuda.bindings cimport cydriver

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    int pthread_mutex_init(pthread_mutex_t*, void*)
    int pthread_mutex_destroy(pthread_mutex_t*)
    int pthread_mutex_lock(pthread_mutex_t*)
    int pthread_mutex_unlock(pthread_mutex_t*)

cdef enum:
    _MAX_CACHED_HANDLES = 256


cdef class Backend:
    cdef pthread_mutex_t _lock                  # guards the cache, the counters, fault_countdown
    cdef readonly size_t granularity            # bytes; sizes and addresses are multiples of it
    cdef readonly str kind                      # "cuda" or "host"
    cdef readonly int device_id                 # CUDA ordinal; -1 for the host
    cdef readonly int cache_capacity            # most released handles kept for reuse
    cdef int cache_count                        # handles in the cache now
    cdef uint64_t cache_handles[_MAX_CACHED_HANDLES]
    cdef size_t cache_sizes[_MAX_CACHED_HANDLES]
    cdef readonly size_t cached_bytes           # bytes held by cached handles
    cdef readonly size_t physical_bytes         # bytes created and not released (cache included)
    cdef readonly uint64_t num_creates          # physical handles created
    cdef readonly uint64_t num_releases         # physical handles released
    cdef readonly uint64_t num_cache_hits       # acquisitions served from the cache
    cdef int64_t fault_countdown                # -1 off; 0: every acquisition reports _OOM

    # primitives (subclasses); each raises on failure, _create returns _OOM when out of memory
    cdef int _reserve(self, size_t size_bytes, uintptr_t* address) except -1 nogil
    cdef int _free_range(self, uintptr_t address, size_t size_bytes) except -1 nogil
    cdef int _create(self, size_t size_bytes, uint64_t* handle) except -1 nogil
    cdef int _release(self, uint64_t handle, size_t size_bytes) except -1 nogil
    cdef int _map(self, uintptr_t address, size_t size_bytes, uint64_t handle) except -1 nogil
    cdef int _set_access(self, uintptr_t address, size_t size_bytes, bint writable) except -1 nogil
    cdef int _unmap(self, uintptr_t address, size_t size_bytes) except -1 nogil
    cdef int _record_fence(self, uintptr_t stream, uintptr_t* fence) except -1 nogil
    cdef int _fence_done(self, uintptr_t fence) except -1 nogil       # 1 done, 0 not yet
    cdef int _release_fence(self, uintptr_t fence) except -1 nogil
    cdef int _free_physical_bytes(self, size_t* free_bytes) except -1 nogil
    # shared
    cdef int acquire_handle(self, size_t size_bytes, uint64_t* handle) except -1 nogil   # 0 / _OOM
    cdef int recycle_handle(self, uint64_t handle, size_t size_bytes) except -1 nogil
    cdef int _release_counted(self, uint64_t handle, size_t size_bytes) except -1 nogil
    cdef int release_cached_handles(self) except -1 nogil
    cdef int check_aligned(self, size_t value, str what) except -1


cdef class CudaBackend(Backend):
    cdef cydriver.CUdevice device
    cdef cydriver.CUcontext context             # the device's primary context (torch's too)
    cdef bint has_context                       # primary context retained, to release at exit
    cdef cydriver.CUmemAllocationProp prop      # pinned device memory on `device`
    cdef cydriver.CUmemAccessDesc access_rw     # read-write for the device
    cdef cydriver.CUmemAccessDesc access_ro     # read-only (the shared zero page)
    cdef int _bind(self) except -1 nogil        # make the primary context current on this thread


cdef class HostBackend(Backend):
    cdef int fd                                 # the pool memfd: every page is a slot of it
    cdef readonly size_t capacity_bytes         # most bytes the pool hands out ("device memory")
    cdef size_t pool_end                        # slots below this offset were handed out once
    cdef uint64_t* free_offsets                 # released slots, reused before pool_end grows
    cdef size_t* free_sizes
    cdef Py_ssize_t num_free
    cdef Py_ssize_t cap_free


cdef class VirtualRange:
    cdef readonly Backend backend
    cdef readonly uintptr_t address             # base; never changes for the range's life
    cdef readonly size_t size_bytes
    cdef bint freed                             # reservation given back
    @staticmethod
    cdef VirtualRange _wrap(Backend backend, uintptr_t address, size_t size_bytes)


cdef class PageTable:
    cdef readonly Backend backend
    cdef readonly int num_pages                 # page ids are [0, num_pages)
    cdef readonly int num_segments              # mappings per page id
    cdef readonly size_t map_bytes              # bytes of each mapping
    cdef readonly int num_mapped                # page ids mapped now
    cdef readonly bint zero_page                # unmapped page ids show a shared read-only zero page
    cdef list ranges                            # keeps the segments' ranges alive
    cdef uintptr_t* segment_base                # segment i of page p is at segment_base[i] + p * map_bytes
    cdef uint64_t* handles                      # [page * num_segments + segment]; 0 = none
    cdef uint8_t* mapped                        # per page id: 1 mapped
    cdef uint64_t zero_handle                   # the shared zero page (0 when zero_page is off)
    cdef int map_pages(self, const int32_t* page_ids, int n) except -1 nogil    # 0 / _OOM; all or nothing
    cdef int unmap_pages(self, const int32_t* page_ids, int n) except -1 nogil
    cdef int _map_forward(self, const int32_t* page_ids, int n, int* pages_done, int* segments_done, int* stage) except -1 nogil
    cdef void _map_rollback(self, const int32_t* page_ids, int pages_done, int segments_done, int stage) noexcept nogil
    cdef int _unmap_segment(self, int32_t page_id, int segment) except -1 nogil
    cdef void _remap_zero(self, uintptr_t address) noexcept nogil
    cdef object _checked_ids(self, page_ids, bint want_mapped)
