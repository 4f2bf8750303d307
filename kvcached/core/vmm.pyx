# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, auto_pickle=False
"""kvcached.core.vmm: the lowest layer of the compiled core, over the CUDA driver or host memory.

Checked driver and syscall calls, the one-time driver probe, the process lifecycle every object
of the core follows (Note [Fork and close]), the backends — Backend (reserve / create / map / set
access / unmap / release / fences) and CudaBackend over cydriver (HostBackend, over mmap + one
pool memfd, is kvcached.core.hostmem) — with the bounded cache of released physical handles as
one policy in one class (Note [Handle cache]), and VirtualRange, a reservation exported to torch
through DLPack.

The C contract is vmm.pxd; hostmem, pagetable, pagealloc and blockalloc cimport it. Nothing here
imports them.
"""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free
from libc.string cimport memset
from cpython.pycapsule cimport PyCapsule_Destructor, PyCapsule_GetPointer, PyCapsule_IsValid, PyCapsule_New
from cpython.ref cimport Py_DECREF, Py_INCREF

from cuda.bindings cimport cydriver

from kvcached.core._posix cimport (
    errno, getpid, pthread_atfork, pthread_mutex_destroy, pthread_mutex_init, pthread_mutex_lock, pthread_mutex_unlock,
    usleep,
)

# Checked CUDA driver calls and the one-time driver probe. See Note [Driver probe].

import operator as _operator
import os as _os
import threading as _threading

from kvcached.errors import (
    DriverError,
    DriverUnavailableError,
    KVCachedClosedError,
    KVCachedConfigError,
    MappingError,
    OutOfDeviceMemory,
)

cdef object _probe_result = None      # None: not probed yet; "" usable; else why not
cdef object _probe_lock = _threading.Lock()


cdef str _cuda_error_name(cydriver.CUresult res):
    cdef const char* text = NULL
    try:
        if cydriver.cuGetErrorName(res, &text) == cydriver.CUDA_SUCCESS and text != NULL:
            return text.decode()
    except Exception:
        pass
    return f"CUresult {<int>res}"


cdef int _raise_cuda(cydriver.CUresult res, const char* call) except -1:
    name = _cuda_error_name(res)
    if res == cydriver.CUDA_ERROR_OUT_OF_MEMORY:
        raise OutOfDeviceMemory(call.decode(), <int>res, name)
    raise DriverError(call.decode(), <int>res, name)


cdef int check(cydriver.CUresult res, const char* call) except -1 nogil:
    """Raise DriverError naming `call` and the driver's error for anything but success."""
    if res == cydriver.CUDA_SUCCESS:
        return 0
    with gil:
        _raise_cuda(res, call)
    return -1


cdef int check_oom(cydriver.CUresult res, const char* call) except -1 nogil:
    """Like check(), but CUDA_ERROR_OUT_OF_MEMORY is returned as _OOM instead of raised."""
    if res == cydriver.CUDA_ERROR_OUT_OF_MEMORY:
        return _OOM
    return check(res, call)


def cuda_unavailable_reason():
    """None when the CUDA driver is usable and has a device; otherwise the reason, as text.

    Probed once per process and cached (see Note [Driver probe])."""
    global _probe_result
    cdef cydriver.CUresult res
    cdef int count = 0
    with _probe_lock:
        if _probe_result is None:
            try:
                res = cydriver.cuInit(0)
                if res != cydriver.CUDA_SUCCESS:
                    _probe_result = f"cuInit failed: {_cuda_error_name(res)}"
                else:
                    res = cydriver.cuDeviceGetCount(&count)
                    if res != cydriver.CUDA_SUCCESS:
                        _probe_result = f"cuDeviceGetCount failed: {_cuda_error_name(res)}"
                    elif count == 0:
                        _probe_result = "the CUDA driver reports no device"
                    else:
                        _probe_result = ""
            except Exception as exc:
                _probe_result = f"the CUDA driver library could not be loaded ({exc})"
        return _probe_result or None


def cuda_device_count():
    """Number of CUDA devices, 0 when the driver is unavailable."""
    cdef int count = 0
    if cuda_unavailable_reason() is not None:
        return 0
    check(cydriver.cuDeviceGetCount(&count), "cuDeviceGetCount")
    return count

# -- process lifecycle: live, closed, or inherited by a forked child. See Note [Fork and close]. --

_fork_generation = 0                      # declared in vmm.pxd: the other modules read it
_TOKEN_CLOSED = ~(<uint64_t>0)


cdef void _after_fork_child() noexcept nogil:
    # Runs inside fork() in the child, before any Python code: one store, nothing else.
    global _fork_generation
    _fork_generation += 1


pthread_atfork(NULL, NULL, _after_fork_child)


cdef void lifecycle_init(Lifecycle* lc) noexcept nogil:
    lc.token = _fork_generation
    lc.generation = _fork_generation
    lc.creator_pid = getpid()


cdef int lifecycle_check(const Lifecycle* lc, const char* what, const char* fix) except -1 nogil:
    """0 while live; else raise the KVCachedClosedError that says why the object cannot be used
    (closed, or inherited by a forked child): one class an engine can catch for both."""
    if lc.token == _fork_generation:
        return 0
    with gil:
        name = what.decode()
        if lc.generation != _fork_generation:
            raise KVCachedClosedError(
                f"this {name} was created in process {lc.creator_pid} and is unusable in a forked child "
                f"(process {_os.getpid()}): its memory and locks are shared with the parent, whose KV cache "
                f"it would corrupt; create a new one after fork (init_kvcached / get_kv_cache_manager in "
                f"the child).")
        raise KVCachedClosedError(f"this {name} is closed; {fix.decode()}")


