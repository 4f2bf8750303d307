"""Types of the Python-visible surface of kvcached.core.refill (Cython): RefillPolicy and Refillable.

Only ``def`` methods and properties are here: ``cdef`` methods are invisible to Python. Both are C
extension types with their own fields (@disjoint_base: no class may inherit from two of them).
Keep in step with refill.pxd (C interface) and refill.pyx (behaviour).
"""

from typing_extensions import disjoint_base

from kvcached.core.pagetable import PageTable

@disjoint_base
class Refillable:
    """What a RefillPolicy reads and drives: the base of kvcached.core.pagealloc's PageMapper
    and PageAllocator, never made on its own (Note [Refill policy] in refill.pyx)."""

    @property
    def table(self) -> PageTable:
        """The page table whose ids are handed out."""
    @property
    def num_table_pages(self) -> int:
        """The table's num_pages: capacity never exceeds it."""
    last_error: BaseException | None
    """Last exception caught off the caller's path (background thread, returning pages after a free), or None."""

@disjoint_base
class RefillPolicy:
    """A PageAllocator's refill policy: its background thread, refill target, idle trim, budget gate.

    Made by its PageAllocator and used only through it (start, stop, set_idle_trim,
    set_pool_bounds, set_budget_gate, stats); see Note [Refill policy] in refill.pyx."""

    def _run(self, pa: Refillable) -> None:
        """The background thread's loop for `pa` (the Thread's target); returns once stopped."""
