"""Exception hierarchy of kvcached.

Out of memory inside the allocator is a value (``alloc`` returns None); these exceptions are for
everything else, and for callers of the low-level backends that asked for memory directly. So
there is no "pool exhausted" exception: a request that cannot be served, now or ever, gets None
(``ElasticBlockPool.get_new_blocks`` raises vLLM's ValueError, as vLLM's own pool does). Every
exception here is a KVCachedError.
"""


class KVCachedError(RuntimeError):
    """Base of every kvcached error."""


class KVCachedConfigError(KVCachedError):
    """A setting or constructor argument is invalid; the message names the value that would work."""


class KVCachedArgumentError(KVCachedConfigError, TypeError, ValueError):
    """An argument of a call is of the wrong type or out of range (a bool or a float where a
    count is wanted, a negative limit). It is a TypeError and a ValueError too, so that callers
    written against either keep working. Nothing was changed."""


class KVCachedClosedError(KVCachedError):
    """The object was closed (``close()``, ``shutdown_kvcached()``) or was inherited by a forked
    child; it touches no memory any more. The message names what to make instead. Nothing was
    changed."""


class DriverUnavailableError(KVCachedError):
    """No usable CUDA driver on this machine; the host backend (device='cpu') still works."""


class DriverError(KVCachedError):
    """A CUDA driver call failed. ``call`` names it, ``code``/``name`` are the driver's error."""

    def __init__(self, call: str, code: int, name: str, message: str = ""):
        self.call, self.code, self.name = call, code, name
        super().__init__(f"{call} failed: {name} ({code}){': ' + message if message else ''}")


class OutOfDeviceMemory(DriverError, MemoryError):
    """Physical memory could not be had (CUDA_ERROR_OUT_OF_MEMORY, or the host pool is full)."""


class MappingError(KVCachedError, ValueError):
    """A mapping request is inconsistent with the current state (already mapped, not mapped,
    out of range, misaligned). Nothing was changed."""


class BlockStateError(KVCachedError, ValueError):
    """A block id is unknown or not allocated (double free). Nothing was changed."""


class KVCachedTPError(KVCachedError):
    """A tensor-parallel peer rank failed a page operation, died or did not answer within
    KVCACHED_TP_TIMEOUT_S. ``rank`` is the peer, ``operation`` what was asked of it. After a
    peer died or timed out the instance's ranks no longer agree on what is mapped: every later
    call that needs the peers raises this too; restart every rank."""

    def __init__(self, message: str, rank: int | None = None, operation: str | None = None):
        self.rank, self.operation = rank, operation
        super().__init__(message)


__all__ = [
    "KVCachedError",
    "KVCachedConfigError",
    "KVCachedArgumentError",
    "KVCachedClosedError",
    "DriverUnavailableError",
    "DriverError",
    "OutOfDeviceMemory",
    "MappingError",
    "BlockStateError",
    "KVCachedTPError",
]