cdef int lifecycle_check_owned(const Lifecycle* lc, const char* what) except -1 nogil:
    """0 unless the object was inherited by a forked child (closed is fine: stats, invariants)."""
    if lc.generation == _fork_generation:
        return 0
    return lifecycle_check(lc, what, b"")


cdef str lifecycle_name(const Lifecycle* lc):
    if lc.token == _fork_generation:
        return "live"
    return "closed" if lc.generation == _fork_generation else "forked"


def fork_generation() -> int:
    """How many forks separate this process from the one that loaded kvcached (0 there)."""
    return _fork_generation

# Note [Fork and close]
# Every object of the core that owns memory or locks (Backend, VirtualRange, PageTable,
# PageAllocator, RefillPolicy, BlockAllocator) embeds a Lifecycle (vmm.pxd): a token, the fork
# generation it was made in or _TOKEN_CLOSED once closed, and that generation kept apart, which
# tells a closed object in its own process from one a forked child inherited (no getpid()). The
# same helpers answer for every class: lifecycle_live, lifecycle_owned, lifecycle_check. A pthread_atfork child handler bumps the generation, so after any
# fork (os.fork, multiprocessing, a C library) every inherited object is stale at once, with no
# registry to walk and nothing to call from Python. Public methods compare the token first — one
# load and compare, before any lock — and raise a KVCachedClosedError that says what to do. In a child
# the inherited objects must not touch anything: the host backend's pool memfd and every mapped
# page are shared with the parent (a punched hole or a reused slot would zero or alias the
# parent's live blocks), CUDA is unusable after fork, and a lock may have been held by a parent
# thread that does not exist here. So close(), stop() and __dealloc__ in a child do nothing (they
# run from at-exit handlers and garbage collection), and the cdef data paths that map, unmap,
# create or release check the token too, so a path that slipped past a Python check still stops.

# Note [Driver probe]
# cydriver loads libcuda lazily; with no libcuda the first call *raises* (a RuntimeError), even
# inside `with nogil`, and retries the dlopen on every call (0.1-0.5 ms). So we probe once, under a
# lock, and cache the answer: a CudaBackend is only ever built after a successful probe, and code
# that only wants to know whether CUDA is there asks cuda_unavailable_reason().


# Backends: one interface, two implementations (the host one in hostmem). See Note [Handle cache].

DEFAULT_HANDLE_CACHE_SIZE = 8
MAX_HANDLE_CACHE_SIZE = _MAX_CACHED_HANDLES     # set_handle_cache_capacity's bound, for Python callers
_FAULT_OPS = {"map": _FAULT_MAP, "set_access": _FAULT_SET_ACCESS, "unmap": _FAULT_UNMAP}


cdef int _raise_os(const char* call, int err) except -1:
    raise DriverError(call.decode(), err, _os.strerror(err))


cdef int check_os(int failed, const char* call) except -1 nogil:
    """Raise DriverError naming the syscall and errno when `failed` is true."""
    cdef int err
    if not failed:
        return 0
    err = errno
    with gil:
        _raise_os(call, err)
    return -1


cdef int _raise_if_oom(int rc, str what, size_t size_bytes) except -1 nogil:
    """Turn the _OOM value into OutOfDeviceMemory where out of memory cannot be a value (undo
    paths); returns rc otherwise."""
    if rc != _OOM:
        return rc
    with gil:
        raise OutOfDeviceMemory(what, 2, "out of memory", f"{size_bytes} bytes")


