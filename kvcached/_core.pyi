"""Types of the Python-visible surface of kvcached._core (Cython): the allocators and the refill policy.

Only ``def`` methods, properties and ``readonly``/``public`` attributes are here: ``cdef`` methods
are invisible to Python. Every class is a C extension type with its own fields (@disjoint_base:
no class may inherit from two of them). Units: every ``*_bytes`` value, address and handle size is in bytes;
addresses, handles, fences and streams are plain ints. Out of memory is a value (None or False),
never an exception, except where a docstring says ``Raises OutOfDeviceMemory``.
Keep in step with _core.pxd (C interface) and the .pxi sources (behaviour). The names of the
layers below are re-exported by _core at run time; their types live in _vmm.pyi and _pagetable.pyi.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, Protocol, SupportsIndex, TypedDict, overload

import numpy as np
from numpy.typing import NDArray
from typing_extensions import Buffer, Self, TypeAlias, disjoint_base

from kvcached._pagetable import PageTable as PageTable
from kvcached._pagetable import _PageIds
from kvcached._vmm import DEFAULT_HANDLE_CACHE_SIZE as DEFAULT_HANDLE_CACHE_SIZE
from kvcached._vmm import Backend as Backend
from kvcached._vmm import CudaBackend as CudaBackend
from kvcached._vmm import HostBackend as HostBackend
from kvcached._vmm import VirtualRange as VirtualRange
from kvcached._vmm import _Lifecycle
from kvcached._vmm import cuda_device_count as cuda_device_count
from kvcached._vmm import cuda_unavailable_reason as cuda_unavailable_reason
from kvcached._vmm import fork_generation as fork_generation

# -- argument and result shapes (stub-only names) ------------------------------------------------

class _HasNumpy(Protocol):
    """A CPU tensor: anything with ``.numpy()`` giving a contiguous int32 array."""
    def numpy(self) -> Any: ...

_Int32Buffer: TypeAlias = Buffer | _HasNumpy
"""Contiguous int32 storage: numpy array, array.array('i'), or a CPU torch tensor."""

class _PageAllocatorStats(TypedDict):
    """PageAllocator.stats(): page counts (in page ids), byte figures and cumulative counters."""
    capacity_pages: int
    free: int
    in_use: int
    reserved: int
    pending_unmap: int
    transit: int
    limit_pages: int
    mapped: int
    reserved_weight: int
    free_physical_bytes: int
    page_bytes: int
    min_reserved: int
    max_reserved: int
    num_maps: int
    num_unmaps: int
    num_pool_hits: int
    num_slow_path: int
    num_oom: int
    num_fences: int
    num_idle_trims: int
    num_refills: int
    num_take_return: int
    num_pool_waits: int
    pages_taken: int
    refill_target: int
    unmap_retries: int
    num_unmap_failures: int
    num_refill_failures: int
    num_bg_rounds: int

class _BlockAllocatorStats(TypedDict):
    """BlockAllocator.stats(): block counts and counters, the page allocator's under "pages"."""
    allocated: int
    held: int
    owned_pages: int
    free_in_owned_pages: int
    total_blocks: int
    num_allocs: int
    num_frees: int
    num_failed_allocs: int
    pages: _PageAllocatorStats

# -- page allocator ------------------------------------------------------------------------------

