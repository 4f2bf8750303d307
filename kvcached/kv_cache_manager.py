"""KVCacheManager: the engine-facing allocator of KV blocks over one group's elastic tensors.

Policy lives here, in Python; the per-block work is in the Cython allocators
(``kvcached._core.BlockAllocator`` over ``PageAllocator``), which are thread-safe by themselves.
See Note [Hot path binding] and Note [Limits].
"""

from __future__ import annotations

import logging
import operator
import threading

from . import config, runtime
from .errors import KVCachedConfigError
from .mem_info_tracker import NO_LIMIT, MemInfoTracker, classify_limit_request

logger = logging.getLogger("kvcached")

_UNITS = {"bytes": 1, "b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}
PUBLISH_INTERVAL_S = 0.01


def _positive(value, name: str, minimum: int = 1) -> int:
    """value as an int >= minimum; any integer type (numpy's too, as engines pass), never a bool
    or a float."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < minimum:
        kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise KVCachedConfigError(f"{name}={value!r} must be {kind}")
    return number


def _clipped_intervals(layout, num_blocks: int):
    """(first, count, pages) of the layout's pages, keeping only ids below num_blocks (dense
    layouts) or the first num_blocks usable ids (sparse page_grouped ids), so the manager never
    hands out more than it was asked to manage."""
    import numpy as np

    first = np.asarray(layout.page_first_block, dtype=np.int64).copy()
    count = np.asarray(layout.page_num_blocks, dtype=np.int64).copy()
    if layout.name == "page_grouped":
        budget = np.clip(num_blocks - (np.cumsum(count) - count), 0, None)
        count = np.minimum(count, budget)
    else:
        count = np.clip(np.minimum(first + count, num_blocks) - first, 0, None)
    used = np.nonzero(count)[0]
    pages = int(used[-1]) + 1 if used.size else 0
    return first, count.astype(np.int32), pages


class KVCacheManager:
    """Hands out KV block ids of one group; maps and unmaps the pages behind them.

    A block id b addresses row b of every layer's tensor of the group (``kv[l][0, b]`` is its K
    and ``kv[l][1, b]`` its V in the FlashAttention shape); with the page_grouped layout ids are
    sparse (see kvcached.layout). Every method is thread-safe.

    Raises (constructor): KVCachedConfigError for a non-positive size, a geometry that differs
    from the group's tensors, a group that already has a live manager (Note [One manager per
    group]), or world_size != 1.
    """

    def __init__(self, num_blocks: int, block_size: int, cell_size: int, num_layers: int, world_size: int = 1,
                 pp_rank: int = 0, async_sched: bool = False, reserve_null_block: bool = False,
                 num_kv_buffers: int = 2, group_id: int = 0, pool_name: str | None = None):
        from ._core import BlockAllocator, PageAllocator

        num_blocks, block_size, cell_size, num_layers, num_kv_buffers = (
            _positive(value, name) for value, name in (
                (num_blocks, "num_blocks"), (block_size, "block_size"), (cell_size, "cell_size"),
                (num_layers, "num_layers"), (num_kv_buffers, "num_kv_buffers")))
        group_id = _positive(group_id, "group_id", minimum=0)
        if world_size != 1:
            raise KVCachedConfigError(
                f"world_size={world_size}: each rank runs its own KVCacheManager with world_size=1 "
                f"(pages are mapped by the process that allocates them)")
        settings = config.settings()
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cell_size = cell_size
        self.num_layers = num_layers
        self.num_kv_buffers = num_kv_buffers
        self.group_id = group_id
        self.pool_name = pool_name
        self.pp_rank = pp_rank
        self.async_sched = async_sched      # accepted for compatibility; allocation is synchronous
        self.block_bytes = block_size * cell_size
        self._group = runtime.kv_group(group_id, num_layers, num_kv_buffers, self.block_bytes, num_blocks)
        self._refuse_second_manager()
        layout = self._group.layout
        self.layout = layout.name
        first, count, num_pages = _clipped_intervals(layout, num_blocks)
        self.num_pages = num_pages
        self.page_bytes = self._group.page_table.page_bytes
        self._pages = PageAllocator(self._group.page_table, num_pages=num_pages,
                                    min_reserved=settings.min_reserved_pages,
                                    max_reserved=settings.max_reserved_pages,
                                    idle_trim_s=settings.idle_trim_s)
        self._blocks = BlockAllocator(self._pages, first, count, layout.id_to_page_num, layout.id_to_page_den,
                                      layout.max_block_id)
        self._set_stream()
        # See Note [Hot path binding].
        self.alloc = self._blocks.alloc
        self.free = self._blocks.free
        self.alloc_into = self._blocks.alloc_into
        self.free_from = self._blocks.free_from
        self.available_size = self._blocks.available_blocks
        self.null_block = None
        if reserve_null_block:
            self._reserve_null_block()
        self._limit_lock = threading.Lock()
        self._limit_bytes = NO_LIMIT
        self._limit_revision = 0
        self._limit_status = "applied"
        self._budget = None
        if settings.global_budget is not None:
            self._attach_budget(settings.global_budget)
        self._tracker = None
        self._closed = threading.Event()
        self._publisher = None
        if settings.tracker:
            self._tracker = MemInfoTracker(self._ipc_name(settings.ipc_name),
                                           capacity_bytes=num_pages * self.page_bytes, page_size_bytes=self.page_bytes)
            self._tracker.start_watcher(self._apply_limit)
            self._publisher = threading.Thread(target=self._publish_loop, name=f"kvcached-publish-{group_id}",
                                               daemon=True)
            self._publisher.start()
        self._pages.start()
        with runtime._lock:
            if self._group.managers:          # another constructor won the race
                self.close()
                self._refuse_second_manager()
            self._group.managers.append(self)
        logger.info("manager of group %d: %d blocks in %d pages of %d bytes, segment %s", group_id, num_blocks,
                    num_pages, self.page_bytes, self.ipc_name)

    def _refuse_second_manager(self) -> None:
        """See Note [One manager per group]."""
        for other in self._group.managers:
            raise KVCachedConfigError(
                f"group {self.group_id} already has a manager (num_blocks={other.num_blocks}, "
                f"pool_name={other.pool_name!r}); two managers of one group would hand out the same blocks. "
                f"Share it (get_kv_cache_manager with the same arguments), close() it first, or give the "
                f"new manager its own group_id and alloc_kv_cache tensors.")

    def _ipc_name(self, base: str | None) -> str | None:
        if base is None:
            return None
        return base if self.pool_name is None else f"{base}.{self.pool_name}"

    def _set_stream(self) -> None:
        if self._group.page_table.backend.kind != "cuda":
            return
        import torch

        self.set_stream(torch.cuda.current_stream().cuda_stream)

    def set_stream(self, stream: int) -> None:
        """The CUDA stream (a ``cudaStream_t`` as int) whose queued work a page unmap waits for.

        Defaults to torch's current stream when the manager is made; engines that run attention
        on another stream set it here. 0 is the legacy default stream."""
        self._pages.stream = int(stream)

    def _reserve_null_block(self) -> None:
        ids = self._blocks.alloc(1)
        if ids != [0]:
            if ids:
                self._blocks.free(ids)
            raise KVCachedConfigError(
                f"reserve_null_block: block 0 could not be reserved (got {ids}); the layout's first page "
                f"must hold block 0")
        self.null_block = 0

    def _attach_budget(self, name: str) -> None:
        from .budget import Budget

        self._budget = Budget.open(name, config.settings().global_budget_bytes)
        # Cached handles hold device memory the budget no longer counts: no cache under a budget.
        self._group.page_table.backend.set_handle_cache_capacity(0)
        self._pages.set_budget_gate(self._budget.try_acquire, self._budget.release)

    # -- the allocation API (bound to the Cython allocator in __init__) -----------------------
    def alloc(self, n: int) -> list[int] | None:
        """Exactly n distinct block ids, or None (state unchanged) when they cannot be had now."""
        return self._blocks.alloc(n)

    def free(self, ids) -> None:
        """Free block ids. Raises BlockStateError, freeing nothing, for an unknown, unallocated or
        repeated id."""
        self._blocks.free(ids)

    def alloc_into(self, buf) -> bool:
        """Fill a contiguous int32 buffer (numpy array or CPU tensor) with len(buf) ids; False
        (nothing changed) when they cannot be had."""
        return self._blocks.alloc_into(buf)

    def free_from(self, buf) -> None:
        """free() for a contiguous int32 buffer."""
        self._blocks.free_from(buf)

    def available_size(self) -> int:
        """Blocks alloc could hand out now, from counters (no driver call): alloc(available_size())
        succeeds and alloc(available_size() + 1) returns None if nothing changes in between."""
        return self._blocks.available_blocks()

    def try_to_reserve(self, n: int) -> bool:
        """Set n blocks aside (their pages mapped) for the next allocs; False if they cannot be had."""
        return self._blocks.try_to_reserve(n)

    def free_reserved(self) -> None:
        """Give back the blocks set aside by try_to_reserve."""
        self._blocks.free_reserved()

    def resize(self, new_mem_size: int) -> bool:
        """Let this manager span `new_mem_size` bytes of KV memory (all layers and buffers), i.e.
        new_mem_size // page_bytes pages. False, with nothing changed, when that is past the
        reservation or below the pages holding live blocks. Raises ValueError if negative."""
        if isinstance(new_mem_size, bool) or not isinstance(new_mem_size, int):
            try:
                new_mem_size = operator.index(new_mem_size)
            except TypeError:
                raise ValueError(f"new_mem_size={new_mem_size!r} must be an int (bytes)") from None
        if new_mem_size < 0:
            raise ValueError(f"new_mem_size={new_mem_size} must be >= 0")
        pages = new_mem_size // self.page_bytes
        if pages > self.num_pages:
            return False
        return self._blocks.resize(pages)

    def trim(self) -> None:
        """Unmap the reserved pool and release cached physical handles."""
        self._blocks.trim()

    def clear(self) -> None:
        """Free every block, held ones included; the null block stays allocated.

        With a null block this is free_reserved() plus one free() of every other allocated id
        (block 0 is never handed back: re-allocating it after a full clear would find the
        allocator placing the next block elsewhere). O(blocks)."""
        if self.null_block is None:
            self._blocks.clear()
            return
        import numpy as np

        self._blocks.free_reserved()
        ids = np.flatnonzero(self._blocks.block_states() == 1).astype(np.int32)
        self._blocks.free_from(ids[ids != self.null_block])

    # -- limits ----------------------------------------------------------------------------------
    def set_memory_limit(self, limit_bytes: int, *, revision: int) -> dict:
        """Cap the memory this manager maps (live pages + reserved pool) at `limit_bytes`
        (NO_LIMIT = -1 removes the cap). See Note [Limits] for the statuses.

        Raises ValueError for a negative limit other than -1 or a negative revision."""
        state = self._apply_limit(limit_bytes, revision)
        with self._limit_lock:
            if state["status"] in ("applied", "deferred") and self._tracker is not None:
                self._tracker.set_limit(self._limit_bytes, self._limit_revision, self._limit_status)
        return state

    def _apply_limit(self, limit_bytes: int, revision: int) -> dict:
        if limit_bytes < NO_LIMIT:
            raise ValueError(f"limit_bytes={limit_bytes} must be >= 0, or -1 for no limit")
        if revision < 0:
            raise ValueError(f"revision={revision} must be >= 0")
        with self._limit_lock:
            kind = classify_limit_request(self._limit_bytes, self._limit_revision, limit_bytes, revision)
            if kind in ("stale", "conflict"):
                return self._limit_state(kind)
            if kind == "new":
                self._limit_bytes, self._limit_revision = limit_bytes, revision
                self._pages.set_limit_pages(-1 if limit_bytes == NO_LIMIT else limit_bytes // self.page_bytes)
                if limit_bytes != NO_LIMIT:
                    self._release_cached_handles()
            self._limit_status = "applied" if self._limit_met() else "deferred"
            return self._limit_state(self._limit_status)

    def _release_cached_handles(self) -> None:
        """Give the physical handles the backend keeps for reuse back to the device, so that a
        lowered limit frees memory for other instances (See Note [Limits])."""
        self._group.page_table.backend.release_cached()

    def _limit_met(self) -> bool:
        """Whether the memory really mapped (pages whose unmap waits on a fence included) is
        within the limit; unmaps first whatever pending pages the GPU is done with."""
        if self._limit_bytes == NO_LIMIT:
            return True
        self._pages.drain(False)
        return self.get_mapped_memory_size() <= self._limit_bytes

    def _limit_state(self, status: str) -> dict:
        return {"status": status, "limit_bytes": self._limit_bytes, "revision": self._limit_revision,
                "mapped_bytes": self.get_mapped_memory_size()}

    def memory_limit(self) -> dict:
        """The current limit, its revision and status (applied or deferred)."""
        with self._limit_lock:
            if self._limit_status == "deferred" and self._limit_met():   # tracker off: no publisher
                self._limit_status = "applied"
            return self._limit_state(self._limit_status)

    # -- introspection -------------------------------------------------------------------------
    def get_mapped_memory_size(self, unit: str = "bytes") -> float:
        """Physical memory mapped for this manager: live pages, reserved pool, pending unmaps."""
        scale = _UNITS.get(unit.lower())
        if scale is None:
            raise ValueError(f"unit={unit!r} is unknown; use one of {', '.join(_UNITS)}")
        stats = self._pages.stats()
        mapped = (stats["in_use"] + stats["reserved"] + stats["pending_unmap"]) * self.page_bytes
        return mapped if scale == 1 else mapped / scale

    def get_page_occupancy(self, page_ids=None) -> dict:
        """{page_id: (live blocks, blocks the page holds)} for the given pages (default: all
        pages holding blocks). Raises ValueError for a page id out of range."""
        return self._blocks.page_occupancy(page_ids)

    def stats(self) -> dict:
        """Block and page counters, consistent per allocator."""
        return self._blocks.stats()

    @property
    def ipc_name(self) -> str | None:
        """Name of this manager's shared-memory segment (what kvctl shows); None with the tracker off."""
        return None if self._tracker is None else self._tracker.name

    def check_invariants(self) -> None:
        """Check every invariant of the allocators (O(blocks + pages))."""
        self._blocks.check_invariants()

    # -- background publishing and shutdown ---------------------------------------------------
    def _publish_loop(self) -> None:
        while not self._closed.wait(PUBLISH_INTERVAL_S):
            self._publish()

    def _publish(self) -> None:
        stats = self._pages.stats()
        self._tracker.publish(stats["in_use"] * self.page_bytes,
                              (stats["reserved"] + stats["pending_unmap"]) * self.page_bytes)
        with self._limit_lock:
            if self._limit_status == "deferred" and self._limit_met():
                self._limit_status = "applied"
                self._release_cached_handles()
            # The watcher records its answer after _apply_limit returned, so it may overwrite a
            # flip to "applied" made in between: the segment is reconciled here. See Note [Limits].
            state = (self._limit_bytes, self._limit_revision, self._limit_status)
            if self._tracker.recorded_limit() != state:
                self._tracker.set_limit(*state)

    def close(self) -> None:
        """Stop the background threads, free every block and unmap every page of this manager.
        Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._tracker is not None:
            self._publisher.join()
            self._tracker.close()
        self._pages.stop()
        self._blocks.clear()
        self._pages.trim()
        self._pages.drain(True)
        if self._budget is not None:
            self._pages.set_budget_gate(None, None)
            self._budget.close()
        if self in self._group.managers:
            self._group.managers.remove(self)


# Note [One manager per group]
# A manager's PageAllocator owns the page ids of its group's page table: it maps and unmaps them
# with no one else to ask. A second live manager over the same group would map page 0 again for
# its own block 0 (the table's fast path trusts its owner) and unmap it under the first one's live
# blocks, so two managers of one group alias memory and fault. The constructor refuses; close()
# the first one to make another, and get_kv_cache_manager hands back the live one.
#
# Note [Hot path binding]
# alloc, free, alloc_into, free_from and available_size are rebound per instance to the Cython
# allocator's methods, so a call from the engine is one C method call (the class's methods
# document the contract and serve subclasses). The allocator's own lock makes them thread-safe.
#
# Note [Limits]
# A limit caps live pages plus the reserved pool. Applying one trims the pool at once; pages that
# hold live blocks are unmapped as they empty, and no page is mapped meanwhile. The status is
# "applied" when the mapped memory is already within the limit, else "deferred" until it is (the
# publisher thread notices within PUBLISH_INTERVAL_S and records "applied" in the segment). The
# publisher also rewrites the segment's limit block whenever it differs from the manager's state:
# the tracker's watcher writes its answer after _apply_limit returns, and a flip to "applied"
# made in that window would otherwise be overwritten by a stale "deferred" for good.
# Lowering a limit, and meeting a deferred one, also releases the backend's cached physical
# handles (Note [Handle cache]): they hold device memory the limit is meant to give back.
# Revisions order limit changes from several operators: a revision below the current one is
# "stale", the same revision with another limit a "conflict"; neither changes anything. A higher
# limit lets the pool grow back to its minimum; a limit of 0 drains an idle manager completely.
