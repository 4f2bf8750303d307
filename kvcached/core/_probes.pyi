"""Types of the Python-visible surface of kvcached.core._probes (Cython): test hooks only.

The page allocator's sets and the block allocator's FreeBuckets are C structs with inline
operations (pagesets.pxd, freebuckets.pxd), invisible to Python. The ``*_step`` functions run one
operation or check on a set held in a dict of numpy arrays and ints (made by the ``new_*``
functions); PageBuckets is FreeBuckets with a Python surface. Tests drive and corrupt them
without an allocator. Keep in step with _probes.pyx.
"""

from collections.abc import Sequence
from typing import Any

from typing_extensions import disjoint_base

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

@disjoint_base
class PageBuckets:
    """Pages filed under a free count in [1, max_count], or in no bucket; arguments checked."""

    def __init__(self, num_pages: int, max_count: int) -> None:
        """Raises ValueError for num_pages < 0 or max_count < 1."""
    def insert(self, page_id: int, count: int) -> None:
        """File page_id (in no bucket) under count; ValueError otherwise, nothing changed."""
    def remove(self, page_id: int) -> None:
        """Take page_id out of its bucket; ValueError when it is in none."""
    def at_least(self, count: int) -> int:
        """The lowest non-empty bucket >= count, or -1."""
    def highest(self) -> int:
        """The highest non-empty bucket, or -1."""
    def first(self, count: int) -> int:
        """The first page of bucket `count`, or -1."""
    def check_invariants(self, counts: Sequence[int] | None = None) -> bool:
        """True, or AssertionError naming the first disagreement (against `counts` when given)."""