@disjoint_base
class PageAllocator:
    """Hands out mapped page ids of one PageTable, keeping a pool of mapped, unused ones."""

    def __init__(
        self,
        page_table: PageTable,
        num_pages: int | None = None,
        min_reserved: int = 5,
        max_reserved: int = 10,
        idle_trim_s: float = 30.0,
    ) -> None:
        """num_pages: initial capacity (default the table's); pool bounds in pages; idle_trim_s: seconds, 0 off."""
    @property
    def table(self) -> PageTable:
        """The page table whose ids are handed out."""
    @property
    def backend(self) -> Backend:
        """The table's backend."""
    @property
    def num_table_pages(self) -> int:
        """The table's num_pages: capacity never exceeds it."""
    @property
    def capacity_pages(self) -> int:
        """Page ids [0, capacity_pages) may be handed out."""
    @property
    def min_reserved(self) -> int:
        """The background thread keeps the pool at least this big (pages)."""
    @property
    def max_reserved(self) -> int:
        """Returned pages beyond this many pooled ones are unmapped."""
    @property
    def refill_target(self) -> int:
        """Pool size a refill round aims at, in [min_reserved, max_reserved]."""
    @property
    def idle_trim_s(self) -> float:
        """Trim the pool after this many seconds without take/return; 0 off."""
    @property
    def limit_pages(self) -> int:
        """In-use + pool never exceed it; -1 = no limit."""
    @property
    def page_bytes(self) -> int:
        """Physical bytes of one page id (all its segments)."""
    @property
    def running(self) -> bool:
        """Whether the background thread runs (no docstring in the source)."""
    stream: int
    """CUstream (as int) the fences of returned pages are recorded on."""
    last_error: BaseException | None
    """Last exception caught off the caller's path (background thread, returning pages after a free), or None."""
    @property
    def lifecycle(self) -> _Lifecycle:
        """"closed" after close(), "forked" in a forked child: then methods raise KVCachedClosedError."""

    def available_pages(self, max_new_pages: SupportsIndex = -1) -> int:
        """Pages take() could deliver now (pool + what free ids, memory, limit and max_new_pages allow); O(1)."""
    def take(self, n: int) -> list[int] | None:
        """n mapped page ids, or None (nothing changed) when out of memory / over the limit."""
    def give_back(self, page_ids: _PageIds) -> None:
        """Return pages taken with take(); raises MappingError (nothing changed) for an id not in use."""
    def set_limit_pages(self, limit_pages: int) -> None:
        """Cap in-use + pool at `limit_pages` (-1: no cap); pool pages over it are unmapped now."""
    def set_pool_bounds(self, min_reserved: int, max_reserved: int) -> None:
        """Change the pool bounds (pages); a pool above the new maximum is unmapped down to it."""
    def set_idle_trim(self, idle_trim_s: float) -> None:
        """Seconds without take/return before the pool is trimmed; 0 off (no docstring in the source)."""
    @overload
    def set_budget_gate(self, acquire: Callable[[int], bool], release: Callable[[int], object]) -> None:
        """External budget: acquire(nbytes) -> bool before mapping, release(nbytes) after unmapping."""
    @overload
    def set_budget_gate(self, acquire: None = None, release: None = None) -> None: ...
    def resize(self, num_pages: int) -> bool:
        """Set the capacity in page ids; False (nothing changed) if a dropped id is in use."""
    def trim(self) -> None:
        """Unmap the pool and done pending pages, release cached handles; no refill until activity."""
    def drain(self, wait: bool = False) -> None:
        """Unmap pending pages whose fence is done (wait=True: wait for every fence)."""
    def refresh_physical(self) -> None:
        """Ask the backend for its free physical memory now (a driver call on CUDA)."""
    def start(self) -> None:
        """Start the background thread (daemon); no-op when it runs."""
    def stop(self) -> None:
        """Stop the background thread and wait for it; no-op in a forked child."""
    def close(self) -> None:
        """Stop the thread, unmap pool and pending pages, drop the gate, then closed; idempotent; no-op in a forked child."""
    def stats(self) -> _PageAllocatorStats:
        """A consistent snapshot of the counts and counters (taken under one lock); answers when closed."""
    def page_states(self) -> NDArray[np.uint8]:
        """Copy of every page id's state: 0 outside, 1 free, 2 pool, 3 used, 4 pending, 5 transit."""
    def check_invariants(self) -> Literal[True]:
        """O(pages) consistency check; raises AssertionError naming the first broken invariant."""

# -- refill policy -------------------------------------------------------------------------------

@disjoint_base
class RefillPolicy:
    """A PageAllocator's refill policy: its background thread, refill target, idle trim, budget gate.

    Made by its PageAllocator and used only through it (start, stop, set_idle_trim,
    set_pool_bounds, set_budget_gate, stats); see Note [Refill policy] in _refill.pxi."""

    def _run(self, pa: PageAllocator) -> None:
        """The background thread's loop for `pa` (the Thread's target); returns once stopped."""

# -- block allocator -----------------------------------------------------------------------------

