# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, auto_pickle=False
"""kvcached.core.hostmem: HostBackend, the backend over host memory (mmap reservations, one pool memfd).

It gives CPU-only machines and the tests real virtual memory with the GPU backend's semantics
(Note [Host backend]): a subclass of vmm's Backend, whose handle cache, counters, lifecycle and
fault injection it shares. The C contract is hostmem.pxd; it cimports only vmm, and nothing of the
core above cimports it (they see a Backend).
"""

from libc.stdint cimport uint64_t, uintptr_t
from libc.stdlib cimport free, realloc

from kvcached.core._posix cimport (
    EIO, ENOMEM, FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, MAP_ANONYMOUS, MAP_FAILED, MAP_FIXED,
    MAP_NORESERVE, MAP_PRIVATE, MAP_SHARED, MFD_CLOEXEC, PROT_NONE, PROT_READ, PROT_WRITE, close, errno,
    fallocate, ftruncate, memfd_create, mmap, mprotect, munmap, pthread_mutex_lock, pthread_mutex_unlock,
)
from kvcached.core.vmm cimport _FAULT_MAP, _FAULT_SET_ACCESS, _FAULT_UNMAP, _OOM, Backend, _raise_os, check_os

import os as _os

from kvcached.errors import DriverError, KVCachedConfigError

cdef size_t _HOST_POOL_SPAN_FACTOR = 8


cdef size_t _host_total_memory():
    return <size_t>_os.sysconf("SC_PAGE_SIZE") * <size_t>_os.sysconf("SC_PHYS_PAGES")


