"""Types of the Python-visible surface of kvcached._core (the Cython extension).

Only ``def`` methods, properties and ``readonly``/``public`` attributes are here: ``cdef`` methods
are invisible to Python. Every class is a C extension type with its own fields (@disjoint_base:
no class may inherit from two of them). Units: every ``*_bytes`` value, address and handle size is in bytes;
addresses, handles, fences and streams are plain ints. Out of memory is a value (None or False),
never an exception, except where a docstring says ``Raises OutOfDeviceMemory``.
Keep in step with _core.pxd (C interface) and the .pxi sources (behaviour).
"""

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol, SupportsIndex, TypedDict, overload

import numpy as np
from numpy.typing import NDArray
from typing_extensions import Buffer, Self, TypeAlias, disjoint_base

if TYPE_CHECKING:
    import torch

# -- argument and result shapes (stub-only names) ------------------------------------------------

class _HasNumpy(Protocol):
    """A CPU tensor: anything with ``.numpy()`` giving a contiguous int32 array."""
    def numpy(self) -> Any: ...

_Int32Buffer: TypeAlias = Buffer | _HasNumpy
"""Contiguous int32 storage: numpy array, array.array('i'), or a CPU torch tensor."""

_PageIds: TypeAlias = Sequence[int] | NDArray[np.integer[Any]]
"""Page ids: a list/tuple/range of int, or an integer numpy array."""

class _BackendStats(TypedDict):
    """Backend.stats(): kind, granularity (bytes), handle counters, physical and cached bytes."""
    kind: Literal["cuda", "host"]
    granularity: int
    num_creates: int
    num_releases: int
    num_cache_hits: int
    physical_bytes: int
    cached_bytes: int
    cached_handles: int

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

# -- module level --------------------------------------------------------------------------------

DEFAULT_HANDLE_CACHE_SIZE: Final = 8
"""Released physical handles a new backend keeps for reuse (see set_handle_cache_capacity)."""

def cuda_unavailable_reason() -> str | None:
    """None when the CUDA driver is usable and has a device, else why not (probed once, cached)."""

def cuda_device_count() -> int:
    """Number of CUDA devices; 0 when the driver is unavailable."""

def fork_generation() -> int:
    """Forks between this process and the one that loaded kvcached (0 there); objects made in an
    earlier generation are unusable here (their ``lifecycle`` is "forked")."""

_Lifecycle: TypeAlias = Literal["live", "closed", "forked"]

# -- backends ------------------------------------------------------------------------------------

@disjoint_base
class Backend:
    """One VMM backend: reserve ranges, create/map/unmap/release physical handles, fences."""

    @property
    def granularity(self) -> int:
        """Bytes; sizes and addresses passed in must be multiples of it."""
    @property
    def kind(self) -> Literal["cuda", "host"]:
        """Which backend this is."""
    @property
    def device_id(self) -> int:
        """CUDA device ordinal; -1 for the host backend."""
    @property
    def cache_capacity(self) -> int:
        """Most released handles kept for reuse (handles, not bytes)."""
    @property
    def cached_bytes(self) -> int:
        """Bytes held by cached (released but not yet freed) handles."""
    @property
    def physical_bytes(self) -> int:
        """Bytes created and not released, cached handles included."""
    @property
    def num_creates(self) -> int:
        """Physical handles created, ever."""
    @property
    def num_releases(self) -> int:
        """Physical handles released, ever."""
    @property
    def num_cache_hits(self) -> int:
        """Handle acquisitions served from the cache, ever."""
    @property
    def integrated_memory(self) -> bool:
        """Device memory is host memory (CU_DEVICE_ATTRIBUTE_INTEGRATED); False for the host backend."""
    @property
    def lifecycle(self) -> Literal["live", "forked"]:
        """"forked" when inherited by a forked child: then every method raises KVCachedClosedError."""

    def reserve(self, size_bytes: int) -> VirtualRange:
        """Reserve a virtual range of `size_bytes` (multiple of granularity); raises MappingError if not."""
    def create(self, size_bytes: int) -> int:
        """A new physical handle of `size_bytes`, cache bypassed; raises OutOfDeviceMemory when out of memory."""
    def release(self, handle: int, size_bytes: int) -> None:
        """Release a handle made by create(), cache bypassed; raises MappingError for handle 0 or a bad size."""
    def map(self, address: int, size_bytes: int, handle: int, writable: bool = True) -> None:
        """Map `handle` at `address` (bytes, granularity-aligned) and set its access; raises OutOfDeviceMemory."""
    def map_only(self, address: int, size_bytes: int, handle: int) -> None:
        """Map without setting access (benchmarks time the two steps apart); raises OutOfDeviceMemory."""
    def set_access(self, address: int, size_bytes: int, writable: bool = True) -> None:
        """Set read-write (or read-only) access on a mapped span; raises OutOfDeviceMemory."""
    def unmap(self, address: int, size_bytes: int) -> None:
        """Unmap a mapped span; the handle stays alive; raises DriverError (the mapping stays)."""
    def acquire(self, size_bytes: int) -> int | None:
        """A handle of `size_bytes` through the cache; None when out of memory."""
    def recycle(self, handle: int, size_bytes: int) -> None:
        """Give a handle back through the cache; raises MappingError for handle 0 or a bad size."""
    def release_cached(self) -> None:
        """Release every cached handle back to the device."""
    def set_handle_cache_capacity(self, capacity: int) -> None:
        """Keep at most `capacity` (0..256) released handles for reuse; 0 disables the cache."""
    def record_fence(self, stream: int = 0) -> int:
        """Record a fence on `stream` (CUstream as int; 0 = default stream); returns the fence id."""
    def fence_done(self, fence: int) -> bool:
        """True when the device work queued before the fence has finished."""
    def release_fence(self, fence: int) -> None:
        """Destroy a fence from record_fence() (no docstring in the source)."""
    def free_physical_bytes(self) -> int:
        """Physical bytes this backend could still create (a driver/syscall query: not hot)."""
    def inject_out_of_memory(self, after: int) -> None:
        """Fault injection: acquisitions after `after` more successes report out of memory; -1 turns it off."""
    def inject_fault(self, op: Literal["map", "set_access", "unmap"], after: int, times: int = 1,
                     oom: bool = False) -> None:
        """Fault injection (tests): after `after` more successful `op` calls the next `times` (-1: all) fail,
        with DriverError or (oom=True, map/set_access) out of memory; after=-1 disarms `op`."""
    def stats(self) -> _BackendStats:
        """Counters: creates, releases, cache hits, physical and cached bytes, cached handles."""

