"""Types of the Python-visible surface of kvcached.core.hostmem (Cython): the host backend.

Only ``def`` methods, properties and ``readonly``/``public`` attributes are here; the rest of its
surface is Backend's (vmm.pyi). Units: bytes. Keep in step with hostmem.pxd (C interface) and
hostmem.pyx (behaviour).
"""

from typing_extensions import disjoint_base

from kvcached.core.vmm import Backend

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
