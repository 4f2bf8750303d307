# The C-level contract of kvcached.core.hostmem: HostBackend, vmm's Backend over host memory
# (Note [Host backend] in hostmem.pyx). Its primitives fail as Backend's say (vmm.pxd). It cimports
# vmm; nothing of the core cimports it.

from libc.stdint cimport uint64_t

from kvcached.core.vmm cimport Backend


cdef class HostBackend(Backend):
    cdef int fd                                 # the pool memfd: every page is a slot of it
    cdef readonly size_t capacity_bytes         # most bytes the pool hands out ("device memory")
    cdef size_t pool_end                        # slots below this offset were handed out once
    cdef size_t pool_span_bytes                 # size of the memfd: offsets available for slots
    cdef uint64_t* free_offsets                 # released slots' offsets, reused before pool_end grows
    cdef size_t* free_sizes                     # bytes of each released slot
    cdef Py_ssize_t num_free                    # released slots in the two arrays
    cdef Py_ssize_t cap_free                    # their allocated length