@disjoint_base
class CudaBackend(Backend):
    """The CUDA VMM backend on one device's primary context."""

    def __init__(self, device_id: int = 0) -> None:
        """Raises DriverUnavailableError without a usable driver, KVCachedConfigError for a bad device_id."""
    def memset(self, address: int, value: int, size_bytes: int) -> None:
        """Fill device memory with byte `value`, synchronously (tests)."""

@disjoint_base
class HostBackend(Backend):
    """Host-memory VMM backend (mmap + one memfd pool) with the GPU backend's semantics."""

    def __init__(self, granularity: int = 2097152, capacity_bytes: int | None = None) -> None:
        """granularity: bytes, a multiple of the OS page; capacity_bytes: default all host memory."""
    @property
    def capacity_bytes(self) -> int:
        """Most physical bytes the pool hands out (rounded down to the granularity)."""
    @property
    def pool_fd(self) -> int:
        """The memfd that stores every page (tests read its st_blocks)."""

# -- virtual ranges ------------------------------------------------------------------------------

@disjoint_base
class VirtualRange:
    """A reserved virtual address range of one backend; its base address never changes."""

    def __init__(self) -> None:
        """Always raises TypeError: ranges are made by Backend.reserve()."""
    @property
    def backend(self) -> Backend:
        """The backend that reserved the range."""
    @property
    def address(self) -> int:
        """Base address; fixed for the range's life."""
    @property
    def size_bytes(self) -> int:
        """Size of the reservation in bytes."""

    def free(self) -> None:
        """Give the reservation back now; every page must be unmapped and every exported tensor dropped."""
    def check_offset(self, offset_bytes: SupportsIndex, size_bytes: SupportsIndex) -> None:
        """Raise MappingError unless [offset, offset + size) bytes is granularity-aligned and inside."""
    def dlpack(self) -> object:
        """A "dltensor" PyCapsule of the whole range as a 1-D uint8 tensor (kDLCPU or kDLCUDA)."""
    def tensor(self) -> torch.Tensor:
        """The whole range as a zero-copy 1-D torch.uint8 tensor that keeps this range alive."""

# -- page table ----------------------------------------------------------------------------------

@disjoint_base
class PageMirror(Protocol):
    """Repeats a page table's maps and unmaps on peer ranks; see Note [Mirrored page table]."""

    def map_start(self, page_ids: list[int]) -> None: ...
    def map_finish(self, mapped_here: bool) -> bool: ...
    def unmap_start(self, page_ids: list[int]) -> None: ...
    def unmap_finish(self) -> None: ...

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
    def driver_floor(self, page_id: int, repeats: int = 50) -> dict[str, list[float]]:
        """Benchmark hook: µs per pass under "raw_map_us", "raw_unmap_us", "primitives_map_us"."""
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
