# VirtualRange and its zero-copy export to torch through DLPack. See Note [DLPack export].

import operator as _operator

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
        r.live_token = _live_token()
        return r

    def __dealloc__(self):
        # a forked child gives nothing back: the reservation is the parent's (Note [Fork and close])
        if not self.freed and self.backend is not None and self.live_token == _fork_generation:
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
