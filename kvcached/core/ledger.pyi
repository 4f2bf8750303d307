"""Types of the Python-visible surface of kvcached.core.ledger (Cython): LedgerBackend, the backend
of a tensor-parallel leader without pages. Keep in step with ledger.pxd and ledger.pyx."""

from typing_extensions import disjoint_base

from kvcached.core.hostmem import HostBackend

BACKEND_KINDS: tuple[str, ...]

@disjoint_base
class LedgerBackend(HostBackend):
    """Reservations without memory and numbered handles (see Note [Leader without pages])."""

    def __init__(self, granularity: int, kind: str, integrated_memory: bool = False) -> None: ...
    @property
    def holds_memory(self) -> bool: ...
