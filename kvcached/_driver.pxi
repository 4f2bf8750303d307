# Checked CUDA driver calls and the one-time driver probe. See Note [Driver probe].

import threading as _threading

from kvcached.errors import (
    BlockStateError,
    DriverError,
    DriverUnavailableError,
    KVCachedConfigError,
    MappingError,
    OutOfDeviceMemory,
)

cdef enum:
    _OOM = 1     # the value, never an exception, that means "out of physical memory"

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

# Note [Driver probe]
# cydriver loads libcuda lazily; with no libcuda the first call *raises* (a RuntimeError), even
# inside `with nogil`, and retries the dlopen on every call (0.1-0.5 ms). So we probe once, under a
# lock, and cache the answer: a CudaBackend is only ever built after a successful probe, and code
# that only wants to know whether CUDA is there asks cuda_unavailable_reason().
