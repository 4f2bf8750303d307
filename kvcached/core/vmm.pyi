"""Types of the Python-visible surface of kvcached.core.vmm (Cython): backends, virtual ranges.

HostBackend is kvcached.core.hostmem's (hostmem.pyi).

Only ``def`` methods, properties and ``readonly``/``public`` attributes are here: ``cdef`` methods
are invisible to Python. Every class is a C extension type with its own fields (@disjoint_base:
no class may inherit from two of them). Units: every ``*_bytes`` value, address and handle size is in bytes;
addresses, handles, fences and streams are plain ints. Out of memory is a value (None or False),
never an exception, except where a docstring says ``Raises OutOfDeviceMemory``.
Keep in step with vmm.pxd (C interface) and vmm.pyx (behaviour).
"""

from typing import TYPE_CHECKING, Final, Literal, SupportsIndex, TypedDict

from typing_extensions import TypeAlias, disjoint_base

if TYPE_CHECKING:
    import torch

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

# -- module level --------------------------------------------------------------------------------

DEFAULT_HANDLE_CACHE_SIZE: Final = 8
"""Released physical handles a new backend keeps for reuse (see set_handle_cache_capacity)."""
MAX_HANDLE_CACHE_SIZE: Final = 256
"""The most handles set_handle_cache_capacity accepts (the cache is a fixed array of this length)."""

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
        """Keep at most `capacity` (0..MAX_HANDLE_CACHE_SIZE) released handles for reuse; 0 disables the cache."""
    def record_fence(self, stream: int = 0) -> int:
        """Record a fence on `stream` (CUstream as int; 0 = default stream); returns the fence id."""
    def fence_done(self, fence: int) -> bool:
        """True when the device work queued before the fence has finished."""
    def release_fence(self, fence: int) -> None:
        """Destroy a fence from record_fence() (no docstring in the source)."""
    def wait_for_stream(self, stream: int = 0) -> None:
        """Return once the device work queued on `stream` so far has finished (a fence polled
        without the GIL; at once on the host)."""
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