cdef class HostBackend(Backend):
    """Host-memory VMM backend with the GPU backend's semantics (Note [Host backend])."""

    def __cinit__(self, *args, **kwargs):
        self.fd = -1    # 0 would be stdin: __dealloc__ after a failed __init__ must close nothing

    def __init__(self, size_t granularity=2 << 20, capacity_bytes=None):
        page = _os.sysconf("SC_PAGE_SIZE")
        if granularity == 0 or granularity % page:
            raise KVCachedConfigError(f"host granularity {granularity} must be a positive multiple of the OS page size ({page})")
        capacity = _host_total_memory() if capacity_bytes is None else int(capacity_bytes)
        capacity -= capacity % granularity
        if capacity <= 0:
            raise KVCachedConfigError(f"host capacity_bytes={capacity_bytes} must hold at least one granule ({granularity} bytes)")
        self.kind = "host"
        self.device_id = -1
        self.granularity = granularity
        self.capacity_bytes = capacity
        self.fd = memfd_create(b"kvcached-pool", MFD_CLOEXEC)
        check_os(self.fd < 0, "memfd_create")
        self.pool_span_bytes = capacity * _HOST_POOL_SPAN_FACTOR
        if ftruncate(self.fd, <long>self.pool_span_bytes) != 0:
            err = errno
            close(self.fd)
            self.fd = -1
            _raise_os("ftruncate", err)

    def __dealloc__(self):
        if self.fd >= 0:
            close(self.fd)
        free(self.free_offsets)
        free(self.free_sizes)

    @property
    def pool_fd(self):
        """The memfd that stores every page (tests read its st_blocks)."""
        return self.fd

    cdef int _reserve(self, size_t size_bytes, uintptr_t* address) except -1 nogil:
        cdef size_t span = size_bytes + self.granularity
        cdef void* raw
        cdef uintptr_t start, aligned
        self._check_live()
        raw = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        check_os(raw == MAP_FAILED, "mmap(reserve)")
        start = <uintptr_t>raw
        aligned = (start + self.granularity - 1) // self.granularity * self.granularity
        if aligned > start:
            munmap(raw, aligned - start)
        if start + span > aligned + size_bytes:
            munmap(<void*>(aligned + size_bytes), start + span - aligned - size_bytes)
        address[0] = aligned
        return 0

    cdef int _free_range(self, uintptr_t address, size_t size_bytes) except -1 nogil:
        self._check_live()
        return check_os(munmap(<void*>address, size_bytes) != 0, "munmap")

    cdef int _create(self, size_t size_bytes, uint64_t* handle) except -1 nogil:
        cdef Py_ssize_t i
        cdef uint64_t offset
        self._check_live()
        pthread_mutex_lock(&self._lock)
        if self.physical_bytes + size_bytes > self.capacity_bytes:
            pthread_mutex_unlock(&self._lock)
            return _OOM
        i = self.num_free - 1
        while i >= 0 and self.free_sizes[i] < size_bytes:
            i -= 1
        if i >= 0:
            offset = self.free_offsets[i]
            if self.free_sizes[i] == size_bytes:
                self.num_free -= 1
                self.free_offsets[i] = self.free_offsets[self.num_free]
                self.free_sizes[i] = self.free_sizes[self.num_free]
            else:
                self.free_offsets[i] += size_bytes
                self.free_sizes[i] -= size_bytes
        elif self.pool_end + size_bytes <= self.pool_span_bytes:
            offset = self.pool_end
            self.pool_end += size_bytes
        else:
            pthread_mutex_unlock(&self._lock)
            return _OOM
        pthread_mutex_unlock(&self._lock)
        handle[0] = offset + 1
        return 0

    cdef int _release(self, uint64_t handle, size_t size_bytes) except -1 nogil:
        cdef uint64_t offset = handle - 1
        cdef void* grown
        self._check_live()      # a child must never punch a hole in the memfd it shares with its parent
        check_os(fallocate(self.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, <long>offset, <long>size_bytes) != 0,
                 "fallocate(PUNCH_HOLE)")
        pthread_mutex_lock(&self._lock)
        if self.num_free == self.cap_free:
            self.cap_free = max(64, self.cap_free * 2)
            grown = realloc(self.free_offsets, self.cap_free * sizeof(uint64_t))
            if grown != NULL:
                self.free_offsets = <uint64_t*>grown
                grown = realloc(self.free_sizes, self.cap_free * sizeof(size_t))
                if grown != NULL:
                    self.free_sizes = <size_t*>grown
            if grown == NULL:
                self.cap_free = self.num_free
                pthread_mutex_unlock(&self._lock)
                with gil:
                    raise MemoryError("host backend: no memory for its free-slot table")
        self.free_offsets[self.num_free] = offset
        self.free_sizes[self.num_free] = size_bytes
        self.num_free += 1
        pthread_mutex_unlock(&self._lock)
        return 0

    cdef int _map(self, uintptr_t address, size_t size_bytes, uint64_t handle) except -1 nogil:
        cdef void* got
        if self.faults_armed and self._injected_fault(_FAULT_MAP) == _OOM:
            return _OOM
        self._check_live()
        got = mmap(<void*>address, size_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                   self.fd, <long>(handle - 1))
        if got == MAP_FAILED and errno == ENOMEM:
            return _OOM         # out of mappings (vm.max_map_count) or memory; the address is unchanged
        return check_os(got == MAP_FAILED, "mmap(map)")

    cdef int _set_access(self, uintptr_t address, size_t size_bytes, bint writable) except -1 nogil:
        cdef int failed
        if self.faults_armed and self._injected_fault(_FAULT_SET_ACCESS) == _OOM:
            return _OOM
        self._check_live()
        if writable:
            return 0
        failed = mprotect(<void*>address, size_bytes, PROT_READ) != 0
        if failed and errno == ENOMEM:
            return _OOM
        return check_os(failed, "mprotect")

    cdef int _unmap_status(self, uintptr_t address, size_t size_bytes) noexcept nogil:
        cdef void* got
        if self.faults_armed and self._fault_fires(_FAULT_UNMAP):
            return EIO
        got = mmap(<void*>address, size_bytes, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0)
        return errno if got == MAP_FAILED else 0

    cdef object _unmap_error(self, int code):
        return DriverError("mmap(unmap)", code, _os.strerror(code))

    cdef int _zero_fill(self, uint64_t handle, size_t size_bytes, uintptr_t address) except -1:
        # punching the slot's hole gives back its memory and reads as zeros
        return check_os(fallocate(self.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, <long>(handle - 1),
                                  <long>size_bytes) != 0, "fallocate(PUNCH_HOLE)")

    cdef int _free_physical_bytes(self, size_t* free_bytes) except -1 nogil:
        pthread_mutex_lock(&self._lock)
        free_bytes[0] = self.capacity_bytes - self.physical_bytes
        pthread_mutex_unlock(&self._lock)
        return 0


# Note [Host backend]
# The host backend is real virtual memory, so tests exercise what the GPU does: a range is an
# mmap(PROT_NONE, MAP_NORESERVE) reservation; physical memory is one memfd ("the pool"), a handle
# is a slot of it (offset + 1, so 0 means none), create takes a free slot (capacity_bytes bounds
# the total, like device memory), release punches a hole (fallocate) so the memory really goes
# back, map is mmap(MAP_SHARED | MAP_FIXED) of the slot, unmap puts a PROT_NONE reservation back
# in place (touching it faults, as on the GPU). Mapping one slot at two addresses aliases them.
# Access is granted at map time; set_access only ever lowers it (read-only zero page).
# Memory is measured by the memfd's st_blocks or /proc/meminfo Shmem, not RSS, which counts each
# mapping of a shared page again.
#
# The memfd is _HOST_POOL_SPAN_FACTOR times larger than capacity_bytes (holes cost nothing): free
# slots are reused by size but never merged, so a backend serving mappings of several sizes
# (per_layer pages, then compound ones) would otherwise run out of offsets before it runs out of
# memory. capacity_bytes is enforced on physical_bytes, not on offsets.
