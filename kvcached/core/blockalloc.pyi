"""Types of the Python-visible surface of kvcached.core.blockalloc (Cython): BlockAllocator.

Only ``def`` methods, properties and ``readonly``/``public`` attributes are here: ``cdef`` methods
are invisible to Python. Every class is a C extension type with its own fields (@disjoint_base:
no class may inherit from two of them). Units: every ``*_bytes`` value, address and handle size is in bytes;
addresses, handles, fences and streams are plain ints. Out of memory is a value (None or False),
never an exception, except where a docstring says ``Raises OutOfDeviceMemory``.
Keep in step with blockalloc.pxd (C interface) and blockalloc.pyx (behaviour).
"""

from collections.abc import Iterable, Sequence
from typing import Any, Literal, Protocol, SupportsIndex, TypedDict

import numpy as np
from numpy.typing import NDArray
from typing_extensions import Buffer, Self, TypeAlias, disjoint_base

from kvcached.core.pagealloc import PageAllocator, _PageAllocatorStats
from kvcached.core.vmm import _Lifecycle

# -- argument and result shapes (stub-only names) ------------------------------------------------

class _HasNumpy(Protocol):
    """A CPU tensor: anything with ``.numpy()`` giving a contiguous int32 array."""
    def numpy(self) -> Any: ...

_Int32Buffer: TypeAlias = Buffer | _HasNumpy
"""Contiguous int32 storage: numpy array, array.array('i'), or a CPU torch tensor."""

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
    num_failed_blocks: int  # blocks the failed allocs asked for (an n above total_blocks not counted)
    pages: _PageAllocatorStats

# -- block allocator -----------------------------------------------------------------------------

@disjoint_base
class BlockSlots:
    """Which block ids are free and where: BlockAllocator's bookkeeping (made only through it)."""

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

class BlockAllocator(BlockSlots):
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
        """Block b lies in page (b * num) // den; raises KVCachedConfigError for inconsistent intervals
        or arrays (~9 bytes per block id) that would not fit in the host memory left."""
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
    debug_checks: bool
    """Run check_invariants() after every public call."""
    @property
    def num_failed_blocks(self) -> int:
        """The blocks failed allocs asked for, ever; read without the allocator's lock (a
        manager's share job polls it: Note [Fair share] in kv_cache_manager)."""
    @property
    def lifecycle(self) -> _Lifecycle:
        """"closed" after close(), "forked" in a forked child: then methods raise KVCachedClosedError."""

    def close(self) -> None:
        """Free every block and close the page allocator; then every method raises KVCachedClosedError.
        Idempotent; no-op in a forked child."""
    def alloc(self, n: SupportsIndex) -> list[int] | None:
        """Exactly `n` distinct block ids, or None (state unchanged) when out of memory / limit or n is
        above total_blocks (of any size); ValueError for n < 0."""
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
        """Hold `n` more blocks for the next allocs; False (nothing changed) when out of memory or n is
        above total_blocks; ValueError for n < 0."""
    def alloc_on(self, page_id: SupportsIndex, n: SupportsIndex) -> list[int] | None:
        """`n` free ids of an in-use page, mapping nothing; None (nothing changed) when the page is not
        in use or has fewer free ids; MappingError for a page id out of range."""
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
