# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, auto_pickle=False
"""kvcached's compiled core: the VMM backends, the page table, the allocators, DLPack export.

Layers, each calling only the ones above it in this file (data-path order):
  _driver.pxi          checked CUDA driver calls and the one-time driver probe
  _backend.pxi         Backend (reserve / create / map / set access / unmap / release / fences),
                       CudaBackend over cydriver, HostBackend over mmap + one pool memfd,
                       and the bounded cache of released physical handles
  _range.pxi           VirtualRange: one reservation, exported to torch through DLPack
  _page_table.pxi      PageTable: what one page id maps, all-or-nothing, with rollback
  _page_allocator.pxi  PageAllocator: free page ids, reserved pool, resize, deferred unmap
  _block_allocator.pxi BlockAllocator: free slots per page, best fit, per-block allocated bit

Glossary: range = virtual reservation; page = physical mapping unit (one page id backs one
mapping per segment); block = KV slot; pool = mapped but unused pages.

Every cdef function says how it fails: ``except -1`` raises (driver and syscall errors), and out of
memory is the value ``_OOM`` (1), never an exception, so callers can roll back and return None.
Undo paths are ``except -1`` too: they go on past a failed step and raise the first failure.

Every object that owns memory or locks is live, closed, or inherited by a forked child; its public
methods check that first, with one compare (Note [Fork and close] in _driver.pxi).
"""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memset
from cpython.pycapsule cimport PyCapsule_Destructor, PyCapsule_GetPointer, PyCapsule_IsValid, PyCapsule_New
from cpython.ref cimport Py_DECREF, Py_INCREF, Py_XDECREF, PyObject

from cuda.bindings cimport cydriver

include "_driver.pxi"
include "_backend.pxi"
include "_range.pxi"
include "_page_table.pxi"
include "_page_allocator.pxi"
include "_block_allocator.pxi"
