"""Types of the Python-visible surface of kvcached.core.freebuckets (Cython): PageBuckets.

The FreeBuckets struct and its inline operations are ``cdef`` (freebuckets.pxd) and invisible to
Python; PageBuckets is the struct with a Python surface. Keep in step with freebuckets.pxd (C
interface) and freebuckets.pyx (behaviour).
"""

from collections.abc import Sequence

from typing_extensions import disjoint_base

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