cdef class Backend:
    """One VMM backend: reserve virtual ranges, create physical handles, map, set access, unmap,
    release, and order unmaps after device work (fences).

    Subclasses implement the `_`-prefixed primitives; everything else is shared. Handles released
    through `recycle_handle` stay in a small bounded cache (Note [Handle cache]).

    Lock rule: the handle cache, the counters and the fault countdowns are guarded by `_lock`,
    taken inside the nogil methods; callers need no lock of their own.

    In a forked child every method raises KVCachedClosedError (Note [Fork and close]).
    """

    def __cinit__(self, *args, **kwargs):
        pthread_mutex_init(&self._lock, NULL)
        self.cache_capacity = DEFAULT_HANDLE_CACHE_SIZE
        self.fault_countdown = -1
        lifecycle_init(&self.life)

    def __init__(self, *args, **kwargs):
        raise TypeError("Backend is abstract: use CudaBackend(device_id) or HostBackend()")

    def __dealloc__(self):
        if lifecycle_owned(&self.life):              # in a child the lock may be held by a lost thread
            pthread_mutex_destroy(&self._lock)

    cdef int _check_live(self) except -1 nogil:
        """Raise KVCachedClosedError in a forked child (Note [Fork and close]); 0 otherwise."""
        return lifecycle_check(&self.life, b"kvcached backend", b"make a new backend (init_kvcached).")

    @property
    def lifecycle(self) -> str:
        """"live", or "forked" when inherited by a forked child (then every method raises)."""
        return lifecycle_name(&self.life)

    # -- primitives, implemented by subclasses ------------------------------------------------
    cdef int _reserve(self, size_t size_bytes, uintptr_t* address) except -1 nogil:
        with gil:
            raise NotImplementedError
    cdef int _free_range(self, uintptr_t address, size_t size_bytes) except -1 nogil:
        with gil:
            raise NotImplementedError
    cdef int _create(self, size_t size_bytes, uint64_t* handle) except -1 nogil:
        with gil:
            raise NotImplementedError
    cdef int _release(self, uint64_t handle, size_t size_bytes) except -1 nogil:
        with gil:
            raise NotImplementedError
    cdef int _map(self, uintptr_t address, size_t size_bytes, uint64_t handle) except -1 nogil:
        with gil:
            raise NotImplementedError
    cdef int _set_access(self, uintptr_t address, size_t size_bytes, bint writable) except -1 nogil:
        with gil:
            raise NotImplementedError
    cdef int _unmap_status(self, uintptr_t address, size_t size_bytes) noexcept nogil:
        return -1
    cdef object _unmap_error(self, int code):
        return NotImplementedError("Backend is abstract")
    cdef int _record_fence(self, uintptr_t stream, uintptr_t* fence) except -1 nogil:
        fence[0] = 0
        return 0
    cdef int _fence_done(self, uintptr_t fence) except -1 nogil:
        return 1
    cdef int _release_fence(self, uintptr_t fence) except -1 nogil:
        return 0
    cdef int _free_physical_bytes(self, size_t* free_bytes) except -1 nogil:
        with gil:
            raise NotImplementedError
    cdef int _zero_fill(self, uint64_t handle, size_t size_bytes, uintptr_t address) except -1:
        raise NotImplementedError

    # -- shared: unmap, the handle cache and the counters --------------------------------------
    cdef int _unmap(self, uintptr_t address, size_t size_bytes) except -1 nogil:
        """Unmap one mapping; raises DriverError (the mapping stays). The page table calls
        _unmap_status instead, to go on past a failure (Note [Failed unmap])."""
        cdef int code
        self._check_live()
        code = self._unmap_status(address, size_bytes)
        if code == 0:
            return 0
        with gil:
            raise self._unmap_error(code)


    cdef int acquire_handle(self, size_t size_bytes, uint64_t* handle) except -1 nogil:
        """A physical handle of `size_bytes`: a cached one if any, else a new one.

        Returns 0, or _OOM with nothing taken. Raises DriverError for other driver failures."""
        cdef int i, rc
        self._check_live()
        pthread_mutex_lock(&self._lock)
        if self.fault_countdown == 0:
            pthread_mutex_unlock(&self._lock)
            return _OOM
        if self.fault_countdown > 0:
            self.fault_countdown -= 1
        i = self.cache_count - 1
        while i >= 0:
            if self.cache_sizes[i] == size_bytes:
                handle[0] = self.cache_handles[i]
                self.cache_count -= 1
                self.cache_handles[i] = self.cache_handles[self.cache_count]
                self.cache_sizes[i] = self.cache_sizes[self.cache_count]
                self.cached_bytes -= size_bytes
                self.num_cache_hits += 1
                pthread_mutex_unlock(&self._lock)
                return 0
            i -= 1
        pthread_mutex_unlock(&self._lock)
        rc = self._create(size_bytes, handle)
        if rc == 0:
            pthread_mutex_lock(&self._lock)
            self.num_creates += 1
            self.physical_bytes += size_bytes
            pthread_mutex_unlock(&self._lock)
        return rc

    cdef int recycle_handle(self, uint64_t handle, size_t size_bytes) except -1 nogil:
        """Give a handle back: into the cache while it has room, else released."""
        self._check_live()
        pthread_mutex_lock(&self._lock)
        if self.cache_count < self.cache_capacity:
            self.cache_handles[self.cache_count] = handle
            self.cache_sizes[self.cache_count] = size_bytes
            self.cache_count += 1
            self.cached_bytes += size_bytes
            pthread_mutex_unlock(&self._lock)
            return 0
        pthread_mutex_unlock(&self._lock)
        return self._release_counted(handle, size_bytes)

    cdef int _release_counted(self, uint64_t handle, size_t size_bytes) except -1 nogil:
        self._check_live()
        self._release(handle, size_bytes)
        pthread_mutex_lock(&self._lock)
        self.num_releases += 1
        self.physical_bytes -= size_bytes
        pthread_mutex_unlock(&self._lock)
        return 0

    cdef int release_cached_above(self, int keep) except -1 nogil:
        """Release cached handles from the top of the cache until at most `keep` remain: the one
        loop that gives cached memory back (trim, idle trim, a smaller capacity, shutdown, the
        undo of a failed map). Every handle is tried: one whose release fails goes back into the
        cache, still counted, the others are still released, and the first failure is raised
        at the end. Takes `_lock` per handle and the GIL for the loop: a rare path, never the
        data path. See Note [Handle cache]."""
        cdef uint64_t handle = 0
        cdef size_t size_bytes = 0
        self._check_live()
        with gil:
            kept = []
            first = None
            while self._pop_cached_above(keep, &handle, &size_bytes):
                try:
                    self._release_counted(handle, size_bytes)
                except BaseException as exc:
                    first = exc if first is None else first
                    kept.append((handle, size_bytes))
            for handle, size_bytes in kept:         # not released: back in the cache, still counted
                self._push_cached(handle, size_bytes)
            if first is not None:
                raise first
        return 0

    cdef int _pop_cached_above(self, int keep, uint64_t* handle, size_t* size_bytes) noexcept nogil:
        """Take the top cached handle off the cache when more than `keep` are cached: 1, or 0
        with nothing taken. Takes `_lock`."""
        pthread_mutex_lock(&self._lock)
        if self.cache_count <= keep:
            pthread_mutex_unlock(&self._lock)
            return 0
        self.cache_count -= 1
        handle[0] = self.cache_handles[self.cache_count]
        size_bytes[0] = self.cache_sizes[self.cache_count]
        self.cached_bytes -= size_bytes[0]
        pthread_mutex_unlock(&self._lock)
        return 1

    cdef void _push_cached(self, uint64_t handle, size_t size_bytes) noexcept nogil:
        """Put a handle that _pop_cached_above took (its release failed) back on top, counted
        again; with the cache full it is dropped, as the fixed arrays hold no more. Takes `_lock`."""
        pthread_mutex_lock(&self._lock)
        if self.cache_count < _MAX_CACHED_HANDLES:
            self.cache_handles[self.cache_count] = handle
            self.cache_sizes[self.cache_count] = size_bytes
            self.cache_count += 1
            self.cached_bytes += size_bytes
        pthread_mutex_unlock(&self._lock)

    cdef size_t physical_bytes_locked(self) noexcept nogil:
        """physical_bytes read under `_lock` (a snapshot consistent with the counters)."""
        cdef size_t value
        pthread_mutex_lock(&self._lock)
        value = self.physical_bytes
        pthread_mutex_unlock(&self._lock)
        return value

    cdef int check_aligned(self, size_t value, str what) except -1:
        if value == 0 or value % self.granularity:
            raise MappingError(
                f"{what}={value} is not a positive multiple of the {self.kind} backend's granularity "
                f"({self.granularity} bytes); round it up to {max(1, -(-value // self.granularity)) * self.granularity}."
            )
        return 0

    # -- Python surface: validated, one primitive each (tests and benchmarks) ------------------
    def reserve(self, size_t size_bytes):
        """Reserve a virtual range of `size_bytes` (a multiple of the granularity). -> VirtualRange"""
        cdef uintptr_t address = 0
        self.check_aligned(size_bytes, "size_bytes")
        with nogil:
            self._reserve(size_bytes, &address)
        return VirtualRange._wrap(self, address, size_bytes)

    def create(self, size_t size_bytes):
        """A new physical handle of `size_bytes` (cache bypassed). Raises OutOfDeviceMemory."""
        cdef uint64_t handle = 0
        cdef int rc
        self.check_aligned(size_bytes, "size_bytes")
        self._check_live()
        with nogil:
            rc = self._create(size_bytes, &handle)
        if rc == _OOM:
            cuda = self.kind == "cuda"
            raise OutOfDeviceMemory("cuMemCreate" if cuda else "create", 2,
                                    "CUDA_ERROR_OUT_OF_MEMORY" if cuda else "out of memory",
                                    f"{size_bytes} bytes asked, {self.free_physical_bytes()} bytes free "
                                    f"on the {self.kind} backend")
        pthread_mutex_lock(&self._lock)
        self.num_creates += 1
        self.physical_bytes += size_bytes
        pthread_mutex_unlock(&self._lock)
        return handle

    def release(self, uint64_t handle, size_t size_bytes):
        """Release a handle made by create() (cache bypassed).

        Raises MappingError (nothing changed) for handle 0 or a size that is not a multiple of the
        granularity; DriverError when the backend refuses the handle."""
        if handle == 0:
            raise MappingError("handle 0 is no handle; pass the value create() or acquire() returned")
        self.check_aligned(size_bytes, "size_bytes")
        with nogil:
            self._release_counted(handle, size_bytes)

    def map(self, uintptr_t address, size_t size_bytes, uint64_t handle, bint writable=True):
        """Map `handle` at `address` and set its access (one set-access per mapping). Raises
        OutOfDeviceMemory when the driver is out of memory (the mapping undone)."""
        cdef int rc
        self.check_aligned(size_bytes, "size_bytes")
        self.check_aligned(address, "address")
        with nogil:
            rc = self._map(address, size_bytes, handle)
            if rc == 0:
                rc = self._set_access(address, size_bytes, writable)
                if rc != 0:
                    self._unmap(address, size_bytes)
        if rc == _OOM:
            raise OutOfDeviceMemory("map", 2, "out of memory", f"mapping {size_bytes} bytes at 0x{address:x}")

    def map_only(self, uintptr_t address, size_t size_bytes, uint64_t handle):
        """Map without setting access (benchmarks time the two steps apart). Raises
        OutOfDeviceMemory when the driver is out of memory."""
        cdef int rc
        with nogil:
            rc = self._map(address, size_bytes, handle)
        if rc == _OOM:
            raise OutOfDeviceMemory("map", 2, "out of memory", f"mapping {size_bytes} bytes at 0x{address:x}")

    def set_access(self, uintptr_t address, size_t size_bytes, bint writable=True):
        """Raises OutOfDeviceMemory when the driver is out of memory."""
        cdef int rc
        with nogil:
            rc = self._set_access(address, size_bytes, writable)
        if rc == _OOM:
            raise OutOfDeviceMemory("set_access", 2, "out of memory", f"{size_bytes} bytes at 0x{address:x}")

    def unmap(self, uintptr_t address, size_t size_bytes):
        """Raises DriverError when the backend refuses (the mapping stays)."""
        with nogil:
            self._unmap(address, size_bytes)

    def acquire(self, size_t size_bytes):
        """A handle through the cache; None when out of memory."""
        cdef uint64_t handle = 0
        cdef int rc
        self.check_aligned(size_bytes, "size_bytes")
        with nogil:
            rc = self.acquire_handle(size_bytes, &handle)
        return None if rc == _OOM else handle

    def recycle(self, uint64_t handle, size_t size_bytes):
        """Give a handle back through the cache. Raises MappingError (nothing changed) for handle 0
        or a size that is not a multiple of the granularity."""
        if handle == 0:
            raise MappingError("handle 0 is no handle; pass the value create() or acquire() returned")
        self.check_aligned(size_bytes, "size_bytes")
        with nogil:
            self.recycle_handle(handle, size_bytes)

    def release_cached(self):
        """Release every cached handle back to the device."""
        with nogil:
            self.release_cached_above(0)

    def set_handle_cache_capacity(self, int capacity):
        """Keep at most `capacity` released handles for reuse (0 disables the cache)."""
        if not 0 <= capacity <= _MAX_CACHED_HANDLES:
            raise KVCachedConfigError(f"handle cache capacity {capacity} must be in [0, {_MAX_CACHED_HANDLES}]")
        self._check_live()
        pthread_mutex_lock(&self._lock)
        self.cache_capacity = capacity
        pthread_mutex_unlock(&self._lock)
        with nogil:
            self.release_cached_above(capacity)

    def record_fence(self, uintptr_t stream=0):
        """Record a fence on `stream` (a CUstream as int; 0 = legacy default stream) -> fence id."""
        cdef uintptr_t fence = 0
        self._check_live()
        self._record_fence(stream, &fence)
        return fence

    def fence_done(self, uintptr_t fence):
        """True when the device work queued before the fence has finished."""
        self._check_live()
        return self._fence_done(fence) == 1

    def release_fence(self, uintptr_t fence):
        self._check_live()
        self._release_fence(fence)

    def wait_for_stream(self, uintptr_t stream=0):
        """Return once the device work queued on `stream` so far has finished: one fence, polled
        without the GIL every 50 us (never a device synchronize). For an unmap by a caller that
        cannot defer it (a tensor-parallel follower). Returns at once on the host."""
        cdef uintptr_t fence = 0
        self._check_live()
        with nogil:
            self._record_fence(stream, &fence)
            try:
                while self._fence_done(fence) != 1:
                    usleep(50)
            finally:
                self._release_fence(fence)

    def free_physical_bytes(self):
        """Physical memory this backend could still create (a driver/syscall query: not hot)."""
        cdef size_t free_bytes = 0
        self._check_live()
        with nogil:
            self._free_physical_bytes(&free_bytes)
        return free_bytes

    def stats(self):
        """Counters: creates, releases, cache hits, physical and cached bytes."""
        return {
            "kind": self.kind,
            "granularity": self.granularity,
            "num_creates": self.num_creates,
            "num_releases": self.num_releases,
            "num_cache_hits": self.num_cache_hits,
            "physical_bytes": self.physical_bytes,
            "cached_bytes": self.cached_bytes,
            "cached_handles": self.cache_count,
        }


    # -- test hooks: fault injection (one flag test on the primitives while off) ---------------
    cdef int _injected_fault(self, int op) except -1 nogil:
        """Count one call of `op`; when its countdown is spent, fail it: return _OOM (armed with
        oom=True) or raise DriverError. Called only while faults_armed."""
        cdef int fire = self._fault_fires(op)
        if fire == 2:
            return _OOM
        if fire == 1:
            with gil:
                raise DriverError(("map", "set_access", "unmap")[op], 5, "EIO", "injected fault")
        return 0

    cdef int _fault_fires(self, int op) noexcept nogil:
        """Count one call of `op`: 0 let it run, 1 fail it with an error, 2 with out of memory."""
        cdef int fire = 0
        pthread_mutex_lock(&self._lock)
        if self.fault_times[op] != 0:
            if self.fault_after[op] > 0:
                self.fault_after[op] -= 1
            else:
                fire = 2 if self.fault_oom[op] else 1
                if self.fault_times[op] > 0:
                    self.fault_times[op] -= 1
        self.faults_armed = (self.fault_times[_FAULT_MAP] != 0 or self.fault_times[_FAULT_SET_ACCESS] != 0
                             or self.fault_times[_FAULT_UNMAP] != 0)
        pthread_mutex_unlock(&self._lock)
        return fire

    def inject_fault(self, str op, int64_t after, int64_t times=1, bint oom=False):
        """Fault injection (tests): after `after` more successful `op` calls ("map",
        "set_access" or "unmap"), the next `times` calls fail (-1: all of them) — with a
        DriverError, or, with oom=True, as out of memory (map and set_access). after=-1 disarms
        `op`. Raises KVCachedConfigError for another op, or oom=True with "unmap"."""
        self._check_live()
        if op not in _FAULT_OPS or (oom and op == "unmap"):
            raise KVCachedConfigError(
                f"inject_fault(op={op!r}, oom={oom}): op must be one of {sorted(_FAULT_OPS)}, "
                f"and oom=True only for map or set_access")
        cdef int i = _FAULT_OPS[op]
        pthread_mutex_lock(&self._lock)
        self.fault_after[i] = after
        self.fault_times[i] = 0 if after < 0 else times
        self.fault_oom[i] = oom
        self.faults_armed = (self.fault_times[_FAULT_MAP] != 0 or self.fault_times[_FAULT_SET_ACCESS] != 0
                             or self.fault_times[_FAULT_UNMAP] != 0)
        pthread_mutex_unlock(&self._lock)

    def inject_out_of_memory(self, int64_t after):
        """Fault injection: the handle acquisition after `after` more successful ones reports out
        of memory, and every one after that too, until called with -1 (off)."""
        self._check_live()
        pthread_mutex_lock(&self._lock)
        self.fault_countdown = after
        pthread_mutex_unlock(&self._lock)

