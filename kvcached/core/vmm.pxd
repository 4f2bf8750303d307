# The C-level contract of kvcached.core.vmm, the lowest layer: checked driver and syscall calls, the
# process lifecycle (fork and close), the backends (Backend, CudaBackend; HostBackend is hostmem.pxd)
# with their one handle cache, and VirtualRange (a reservation and its DLPack export). Every field commented,
# every cdef's failure mode stated: `except -1` raises; out of memory is the value _OOM (1), never
# an exception; `noexcept` is bookkeeping only (never a driver call). Layers above cimport this
# file and never touch the handle cache's arrays or `_lock`.

from libc.stdint cimport int64_t, uint64_t, uintptr_t
from cuda.bindings cimport cydriver

from kvcached.core._posix cimport pthread_mutex_t

cdef enum:
    _OOM = 1                # the value, never an exception, that means "out of physical memory"

cdef enum:
    _MAX_CACHED_HANDLES = 256

cdef enum:
    # Backend fault injection (tests): the primitives that can be made to fail
    _FAULT_MAP = 0
    _FAULT_SET_ACCESS = 1
    _FAULT_UNMAP = 2
    _NUM_FAULT_OPS = 3

# -- process lifecycle: live, closed, or inherited by a forked child (Note [Fork and close]) ------
cdef uint64_t _fork_generation  # forks this process descends from; bumped in each child, before any Python
cdef uint64_t _TOKEN_CLOSED     # the token of a closed object: never equal to _fork_generation

cdef struct Lifecycle:
    # Every object of the core that owns memory or locks embeds one and asks it, one way, whether it
    # may act: one load and compare on the hot path, no getpid().
    uint64_t token              # == _fork_generation while usable; _TOKEN_CLOSED once closed
    uint64_t generation         # _fork_generation when made: differs in a forked child, closed or not
    int creator_pid             # the process that made it (named in the forked-child message)

cdef inline bint lifecycle_live(const Lifecycle* lc) noexcept nogil:
    """Usable: neither closed nor inherited by a forked child."""
    return lc.token == _fork_generation

cdef inline bint lifecycle_owned(const Lifecycle* lc) noexcept nogil:
    """Made in this process (closed or not): only then may close / __dealloc__ touch its resources."""
    return lc.generation == _fork_generation

cdef inline void lifecycle_close(Lifecycle* lc) noexcept nogil:
    lc.token = _TOKEN_CLOSED

cdef void lifecycle_init(Lifecycle* lc) noexcept nogil                              # live, made in this process now
cdef int lifecycle_check(const Lifecycle* lc, const char* what, const char* fix) except -1 nogil  # 0 while live, else raises KVCachedClosedError
cdef int lifecycle_check_owned(const Lifecycle* lc, const char* what) except -1 nogil  # 0 unless in a forked child (closed is fine), else raises
cdef str lifecycle_name(const Lifecycle* lc)                                        # "live", "closed" or "forked"

# -- checked calls: each raises DriverError naming the call (OutOfDeviceMemory for out of memory) --
cdef str _cuda_error_name(cydriver.CUresult res)                                       # never raises
cdef int check(cydriver.CUresult res, const char* call) except -1 nogil                # 0, or raises
cdef int check_oom(cydriver.CUresult res, const char* call) except -1 nogil            # 0 / _OOM, or raises
cdef int check_os(int failed, const char* call) except -1 nogil                        # 0, or raises with errno
cdef int _raise_os(const char* call, int err) except -1                                # always raises DriverError
cdef int _raise_if_oom(int rc, str what, size_t size_bytes) except -1 nogil            # rc, or raises OutOfDeviceMemory for _OOM


