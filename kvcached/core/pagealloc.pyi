"""Types of the Python-visible surface of kvcached.core.pagealloc (Cython): PageAllocator over PageMapper.

Only ``def`` methods, properties and ``readonly``/``public`` attributes are here: ``cdef`` methods
are invisible to Python. Every class is a C extension type with its own fields, PageAllocator
over PageMapper over refill.Refillable (@disjoint_base there: no class may inherit from two). Units: every ``*_bytes`` value is in bytes; fences and
streams are plain ints. Out of memory is a value (None or False), never an exception, except
where a docstring says ``Raises OutOfDeviceMemory``.
Keep in step with pagealloc.pxd (C interface) and pagealloc.pyx (behaviour).
"""

from collections.abc import Callable
from typing import Literal, SupportsIndex, TypedDict, overload

import numpy as np
from numpy.typing import NDArray

from kvcached.core.pagetable import PageTable, _PageIds
from kvcached.core.refill import Refillable
from kvcached.core.vmm import Backend, _Lifecycle

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

# -- page allocator ------------------------------------------------------------------------------

class PageMapper(Refillable):
    """The driver work of a PageAllocator (its one subclass): page ids mapped and unmapped through
    transit, behind fences. Not made on its own; its fields visible to Python (backend,
    page_bytes, stream) are listed on PageAllocator, the table and last_error on Refillable."""

class PageAllocator(PageMapper):
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
    def backend(self) -> Backend:
        """The table's backend."""
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
        """O(pages log pages): each page set's own check, then the states across them; raises AssertionError naming the first broken invariant."""
