"""Types of the Python-visible surface of kvcached.core.pagetable (Cython): the page table.

Only ``def`` methods, properties and ``readonly``/``public`` attributes are here: ``cdef`` methods
are invisible to Python. Every class is a C extension type with its own fields (@disjoint_base:
no class may inherit from two of them). Units: every ``*_bytes`` value, address and handle size is in bytes;
addresses, handles, fences and streams are plain ints. Out of memory is a value (None or False),
never an exception, except where a docstring says ``Raises OutOfDeviceMemory``.
Keep in step with pagetable.pxd (C interface) and pagetable.pyx (behaviour).
"""

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray
from typing_extensions import TypeAlias, disjoint_base

from kvcached.core.vmm import Backend, VirtualRange, _Lifecycle

_PageIds: TypeAlias = Sequence[int] | NDArray[np.integer[Any]]
"""Page ids: a list/tuple/range of int, or an integer numpy array."""

# -- page table ----------------------------------------------------------------------------------

class PageMirror(Protocol):
    """Repeats a page table's maps and unmaps on peer ranks; see Note [Mirrored page table]."""

    def map_start(self, page_ids: list[int]) -> None: ...
    def map_finish(self, mapped_here: bool) -> bool: ...
    def unmap_start(self, page_ids: list[int]) -> None: ...
    def unmap_finish(self) -> None: ...

@disjoint_base
class PageTable:
    """Maps the page ids of one KV group through a backend, all or nothing; thread-safe (one lock)."""

    def __init__(
        self,
        backend: Backend,
        segments: list[tuple[VirtualRange, int]],
        map_bytes: int,
        num_pages: int,
        zero_page: bool = False,
    ) -> None:
        """segments: [(range, offset_bytes)], one per mapping of a page id; raises OutOfDeviceMemory for the zero page."""
    @property
    def backend(self) -> Backend:
        """The backend every segment belongs to."""
    @property
    def num_pages(self) -> int:
        """Page ids are [0, num_pages)."""
    @property
    def num_segments(self) -> int:
        """Mappings per page id."""
    @property
    def map_bytes(self) -> int:
        """Bytes of each mapping."""
    @property
    def num_mapped(self) -> int:
        """Page ids mapped now."""
    @property
    def zero_page(self) -> bool:
        """Unmapped page ids show a shared read-only zero page."""
    @property
    def mapped_bytes(self) -> int:
        """Physical bytes mapped for page ids (the zero page not counted)."""
    @property
    def page_bytes(self) -> int:
        """Physical bytes one page id maps, over all its segments."""
    @property
    def lifecycle(self) -> _Lifecycle:
        """"closed" after close() (map raises), "forked" in a forked child (everything raises)."""
    @property
    def num_rollback_failures(self) -> int:
        """Undo steps of failed maps that failed too, ever."""
    @property
    def last_rollback_error(self) -> BaseException | None:
        """The latest of them."""
    @property
    def num_unmap_failures(self) -> int:
        """Segment unmaps the driver refused (the segment stayed mapped, to be unmapped again), ever."""
    @property
    def last_unmap_error(self) -> BaseException | None:
        """The latest of them."""

    def map(self, page_ids: _PageIds) -> bool:
        """Map the page ids, all or nothing; False (nothing changed) when out of memory; KVCachedClosedError when closed."""
    def unmap(self, page_ids: _PageIds) -> None:
        """Unmap the page ids; MappingError (nothing changed) for an id out of range, repeated or unmapped;
        DriverError when the driver refused some (those stay mapped: unmap them again)."""
    @property
    def mirror(self) -> PageMirror | None:
        """What repeats this table's maps and unmaps on peers (tensor parallelism), or None."""
    def set_mirror(self, mirror: PageMirror | None) -> None:
        """Attach (only while no page id is mapped: MappingError) or detach the mirror."""
    def is_mapped(self, page_id: int) -> bool:
        """Whether `page_id` is mapped (no docstring in the source)."""
    def mapped_page_ids(self) -> list[int]:
        """The mapped page ids, ascending (no docstring in the source)."""
    def segment_addresses(self, page_id: int) -> list[int]:
        """Where each mapping of `page_id` lies (addresses)."""
    def close(self) -> None:
        """Unmap every page id and the zero page, then close (map raises KVCachedClosedError); idempotent; no-op in a forked child."""
    def check_invariants(self) -> None:
        """O(pages · segments) consistency check; raises AssertionError."""
