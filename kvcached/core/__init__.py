"""kvcached.core: the compiled hot path, one extension module per layer, bottom up.

    vmm         checked driver and syscall calls; Backend and CudaBackend; the handle cache;
                the process lifecycle (fork and close); VirtualRange (a reservation, exported
                to torch through DLPack)
    hostmem     HostBackend (mmap reservations over one pool memfd: the GPU's semantics on
                host memory)
    ledger      LedgerBackend (the books without the memory: a tensor-parallel leader that
                owns no device)
    pagetable   PageTable (what one page id maps, all or nothing, with rollback)
    rounds      RoundSegment (a tensor-parallel instance's rounds in shared memory, between
                the ranks of one host)
    pagesets    where each page id is: FreeSet (a Fenwick tree), PoolStack (the reserved pool),
                PendingRing (fenced ids, unmap retries), each with its own check, and PageLedger
                (each id's state across them, the counts, the limit rule)
    refill      RefillPolicy (background refill, idle trim, budget gate) and Refillable, what it
                drives of the allocator above
    pagealloc   PageAllocator (take and return, the pool fast path, limits, resize) over
                PageMapper (mapping and unmapping through transit, fences)
    freebuckets pages filed by free count (best fit by a bit scan), for the block allocator
    blockargs   what callers hand the block allocator, checked and converted (counts, ids,
                page intervals, host memory for its bookkeeping)
    blockalloc  BlockAllocator (block ids over whole pages: best fit, per-block state)
    _probes     test hooks: the C structs of pagesets and freebuckets driven from Python

Each module's ``.pxd`` is its C contract and cimports only modules listed before it;
its ``.pyi`` types its Python surface. This package re-exports the Python names, so that code
above the core writes ``from kvcached.core import BlockAllocator``.
"""

from kvcached.core.blockalloc import BlockAllocator
from kvcached.core.hostmem import HostBackend
from kvcached.core.pagealloc import PageAllocator
from kvcached.core.pagetable import PageTable
from kvcached.core.refill import RefillPolicy
from kvcached.core.vmm import (
    DEFAULT_HANDLE_CACHE_SIZE,
    MAX_HANDLE_CACHE_SIZE,
    Backend,
    CudaBackend,
    VirtualRange,
    cuda_device_count,
    cuda_unavailable_reason,
    fork_generation,
)

__all__ = [
    "DEFAULT_HANDLE_CACHE_SIZE",
    "Backend",
    "BlockAllocator",
    "CudaBackend",
    "HostBackend",
    "MAX_HANDLE_CACHE_SIZE",
    "PageAllocator",
    "PageTable",
    "RefillPolicy",
    "VirtualRange",
    "cuda_device_count",
    "cuda_unavailable_reason",
    "fork_generation",
]
