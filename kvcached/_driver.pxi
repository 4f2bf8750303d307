# Checked CUDA driver calls and the one-time driver probe. See Note [Driver probe].

import os as _os
import threading as _threading

from kvcached.checks import as_int

from kvcached.errors import (
    BlockStateError,
    DriverError,
    DriverUnavailableError,
    KVCachedClosedError,
    KVCachedConfigError,
    MappingError,
    OutOfDeviceMemory,
)

cdef enum:
    _OOM = 1     # the value, never an exception, that means "out of physical memory"

cdef int64_t _MAX_NEW_PAGES = (<int64_t>1) << 62

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


cdef inline int check(cydriver.CUresult res, const char* call) except -1 nogil:
    """Raise DriverError naming `call` and the driver's error for anything but success."""
    if res == cydriver.CUDA_SUCCESS:
        return 0
    with gil:
        _raise_cuda(res, call)
    return -1


cdef inline int check_oom(cydriver.CUresult res, const char* call) except -1 nogil:
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

cdef extern from "<pthread.h>" nogil:
    int pthread_atfork(void (*prepare)() noexcept nogil, void (*parent)() noexcept nogil,
                       void (*child)() noexcept nogil)

cdef extern from "<unistd.h>" nogil:
    int getpid()

cdef uint64_t _fork_generation = 0        # forks this process descends from; bumped in each child
cdef uint64_t _TOKEN_CLOSED = ~(<uint64_t>0)


cdef void _after_fork_child() noexcept nogil:
    # Runs inside fork() in the child, before any Python code: one store, nothing else.
    global _fork_generation
    _fork_generation += 1


pthread_atfork(NULL, NULL, _after_fork_child)


cdef inline uint64_t _live_token() noexcept nogil:
    """The token of an object made now: usable while it equals _fork_generation."""
    return _fork_generation


cdef int _raise_unusable(str what, uint64_t token, int creator_pid, str fix) except -1:
    """Raise the KVCachedClosedError that says why an object whose token is stale cannot be used
    (closed, or inherited by a forked child): one class an engine can catch for both."""
    if token == _TOKEN_CLOSED:
        raise KVCachedClosedError(f"this {what} is closed; {fix}")
    raise KVCachedClosedError(
        f"this {what} was created in process {creator_pid} and is unusable in a forked child "
        f"(process {_os.getpid()}): its memory and locks are shared with the parent, whose KV cache it "
        f"would corrupt; create a new one after fork (init_kvcached / get_kv_cache_manager in the child).")


cdef str _lifecycle_name(uint64_t token):
    if token == _fork_generation:
        return "live"
    return "closed" if token == _TOKEN_CLOSED else "forked"


def fork_generation() -> int:
    """How many forks separate this process from the one that loaded kvcached (0 there)."""
    return _fork_generation

# Note [Fork and close]
# Every object of the core that owns memory or locks (Backend, VirtualRange, PageTable,
# PageAllocator, BlockAllocator) carries a token: the fork generation it was made in, or
# _TOKEN_CLOSED once closed. A pthread_atfork child handler bumps the generation, so after any
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