@disjoint_base
class BlockAllocator:
    """Hands out KV block ids over the pages of one PageAllocator; thread-safe, layout-agnostic."""

    def __init__(
        self,
        pages: PageAllocator,
        page_first_block: Sequence[int] | NDArray[np.integer[Any]],
        page_num_blocks: Sequence[int] | NDArray[np.integer[Any]],
        id_to_page_num: int,
        id_to_page_den: int,
        max_block_id: int,
    ) -> None:
        """Block b lies in page (b * num) // den; raises KVCachedConfigError for inconsistent intervals."""
    @classmethod
    def dense(
        cls, pages: PageAllocator, block_bytes: int, page_bytes: int | None = None, max_block_id: int | None = None
    ) -> Self:
        """Dense ids: block b covers bytes [b, b + 1) * block_bytes of each buffer."""
    @classmethod
    def sparse(cls, pages: PageAllocator, ids_per_page: int, blocks_per_page: int) -> Self:
        """Sparse page-grouped ids: page p holds [p * ids_per_page, p * ids_per_page + blocks_per_page)."""
    @property
    def pages(self) -> PageAllocator:
        """The page allocator whose pages hold the blocks."""
    @property
    def num_pages(self) -> int:
        """The page table's page ids."""
    @property
    def max_block_id(self) -> int:
        """Block ids are < max_block_id."""
    @property
    def id_to_page_num(self) -> int:
        """Page of block b = b * id_to_page_num // id_to_page_den."""
    @property
    def id_to_page_den(self) -> int:
        """See id_to_page_num."""
    @property
    def max_blocks_per_page(self) -> int:
        """Largest number of blocks one page holds."""
    @property
    def total_blocks(self) -> int:
        """Usable block ids over all pages."""
    @property
    def num_free_in_owned_pages(self) -> int:
        """Free block ids in pages taken from the page allocator (no docstring in the source)."""
    debug_checks: bool
    """Run check_invariants() after every public call."""
    @property
    def lifecycle(self) -> _Lifecycle:
        """"closed" after close(), "forked" in a forked child: then methods raise KVCachedClosedError."""

    def close(self) -> None:
        """Free every block and close the page allocator; then every method raises KVCachedClosedError.
        Idempotent; no-op in a forked child."""
    def alloc(self, n: SupportsIndex) -> list[int] | None:
        """Exactly `n` distinct block ids, or None (state unchanged) when out of memory / limit."""
    def alloc_into(self, buf: _Int32Buffer) -> bool:
        """Fill a contiguous int32 buffer with len(buf) ids; False (nothing changed) when out of memory."""
    def free(self, ids: Iterable[SupportsIndex]) -> None:
        """Free the ids; raises BlockStateError (nothing freed) for an unknown, unallocated or repeated id."""
    def free_from(self, buf: _Int32Buffer) -> None:
        """free() for a contiguous int32 buffer, without Python ints."""
    def available_blocks(self, max_new_pages: SupportsIndex = -1) -> int:
        """Blocks alloc() could hand out now (held + free in owned pages + deliverable pages, at most
        max_new_pages of them newly mapped; -1 no cap); O(log pages)."""
    def try_to_reserve(self, n: SupportsIndex) -> bool:
        """Hold `n` more blocks for the next allocs; False (nothing changed) when out of memory."""
    def free_reserved(self) -> None:
        """Free every held block (pages that become empty go back)."""
    def clear(self) -> None:
        """Free every allocated and held block."""
    def resize(self, num_pages: int) -> bool:
        """PageAllocator.resize under this lock; False (nothing changed) if pages past it hold blocks."""
    def trim(self) -> None:
        """Unmap the page allocator's pool and release cached handles."""
    def page_occupancy(self, page_ids: Iterable[int] | None = None) -> dict[int, tuple[int, int]]:
        """{page_id: (live blocks incl. held, blocks the page holds)} for owned (or the given) pages."""
    def stats(self) -> _BlockAllocatorStats:
        """Block counts and counters, with the page allocator's stats under "pages"; answers when closed."""
    def block_states(self) -> NDArray[np.uint8]:
        """Copy of every block id's state: 0 free, 1 allocated, 2 invalid, 3 held."""
    def check_invariants(self) -> Literal[True]:
        """O(blocks + pages) check, then the page allocator's; raises AssertionError."""
