"""kvcached.core.ledger: LedgerBackend, the backend of a tensor-parallel leader without pages.

A scheduler process that owns no device (an engine's scheduler beside its worker processes) can
still lead an instance: its page tables keep every page id's state and mirror each map and unmap
to the ranks that hold the memory, but nothing is mapped in its own address space. The C
contract is ledger.pxd. See Note [Leader without pages].
"""

from libc.stdint cimport uint64_t, uintptr_t

from kvcached.core._posix cimport pthread_mutex_lock, pthread_mutex_unlock
from kvcached.core.hostmem cimport HostBackend

from kvcached.errors import KVCachedConfigError

BACKEND_KINDS = ("cuda", "host")


cdef class LedgerBackend(HostBackend):
    """Reservations without memory (address space only, PROT_NONE) and handles that are numbers:
    a map, an unmap, a release do nothing and never fail; out of memory comes only from the
    ranks that hold the pages. `kind`, `granularity` and `integrated_memory` are those of the
    ranks it leads, so that its layouts and page sizes are theirs."""

    def __init__(self, size_t granularity, str kind, bint integrated_memory=False):
        if kind not in BACKEND_KINDS:
            raise KVCachedConfigError(f"kind={kind!r} is unknown; the ranks' backends are cuda or host")
        HostBackend.__init__(self, granularity, granularity)    # one granule of pool: never used
        self.kind = kind
        self.integrated_memory = integrated_memory
        self.next_handle = 1

    @property
    def holds_memory(self) -> bool:
        """False: nothing this backend maps has memory behind it (no stream, no tensors)."""
        return False

    cdef int _create(self, size_t size_bytes, uint64_t* handle) except -1 nogil:
        self._check_live()
        pthread_mutex_lock(&self._lock)
        handle[0] = self.next_handle
        self.next_handle += 1
        pthread_mutex_unlock(&self._lock)
        return 0

    cdef int _release(self, uint64_t handle, size_t size_bytes) except -1 nogil:
        return 0

    cdef int _map(self, uintptr_t address, size_t size_bytes, uint64_t handle) except -1 nogil:
        return 0

    cdef int _set_access(self, uintptr_t address, size_t size_bytes, bint writable) except -1 nogil:
        return 0

    cdef int _unmap_status(self, uintptr_t address, size_t size_bytes) noexcept nogil:
        return 0

    cdef int _zero_fill(self, uint64_t handle, size_t size_bytes, uintptr_t address) except -1:
        return 0

    cdef int _free_physical_bytes(self, size_t* free_bytes) except -1 nogil:
        free_bytes[0] = <size_t>-1 >> 1        # the ranks' memory is what limits, not this process's
        return 0


# Note [Leader without pages]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Under an engine's multiprocess executor the scheduler (with the block pool, hence kvcached's
# allocator) lives in a process of its own, and each tensor-parallel worker in another. The
# allocator must stay with the scheduler (every alloc is on its path), so the scheduler leads
# with init_kvcached(device="none"): rank 0 of the instance without KV memory, the workers ranks
# 1..N. Its page tables are the ordinary ones over a LedgerBackend: the same layout, ids,
# all-or-nothing maps and rollback, with the mirror doing the real work on the workers; its
# reservations are address space only and it creates no memory, so its memory counts nothing
# (the manager counts N ranks: KVCacheManager.world_size is N). At init the leader learns the
# workers' backend kind, granularity and integrated memory from their answers to its hello, so
# its layout choice ("auto") is theirs; alloc_kv_cache makes the group and mirrors it but
# returns no tensors (there is no memory to view).
