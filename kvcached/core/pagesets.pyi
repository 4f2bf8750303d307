"""Types of the Python-visible surface of kvcached.core.pagesets (Cython): its test hooks only.

The sets themselves (FreeSet, PoolStack, PendingRing) are C structs with inline operations
declared in pagesets.pxd, invisible to Python. These functions run one operation or check on a
set held in a dict of numpy arrays and ints (made by the ``new_*`` functions), so tests can
drive and corrupt a set without an allocator. Keep in step with pagesets.pxd and pagesets.pyx.
"""

from collections.abc import Sequence
from typing import Any

def new_free_set(weight: Sequence[int]) -> dict[str, Any]:
    """An empty free set over len(weight) > 0 ids of these weights."""
def free_set_step(f: dict[str, Any], op: str, arg: int = 0) -> Any:
    """add / remove id, pop_lowest, count_for_weight need, weight_of_lowest k, members, check (AssertionError)."""
def new_pool(weight: Sequence[int]) -> dict[str, Any]:
    """An empty pool over len(weight) > 0 ids of these weights."""
def pool_step(f: dict[str, Any], op: str, arg: int = 0, keep: int = 0) -> Any:
    """push id, pop, drop below keep (the ids dropped), check (AssertionError)."""
def new_pending_ring(size: int) -> dict[str, Any]:
    """An empty pending ring for ids [0, size), size > 0."""
def pending_step(f: dict[str, Any], op: str, ids: Sequence[int] = (), fence: int = 0) -> Any:
    """push ids behind fence, pop (fence, ids), retry ids, take_retries, copy, check (AssertionError)."""
def ledger_check_step(
    state: Sequence[int],
    weight: Sequence[int],
    capacity: int,
    mapped: Sequence[int],
    pool_ids: Sequence[int] = (),
    pending_ids: Sequence[int] = (),
    num_used: int | None = None,
    num_transit: int = 0,
) -> None:
    """A ledger over these per-id arrays, checked: AssertionError naming the first broken invariant."""