cdef class CudaBackend(Backend):
    """The CUDA VMM backend: cuMemCreate / cuMemMap / cuMemSetAccess on one device's primary context."""

    def __init__(self, int device_id=0):
        cdef size_t granularity = 0
        cdef int integrated = 0
        reason = cuda_unavailable_reason()
        if reason is not None:
            raise DriverUnavailableError(f"CUDA is not usable: {reason}. Use device='cpu' for the host backend.")
        count = cuda_device_count()
        if not 0 <= device_id < count:
            raise KVCachedConfigError(f"CUDA device {device_id} does not exist: this machine has devices 0..{count - 1}.")
        self.kind = "cuda"
        self.device_id = device_id
        check(cydriver.cuDeviceGet(&self.device, device_id), "cuDeviceGet")
        check(cydriver.cuDevicePrimaryCtxRetain(&self.context, self.device), "cuDevicePrimaryCtxRetain")
        self.has_context = True
        memset(&self.prop, 0, sizeof(self.prop))
        self.prop.type = cydriver.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = cydriver.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = device_id
        memset(&self.access_rw, 0, sizeof(self.access_rw))
        self.access_rw.location.type = cydriver.CU_MEM_LOCATION_TYPE_DEVICE
        self.access_rw.location.id = device_id
        self.access_rw.flags = cydriver.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.access_ro = self.access_rw
        self.access_ro.flags = cydriver.CU_MEM_ACCESS_FLAGS_PROT_READ
        check(cydriver.cuMemGetAllocationGranularity(
            &granularity, &self.prop, cydriver.CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity")
        self.granularity = granularity
        check(cydriver.cuDeviceGetAttribute(&integrated, cydriver.CU_DEVICE_ATTRIBUTE_INTEGRATED, self.device),
              "cuDeviceGetAttribute(INTEGRATED)")
        self.integrated_memory = integrated != 0

    def __dealloc__(self):
        if self.has_context and lifecycle_owned(&self.life):   # a forked child touches no driver
            # Cached handles hold device memory that nothing else can reach once we are gone.
            try:
                self.release_cached_above(0)
            except Exception:
                pass
            try:
                cydriver.cuDevicePrimaryCtxRelease(self.device)
            except Exception:
                pass

    cdef inline int _bind(self) except -1 nogil:
        cdef cydriver.CUcontext current = NULL
        self._check_live()
        check(cydriver.cuCtxGetCurrent(&current), "cuCtxGetCurrent")
        if current != self.context:
            check(cydriver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        return 0

    cdef int _reserve(self, size_t size_bytes, uintptr_t* address) except -1 nogil:
        cdef cydriver.CUdeviceptr ptr = 0
        self._bind()
        check(cydriver.cuMemAddressReserve(&ptr, size_bytes, self.granularity, 0, 0), "cuMemAddressReserve")
        address[0] = <uintptr_t>ptr
        return 0

    cdef int _free_range(self, uintptr_t address, size_t size_bytes) except -1 nogil:
        self._bind()
        return check(cydriver.cuMemAddressFree(<cydriver.CUdeviceptr>address, size_bytes), "cuMemAddressFree")

    cdef int _create(self, size_t size_bytes, uint64_t* handle) except -1 nogil:
        cdef cydriver.CUmemGenericAllocationHandle h = 0
        cdef int rc
        self._bind()
        rc = check_oom(cydriver.cuMemCreate(&h, size_bytes, &self.prop, 0), "cuMemCreate")
        handle[0] = <uint64_t>h
        return rc

    cdef int _release(self, uint64_t handle, size_t size_bytes) except -1 nogil:
        self._bind()
        return check(cydriver.cuMemRelease(<cydriver.CUmemGenericAllocationHandle>handle), "cuMemRelease")

    cdef int _map(self, uintptr_t address, size_t size_bytes, uint64_t handle) except -1 nogil:
        if self.faults_armed and self._injected_fault(_FAULT_MAP) == _OOM:
            return _OOM
        self._bind()
        return check_oom(cydriver.cuMemMap(<cydriver.CUdeviceptr>address, size_bytes, 0,
                                           <cydriver.CUmemGenericAllocationHandle>handle, 0), "cuMemMap")

    cdef int _set_access(self, uintptr_t address, size_t size_bytes, bint writable) except -1 nogil:
        if self.faults_armed and self._injected_fault(_FAULT_SET_ACCESS) == _OOM:
            return _OOM
        self._bind()
        return check_oom(cydriver.cuMemSetAccess(<cydriver.CUdeviceptr>address, size_bytes,
                                                 &self.access_rw if writable else &self.access_ro, 1),
                         "cuMemSetAccess")

    cdef int _unmap_status(self, uintptr_t address, size_t size_bytes) noexcept nogil:
        # A CudaBackend exists only after a successful driver probe, so cydriver cannot raise here.
        cdef cydriver.CUcontext current = NULL
        cdef cydriver.CUresult res
        if self.faults_armed and self._fault_fires(_FAULT_UNMAP):
            return <int>cydriver.CUDA_ERROR_UNKNOWN
        res = cydriver.cuCtxGetCurrent(&current)
        if res == cydriver.CUDA_SUCCESS and current != self.context:
            res = cydriver.cuCtxSetCurrent(self.context)
        if res == cydriver.CUDA_SUCCESS:
            res = cydriver.cuMemUnmap(<cydriver.CUdeviceptr>address, size_bytes)
        return <int>res

    cdef object _unmap_error(self, int code):
        return DriverError("cuMemUnmap", code, _cuda_error_name(<cydriver.CUresult>code))

    cdef int _record_fence(self, uintptr_t stream, uintptr_t* fence) except -1 nogil:
        cdef cydriver.CUevent event = NULL
        self._bind()
        check(cydriver.cuEventCreate(&event, cydriver.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        check(cydriver.cuEventRecord(event, <cydriver.CUstream>stream), "cuEventRecord")
        fence[0] = <uintptr_t>event
        return 0

    cdef int _fence_done(self, uintptr_t fence) except -1 nogil:
        cdef cydriver.CUresult res
        self._check_live()
        res = cydriver.cuEventQuery(<cydriver.CUevent>fence)
        if res == cydriver.CUDA_ERROR_NOT_READY:
            return 0
        check(res, "cuEventQuery")
        return 1

    cdef int _release_fence(self, uintptr_t fence) except -1 nogil:
        if fence:
            check(cydriver.cuEventDestroy(<cydriver.CUevent>fence), "cuEventDestroy")
        return 0

    cdef int _free_physical_bytes(self, size_t* free_bytes) except -1 nogil:
        cdef size_t total = 0
        self._bind()
        return check(cydriver.cuMemGetInfo(free_bytes, &total), "cuMemGetInfo")

    cdef int _zero_fill(self, uint64_t handle, size_t size_bytes, uintptr_t address) except -1:
        # mapped at `address` for the fill, unmapped again whatever happens
        _raise_if_oom(self._map(address, size_bytes, handle), "cuMemMap", size_bytes)
        try:
            _raise_if_oom(self._set_access(address, size_bytes, True), "cuMemSetAccess", size_bytes)
            self.memset(address, 0, size_bytes)
        finally:
            self._unmap(address, size_bytes)
        return 0

    def memset(self, uintptr_t address, unsigned char value, size_t size_bytes):
        """Fill device memory synchronously (tests)."""
        with nogil:
            self._bind()
        check(cydriver.cuMemsetD8(<cydriver.CUdeviceptr>address, value, size_bytes), "cuMemsetD8")
        check(cydriver.cuCtxSynchronize(), "cuCtxSynchronize")


# Note [Handle cache]
# cuMemCreate and cuMemRelease together cost about as much as map + set-access, the floor of
# re-mapping (benchmarks/README.md, bench_vmm). Keeping up to `cache_capacity` released handles
# (default 8) and handing them out again to the next mapping of the same size takes create/release
# off the path of a page that is unmapped and soon mapped again. Cached handles still hold device
# memory: `cached_bytes` counts them, and `release_cached_above(keep)` gives them back (trim, idle
# trim, a smaller capacity, shutdown, and the undo of a failed map, which keeps the count it saw
# before the map so that the handles the map created are released again). It is the only code
# that takes handles off the cache in bulk; layers above call it and never touch the arrays.
# A reused handle holds whatever its last user wrote; kvcached never promised zeroed blocks.


# VirtualRange and its zero-copy export to torch through DLPack. See Note [DLPack export].

cdef extern from *:
    """
    typedef struct { int32_t device_type; int32_t device_id; } kvc_DLDevice;
    typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } kvc_DLDataType;
    typedef struct {
        void* data; kvc_DLDevice device; int32_t ndim; kvc_DLDataType dtype;
        int64_t* shape; int64_t* strides; uint64_t byte_offset;
    } kvc_DLTensor;
    typedef struct kvc_DLManagedTensor {
        kvc_DLTensor dl_tensor; void* manager_ctx; void (*deleter)(struct kvc_DLManagedTensor*);
    } kvc_DLManagedTensor;
    typedef struct { kvc_DLManagedTensor managed; int64_t shape[1]; } kvc_DLExport;
    """
    ctypedef struct kvc_DLDevice:
        int32_t device_type
        int32_t device_id
    ctypedef struct kvc_DLDataType:
        uint8_t code
        uint8_t bits
        uint16_t lanes
    ctypedef struct kvc_DLTensor:
        void* data
        kvc_DLDevice device
        int32_t ndim
        kvc_DLDataType dtype
        int64_t* shape
        int64_t* strides
        uint64_t byte_offset
    ctypedef struct kvc_DLManagedTensor:
        kvc_DLTensor dl_tensor
        void* manager_ctx
        void (*deleter)(kvc_DLManagedTensor*) noexcept nogil
    ctypedef struct kvc_DLExport:
        kvc_DLManagedTensor managed
        int64_t shape[1]

cdef enum:
    _kDLCPU = 1
    _kDLCUDA = 2
    _kDLUInt = 1


cdef void _dl_deleter(kvc_DLManagedTensor* managed) noexcept nogil:
    # Called by the consumer (torch), possibly from a thread without the GIL.
    with gil:
        Py_DECREF(<object>managed.manager_ctx)
    free(managed)


cdef void _dl_capsule_destructor(object capsule) noexcept:
    # A capsule never consumed still owns its tensor; a consumed one is renamed "used_dltensor".
    cdef kvc_DLManagedTensor* managed
    if PyCapsule_IsValid(capsule, b"dltensor"):
        managed = <kvc_DLManagedTensor*>PyCapsule_GetPointer(capsule, b"dltensor")
        managed.deleter(managed)


cdef class VirtualRange:
    """A reserved virtual address range of one backend; its base address never changes (so
    CUDA graphs that captured it stay valid). The reservation is given back when the range and
    every tensor exported from it are gone, or by free()."""

    def __init__(self):
        raise TypeError("VirtualRange is made by Backend.reserve()")

    @staticmethod
    cdef VirtualRange _wrap(Backend backend, uintptr_t address, size_t size_bytes):
        cdef VirtualRange r = VirtualRange.__new__(VirtualRange)
        r.backend = backend
        r.address = address
        r.size_bytes = size_bytes
        lifecycle_init(&r.life)
        return r

    def __dealloc__(self):
        # a forked child gives nothing back: the reservation is the parent's (Note [Fork and close])
        if not self.freed and self.backend is not None and lifecycle_owned(&self.life):
            try:
                self.backend._free_range(self.address, self.size_bytes)
            except Exception:
                pass

    def free(self):
        """Give the reservation back now. The caller must have unmapped every page in it and
        dropped every tensor exported from it; further use of those tensors is undefined."""
        if not self.freed:
            self.backend._check_live()
            self.freed = True
            self.backend._free_range(self.address, self.size_bytes)

    def __repr__(self):
        return f"VirtualRange({self.backend.kind}, address=0x{self.address:x}, size_bytes={self.size_bytes})"

    def check_offset(self, offset_bytes, size_bytes):
        """Raise MappingError unless [offset, offset + size) is granularity-aligned and inside.

        Python integers, so a negative or huge value is refused instead of wrapping around."""
        g = self.backend.granularity
        try:
            offset_bytes, size_bytes = _operator.index(offset_bytes), _operator.index(size_bytes)
        except TypeError:
            raise MappingError(f"offset {offset_bytes!r} and size {size_bytes!r} must be integers (bytes)") from None
        if offset_bytes < 0 or size_bytes <= 0:
            raise MappingError(f"offset {offset_bytes} must be >= 0 and size {size_bytes} > 0")
        if offset_bytes % g or size_bytes % g:
            raise MappingError(f"offset {offset_bytes} / size {size_bytes} is not aligned to the granularity {g}")
        if offset_bytes + size_bytes > self.size_bytes:
            raise MappingError(f"[{offset_bytes}, {offset_bytes + size_bytes}) lies outside the range of {self.size_bytes} bytes")

    def dlpack(self):
        """A DLPack capsule of the whole range as a 1-D uint8 tensor (kDLCPU or kDLCUDA)."""
        if self.freed:
            raise MappingError("this range was freed; reserve a new one")
        cdef kvc_DLExport* export = <kvc_DLExport*>calloc(1, sizeof(kvc_DLExport))
        if export == NULL:
            raise MemoryError("no memory for a DLPack descriptor")
        export.shape[0] = <int64_t>self.size_bytes
        export.managed.dl_tensor.data = <void*>self.address
        if self.backend.kind == "cuda":
            export.managed.dl_tensor.device.device_type = _kDLCUDA
            export.managed.dl_tensor.device.device_id = self.backend.device_id
        else:
            export.managed.dl_tensor.device.device_type = _kDLCPU
            export.managed.dl_tensor.device.device_id = 0
        export.managed.dl_tensor.ndim = 1
        export.managed.dl_tensor.dtype.code = _kDLUInt
        export.managed.dl_tensor.dtype.bits = 8
        export.managed.dl_tensor.dtype.lanes = 1
        export.managed.dl_tensor.shape = export.shape
        export.managed.dl_tensor.strides = NULL
        export.managed.manager_ctx = <void*>self
        export.managed.deleter = _dl_deleter
        Py_INCREF(self)
        return PyCapsule_New(export, b"dltensor", <PyCapsule_Destructor>_dl_capsule_destructor)

    def tensor(self):
        """The whole range as a zero-copy 1-D torch.uint8 tensor that keeps this range alive."""
        import torch.utils.dlpack
        return torch.utils.dlpack.from_dlpack(self.dlpack())

# Note [DLPack export]
# The range is exported as raw bytes (uint8, 1-D, compact); layout.py views it with the dtype and
# strides of each engine shape, so the C side never learns about dtypes. The managed tensor holds a
# reference to its VirtualRange (manager_ctx), dropped by the deleter when the consumer lets go, so
# the reservation outlives every tensor. Unmapping is separate: a tensor over an unmapped page
# faults on access (segfault on the host backend, an illegal address on CUDA).
