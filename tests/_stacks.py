"""Allocator stacks for tests: small host backends with real mappings (64 KiB granularity), page
tables built directly from reserved ranges, and page/block allocators over them.

A module of its own, not conftest.py: tests import these names, and two conftest modules (tests/
and benchmarks/) cannot both be imported as ``conftest``."""

from __future__ import annotations

import dataclasses
import threading

from kvcached.core import BlockAllocator, PageAllocator
from kvcached.core import PageTable
from kvcached.core import HostBackend

GRANULARITY = 64 << 10
KV_PAGE_BYTES = 64 << 10          # page size of the runtime-level tests (init_kvcached(page_size_bytes=...))


@dataclasses.dataclass
class Stack:
    """One allocator stack over the host backend, for a test."""

    backend: HostBackend
    ranges: list
    table: PageTable
    pages: PageAllocator
    blocks: BlockAllocator | None

    def close(self) -> None:
        self.pages.stop()


def make_table(backend: HostBackend, num_pages: int, segments: int = 1,
               zero_page: bool = False) -> tuple[PageTable, list]:
    """A page table whose page id p maps `segments` granules, one in each of `segments` ranges
    (segments=1: one compound mapping as interleaved/page_grouped; 2*L: per_layer)."""
    g = backend.granularity
    ranges = [backend.reserve(num_pages * g) for _ in range(segments)]
    return PageTable(backend, [(r, 0) for r in ranges], g, num_pages, zero_page), ranges


class ByteBudget:
    """A budget gate (PageAllocator.set_budget_gate) over `capacity_bytes`, counting what it
    holds, so tests can check that every mapped byte is held and every unmapped one given back."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.held_bytes = 0
        self.lock = threading.Lock()

    def acquire(self, nbytes: int) -> bool:
        with self.lock:
            if self.held_bytes + nbytes > self.capacity_bytes:
                return False
            self.held_bytes += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self.lock:
            assert nbytes <= self.held_bytes, f"released {nbytes} bytes, only {self.held_bytes} held"
            self.held_bytes -= nbytes


def make_stack(num_pages: int = 16, capacity_granules: int | None = 12, segments: int = 1,
               block_bytes: int | None = 16 << 10, min_reserved: int = 0, max_reserved: int = 2,
               idle_trim_s: float = 0.0, capacity_pages: int | None = None,
               sparse: tuple[int, int] | None = None, zero_page: bool = False) -> Stack:
    """Backend with room for `capacity_granules` granules (None: unbounded), a table of
    `num_pages` ids (zero_page: unmapped ids show the zero page), a page allocator and (unless
    block_bytes is None and sparse is None) a dense or sparse block allocator."""
    backend = HostBackend(GRANULARITY, None if capacity_granules is None else capacity_granules * GRANULARITY)
    table, ranges = make_table(backend, num_pages, segments, zero_page)
    pages = PageAllocator(table, capacity_pages, min_reserved=min_reserved, max_reserved=max_reserved,
                          idle_trim_s=idle_trim_s)
    blocks = None
    if sparse is not None:
        blocks = BlockAllocator.sparse(pages, *sparse)
    elif block_bytes is not None:
        blocks = BlockAllocator.dense(pages, block_bytes)
    return Stack(backend, ranges, table, pages, blocks)


def state_of(s: Stack) -> dict:
    """Everything a failed call must leave unchanged (counters excluded)."""
    st = s.pages.stats()
    keep = ("capacity_pages", "free", "in_use", "reserved", "pending_unmap", "transit", "limit_pages",
            "mapped", "reserved_weight")
    result = {k: st[k] for k in keep}
    result["mapped_ids"] = s.table.mapped_page_ids()
    result["page_states"] = s.pages.page_states().tolist()
    # handles rolled back go to the backend's cache; memory behind mappings must not change
    result["mapped_physical_bytes"] = s.backend.physical_bytes - s.backend.cached_bytes
    if s.blocks is not None:
        result["block_states"] = s.blocks.block_states().tolist()
        b = s.blocks.stats()
        result.update({k: b[k] for k in ("allocated", "held", "owned_pages", "free_in_owned_pages")})
        result["available_blocks"] = s.blocks.available_blocks()
    return result


# The manager's paths that take pages out of the reserved pool to unmap them (each must record
# a fence first: Note [Deferred unmap]).
POOL_EXITS = ("limit", "trim", "pool_bounds", "resize", "idle_trim")


def take_out_of_the_pool(m, path: str) -> None:
    """Make KVCacheManager `m` unmap its pool by `path`, one of POOL_EXITS; "idle_trim" waits
    (30 s at most) for the background thread's next idle trim (KVCACHED_IDLE_TRIM_S set short)."""
    import time

    if path == "limit":
        m.set_memory_limit(0, revision=1)
    elif path == "trim":
        m.trim()
    elif path == "pool_bounds":
        m._pages.set_pool_bounds(0, 0)
    elif path == "resize":
        assert m.resize(0)
    else:
        trims = m.stats()["pages"]["num_idle_trims"]
        deadline = time.monotonic() + 30
        while m.stats()["pages"]["num_idle_trims"] == trims:
            assert time.monotonic() < deadline, "no idle trim within 30 s"
            time.sleep(0.001)