cdef class Backend:
    # Lock rule: `_lock` guards the handle cache, the counters and the fault countdowns; it is taken
    # and let go inside each method below (never held across a driver call or Python code), so
    # callers need no lock of their own and never take it.
    cdef pthread_mutex_t _lock                  # guards the cache, the counters, the fault state
    cdef readonly size_t granularity            # bytes; sizes and addresses are multiples of it
    cdef readonly str kind                      # "cuda" or "host"
    cdef readonly int device_id                 # CUDA ordinal; -1 for the host
    cdef readonly bint integrated_memory        # device memory is host memory (CU_DEVICE_ATTRIBUTE_INTEGRATED)
    cdef Lifecycle life                         # live / forked; a backend is never closed (Note [Fork and close])
    # the handle cache (Note [Handle cache]); only the methods of this class touch it
    cdef readonly int cache_capacity            # most released handles kept for reuse
    cdef int cache_count                        # handles in the cache now (a racy read is a hint only)
    cdef uint64_t cache_handles[_MAX_CACHED_HANDLES]   # the cached handles, a stack (top = last recycled)
    cdef size_t cache_sizes[_MAX_CACHED_HANDLES]       # bytes of each cached handle
    cdef readonly size_t cached_bytes           # bytes held by cached handles (an aligned word: readable without the lock)
    cdef readonly size_t physical_bytes         # bytes created and not released, cache included (idem)
    cdef readonly uint64_t num_creates          # physical handles created
    cdef readonly uint64_t num_releases         # physical handles released
    cdef readonly uint64_t num_cache_hits       # acquisitions served from the cache
    # fault injection (tests only; one flag test on the primitives while off)
    cdef int64_t fault_countdown                # -1 off; 0: every acquisition reports _OOM
    cdef bint faults_armed                      # some fault_times[op] != 0: the primitives count calls
    cdef int64_t fault_after[_NUM_FAULT_OPS]    # successful calls of op before the next injected failure
    cdef int64_t fault_times[_NUM_FAULT_OPS]    # failures of op still to inject; -1 forever, 0 off
    cdef bint fault_oom[_NUM_FAULT_OPS]         # inject out of memory (_OOM) rather than a DriverError

    # primitives (subclasses); each raises on failure; _create, _map and _set_access return _OOM
    # when out of memory (nothing changed)
    cdef int _reserve(self, size_t size_bytes, uintptr_t* address) except -1 nogil     # 0, or raises
    cdef int _free_range(self, uintptr_t address, size_t size_bytes) except -1 nogil   # 0, or raises
    cdef int _create(self, size_t size_bytes, uint64_t* handle) except -1 nogil        # 0 / _OOM, or raises; not counted
    cdef int _release(self, uint64_t handle, size_t size_bytes) except -1 nogil        # 0, or raises; not counted
    cdef int _map(self, uintptr_t address, size_t size_bytes, uint64_t handle) except -1 nogil        # 0 / _OOM, or raises
    cdef int _set_access(self, uintptr_t address, size_t size_bytes, bint writable) except -1 nogil   # 0 / _OOM, or raises
    cdef int _unmap_status(self, uintptr_t address, size_t size_bytes) noexcept nogil  # 0, or errno / CUresult: the mapping stays
    cdef object _unmap_error(self, int code)    # the DriverError for a code _unmap_status returned; never raises
    cdef int _record_fence(self, uintptr_t stream, uintptr_t* fence) except -1 nogil   # 0, or raises (no fence made)
    cdef int _fence_done(self, uintptr_t fence) except -1 nogil       # 1 done, 0 not yet, or raises
    cdef int _release_fence(self, uintptr_t fence) except -1 nogil    # 0, or raises; fence 0 is no fence
    cdef int _free_physical_bytes(self, size_t* free_bytes) except -1 nogil   # 0, or raises (a driver query: not hot)
    cdef int _zero_fill(self, uint64_t handle, size_t size_bytes, uintptr_t address) except -1   # 0, or raises; `address`:
                                                # a reserved, unmapped spot the CUDA backend maps the handle at meanwhile
    # shared: unmap, the handle cache (the one place its policy lives) and the counters
    cdef int _unmap(self, uintptr_t address, size_t size_bytes) except -1 nogil       # _unmap_status, raising (the mapping stays)
    cdef int acquire_handle(self, size_t size_bytes, uint64_t* handle) except -1 nogil   # 0 / _OOM (nothing taken), or raises
    cdef int recycle_handle(self, uint64_t handle, size_t size_bytes) except -1 nogil    # cached, or released (raises if that fails)
    cdef int _release_counted(self, uint64_t handle, size_t size_bytes) except -1 nogil  # _release + counters; raises (not counted)
    cdef int release_cached_above(self, int keep) except -1 nogil   # cache down to `keep`; goes on past failures, raises the first
    cdef int _pop_cached_above(self, int keep, uint64_t* handle, size_t* size_bytes) noexcept nogil   # 1 popped, 0 none
    cdef void _push_cached(self, uint64_t handle, size_t size_bytes) noexcept nogil   # back on top (a handle popped before)
    cdef size_t physical_bytes_locked(self) noexcept nogil     # physical_bytes read under `_lock`
    cdef int check_aligned(self, size_t value, str what) except -1   # 0, or raises MappingError
    cdef int _check_live(self) except -1 nogil                 # 0, or raises KVCachedClosedError in a forked child
    # fault injection, tests only
    cdef int _injected_fault(self, int op) except -1 nogil     # 0 / _OOM, or raises the injected DriverError
    cdef int _fault_fires(self, int op) noexcept nogil         # 0 run, 1 error, 2 out of memory


cdef class CudaBackend(Backend):
    cdef cydriver.CUdevice device               # the device of device_id
    cdef cydriver.CUcontext context             # the device's primary context (torch's too)
    cdef bint has_context                       # primary context retained, to release at exit
    cdef cydriver.CUmemAllocationProp prop      # pinned device memory on `device`
    cdef cydriver.CUmemAccessDesc access_rw     # read-write for the device
    cdef cydriver.CUmemAccessDesc access_ro     # read-only (the shared zero page)
    cdef int _bind(self) except -1 nogil        # make the primary context current on this thread


cdef class VirtualRange:
    # A range belongs to the backend that reserved it, so it lives at the backend's layer:
    # Backend.reserve() makes one. The page table above maps page ids into ranges.
    cdef readonly Backend backend               # the backend that reserved it (kept alive by it)
    cdef readonly uintptr_t address             # base; never changes for the range's life
    cdef readonly size_t size_bytes             # bytes reserved (a multiple of the granularity)
    cdef bint freed                             # reservation given back
    cdef Lifecycle life                         # made in this process or inherited (Note [Fork and close])
    @staticmethod
    cdef VirtualRange _wrap(Backend backend, uintptr_t address, size_t size_bytes)   # never raises


