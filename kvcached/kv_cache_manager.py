"""KVCacheManager: the engine-facing allocator of KV blocks over one group's elastic tensors.

Policy lives here, in Python; the per-block work is in the Cython allocators
(``kvcached.core.BlockAllocator`` over ``PageAllocator``), which are thread-safe by themselves.
See Note [Hot path binding], Note [Limits] and Note [Manager life cycle].

A manager knows nothing of the runtime above it: the runtime hands it a ``Registry`` (its group,
its lock, the other managers) at construction. See Note [One registry].
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from . import compaction, config
from ._steps import Steps
from .checks import as_int
from .errors import KVCachedArgumentError, KVCachedClosedError, KVCachedConfigError, KVCachedError
from .limits import I64_MAX, NO_LIMIT, classify_limit_request
from .shm.files import validate_name
from .shm.owner import MemInfoTracker
from .shm.poller import POLLER, Job

if TYPE_CHECKING:
    from .core import BlockAllocator, PageAllocator, PageTable
    from .core.blockalloc import _BlockAllocatorStats
    from .shm.budget.holder import Budget
    from .layout import KVLayout

logger = logging.getLogger("kvcached")

_UNITS = {"bytes": 1, "b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}
PUBLISH_INTERVAL_S = 0.01
SHARE_INTERVAL_S = 0.05             # demand published and the budget cap read this often (Note [Fair share])
MAX_LIMIT_BYTES = I64_MAX           # what the segment's limit field (int64) holds, as kvctl accepts
MAX_REVISION = I64_MAX              # what the segment's revision field (int64) holds
_HOT_PATH = ("alloc", "free", "alloc_into", "free_from", "available_size")
_all_managers: weakref.WeakSet = weakref.WeakSet()    # every manager made, for the fork handler


class Group(Protocol):
    """What a manager uses of its group (``runtime.KVGroup``): the layout, the page table, and its
    live managers (read here; the registry adds and removes them)."""

    group_id: int
    layout: KVLayout
    page_table: PageTable
    managers: list[KVCacheManager]

    @property
    def peers(self) -> Peers | None:
        """The other ranks under tensor parallelism, on the scheduling rank; else None."""


class Peers(Protocol):
    """The other ranks of a tensor-parallel instance, as one group's manager sees them
    (``kvcached.tp.TableMirror``, also the page table's mirror)."""

    def release_cached(self) -> None:
        """Every peer gives its cached physical handles back to its device."""

    def check_peers(self, table: PageTable) -> None:
        """Assert that every peer maps exactly the page ids `table` maps."""


class Registry(Protocol):
    """What a manager needs from the runtime that owns it (``runtime.REGISTRY``).
    See Note [One registry]."""

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """The registry's lock, held while a manager registers or leaves (re-entrant)."""

    def group(self, group_id: int, num_layers: int, num_kv_buffers: int, block_bytes: int,
              num_blocks: int) -> Group:
        """The group ``group_id``, made without tensors if it does not exist yet.
        Raises KVCachedConfigError if its geometry differs."""

    def managers(self) -> list[KVCacheManager]:
        """Every live manager of this process."""

    @property
    def world_size(self) -> int:
        """Ranks of the tensor-parallel instance (1 without tensor parallelism)."""

    @property
    def tp_rank(self) -> int:
        """This process's rank in it; only rank 0 allocates."""

    def add(self, group: Group, manager: KVCacheManager) -> None:
        """Register ``manager`` as ``group``'s live manager. Assumes ``lock``."""

    def remove(self, group: Group, manager: KVCacheManager) -> None:
        """Forget ``manager`` (closed). Assumes ``lock``."""


# The registry of a manager made without one: the package sets it to the runtime's
# (kvcached/__init__.py). See Note [One registry].
registry_provider: Callable[[], Registry] | None = None


def _default_registry() -> Registry:
    if registry_provider is None:
        raise KVCachedConfigError(
            "KVCacheManager needs the runtime's registry: import kvcached (the package sets it) or pass "
            "registry=kvcached.runtime.REGISTRY")
    return registry_provider()


def check_geometry(num_blocks: object, block_size: object, cell_size: object, num_layers: object,
                   num_kv_buffers: object, group_id: object) -> tuple[int, int, int, int, int, int]:
    """The manager's geometry arguments as ints: sizes >= 1, group_id >= 0. Raises
    KVCachedConfigError naming the bad one (bools and floats included). Shared by the
    constructor and runtime.get_kv_cache_manager, which compares before constructing."""
    sizes = tuple(as_int(value, name, minimum=1) for value, name in (
        (num_blocks, "num_blocks"), (block_size, "block_size"), (cell_size, "cell_size"),
        (num_layers, "num_layers"), (num_kv_buffers, "num_kv_buffers")))
    return (*sizes, as_int(group_id, "group_id", minimum=0))  # type: ignore[return-value]


def check_limit_request(limit_bytes: object, revision: object) -> tuple[int, int]:
    """(limit_bytes, revision) as ints within what the segment's int64 fields hold. Raises
    KVCachedArgumentError (a ValueError) otherwise, bools and floats included."""
    return (as_int(limit_bytes, "limit_bytes", minimum=NO_LIMIT, maximum=MAX_LIMIT_BYTES,
                   hint="bytes, or -1 for no limit", error=KVCachedArgumentError),
            as_int(revision, "revision", minimum=0, maximum=MAX_REVISION,
                   hint="a revision above the current one", error=KVCachedArgumentError))


def refuse_async_sched(async_sched: object) -> None:
    """async_sched is accepted for compatibility with engines' calls, but only False: allocation
    is synchronous. Raises KVCachedConfigError for a true value."""
    if async_sched:
        raise KVCachedConfigError(
            f"async_sched={async_sched!r} is not supported: allocation is synchronous (alloc returns the "
            f"ids, or None, before it returns), so there is nothing to overlap; pass async_sched=False")


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
    sparse (see kvcached.layout). Every method is thread-safe. After ``close()``,
    ``shutdown_kvcached()`` or in a forked child every method but ``close()`` raises
    KVCachedClosedError (Note [Manager life cycle]).

    Raises (constructor): KVCachedConfigError for a non-positive size, a geometry that differs
    from the group's tensors, more blocks than those tensors hold, a group that already has a
    live manager (Note [One manager per group]), a segment name another manager of this process
    uses, a world_size other than 1 or init_kvcached's, a tp_rank > 0 (see Note [Tensor-parallel
    manager]) or async_sched=True. A failed constructor leaves nothing behind. ``registry`` is
    the runtime's (the default); see Note [One registry]. ``pp_rank`` (an int >= 0) is accepted
    for compatibility with engines that pass it, and not kept: nothing depends on it.
    """

    _pages: PageAllocator                   # set by _build; absent if construction failed first
    _blocks: BlockAllocator
    _budget: Budget | None
    _tracker: MemInfoTracker | None
    _publisher: Job | None                  # publishing on the process's poller (tracker on)
    _sharer: Job | None                     # the fair-share round on the poller (budget on)

    def __init__(self, num_blocks: int, block_size: int, cell_size: int, num_layers: int, world_size: int = 1,
                 pp_rank: int = 0, async_sched: bool = False, reserve_null_block: bool = False,
                 num_kv_buffers: int = 2, group_id: int = 0, pool_name: str | None = None, *,
                 registry: Registry | None = None) -> None:
        num_blocks, block_size, cell_size, num_layers, num_kv_buffers, group_id = check_geometry(
            num_blocks, block_size, cell_size, num_layers, num_kv_buffers, group_id)
        as_int(pp_rank, "pp_rank", minimum=0)      # accepted for engines, not kept (see the class docstring)
        world_size = as_int(world_size, "world_size", minimum=1, hint="1, or init_kvcached's world_size")
        refuse_async_sched(async_sched)
        if pool_name is not None and not isinstance(pool_name, str):
            raise KVCachedConfigError(f"pool_name={pool_name!r} must be a str (it suffixes the segment name) or None")
        settings = config.settings()
        self._registry = _default_registry() if registry is None else registry
        self.world_size = self._registry.world_size
        if world_size not in (1, self.world_size):
            raise KVCachedConfigError(
                f"world_size={world_size}: kvcached was initialised with world_size={self.world_size} "
                f"(init_kvcached); pass that, or 1. One manager on the scheduling rank serves every rank.")
        if self._registry.tp_rank:
            raise KVCachedConfigError(
                f"tp_rank={self._registry.tp_rank}: only the scheduling rank (tp_rank=0) makes a KVCacheManager and "
                f"allocates; this rank maps the pages rank 0 allocates by itself. Use the block ids rank 0 hands "
                f"out (broadcast them with the step's inputs).")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cell_size = cell_size
        self.num_layers = num_layers
        self.num_kv_buffers = num_kv_buffers
        self.group_id = group_id
        self.pool_name = pool_name
        self.block_bytes = block_size * cell_size
        self.null_block: int | None = None
        self._closed_reason: str | None = "the manager is being constructed"
        self._forked = False
        self._pid = os.getpid()
        self._budget = self._tracker = self._publisher = self._sharer = None
        self._limit_lock = threading.Lock()
        self._limit_bytes = NO_LIMIT
        self._cap_bytes = I64_MAX           # the budget's cap: none (Note [Fair share])
        self._reported_demand = 0           # report_demand's blocks
        self._failed_blocks_seen = 0        # the allocator's num_failed_blocks at the last round
        self._limit_revision = 0
        self._limit_status = "applied"
        _all_managers.add(self)
        # See Note [One manager per group]: the check and the registration are one step.
        with self._registry.lock:
            self._group = self._registry.group(group_id, num_layers, num_kv_buffers, self.block_bytes, num_blocks)
            self._refuse_more_blocks_than_tensors()
            self._refuse_second_manager()
            ipc_name = self._ipc_name(settings.ipc_name)
            try:
                self._build(settings, ipc_name, reserve_null_block)
            except BaseException:
                self._teardown()
                raise
            self._closed_reason = None
            self._bind_hot_path()
            self._registry.add(self._group, self)
        logger.info("manager of group %d: %d blocks in %d pages of %d bytes, segment %s", group_id, num_blocks,
                    self.num_pages, self.page_bytes, self.ipc_name)

    def _build(self, settings: config.Settings, ipc_name: str | None, reserve_null_block: bool) -> None:
        """Make the allocators, the budget share and the tracker, then start the jobs and threads.
        Assumes the registry's lock; on an exception the caller tears down what exists."""
        from .core import BlockAllocator
        from .core import PageAllocator

        layout = self._group.layout
        self.layout = layout.name
        first, count, num_pages = _clipped_intervals(layout, self.num_blocks)
        self.num_pages = num_pages
        # the instance's memory: every rank maps each page id (See Note [Tensor-parallel manager])
        self.page_bytes = self._group.page_table.page_bytes * self.world_size
        self._pages = PageAllocator(self._group.page_table, num_pages=num_pages,
                                    min_reserved=settings.min_reserved_pages,
                                    max_reserved=settings.max_reserved_pages,
                                    idle_trim_s=settings.idle_trim_s)
        self._blocks = BlockAllocator(self._pages, first, count, layout.id_to_page_num, layout.id_to_page_den,
                                      layout.max_block_id)
        self._set_stream()
        if settings.global_budget is not None:      # before the null block: its page counts too
            self._attach_budget(settings.global_budget)
        if reserve_null_block:
            self._reserve_null_block()
        if settings.tracker:
            self._tracker = MemInfoTracker(ipc_name, capacity_bytes=num_pages * self.page_bytes,
                                           page_size_bytes=self.page_bytes)
            self._tracker.start_watcher(self._apply_limit)
            self._publisher = POLLER.every(PUBLISH_INTERVAL_S, self._publish, f"manager of group {self.group_id}: "
                                           f"publishing to segment {self._tracker.name}")
        if self._budget is not None:
            self._sharer = POLLER.every(SHARE_INTERVAL_S, self._share_round, f"manager of group {self.group_id}: "
                                        f"fair share of budget {self._budget.name}")
        self._pages.start()

    def _refuse_more_blocks_than_tensors(self) -> None:
        """num_blocks may not exceed the blocks the group's tensors were made for (alloc_kv_cache's
        N, or the first manager's num_blocks when a manager made the group): the pages' rounded-up
        capacity may hold more ids, but those are no rows of ``kv[layer]``."""
        held = self._group.layout.num_blocks
        if self.num_blocks > held:
            raise KVCachedConfigError(
                f"KVCacheManager(num_blocks={self.num_blocks}): the KV tensors of group {self.group_id} from "
                f"alloc_kv_cache hold {held} blocks; pass num_blocks <= {held} or allocate tensors with "
                f"{self.num_blocks} blocks (another group_id, or after shutdown_kvcached()): ids {held}.."
                f"{self.num_blocks - 1} would be no rows of kv[layer]")

    def _refuse_second_manager(self) -> None:
        """See Note [One manager per group]. Assumes the registry's lock."""
        for other in self._group.managers:
            raise KVCachedConfigError(
                f"group {self.group_id} already has a manager (num_blocks={other.num_blocks}, "
                f"pool_name={other.pool_name!r}); two managers of one group would hand out the same blocks. "
                f"Share it (get_kv_cache_manager with the same arguments), close() it first, or give the "
                f"new manager its own group_id and alloc_kv_cache tensors.")

    def _ipc_name(self, base: str | None) -> str | None:
        """The segment name: KVCACHED_IPC_NAME, suffixed with pool_name. Refuses a name another
        live manager of this process publishes under. Assumes the registry's lock."""
        if base is None:
            return None
        name = base if self.pool_name is None else f"{base}.{self.pool_name}"
        try:
            validate_name(name)
        except KVCachedConfigError as exc:
            raise KVCachedConfigError(f"KVCACHED_IPC_NAME={base!r} with pool_name={self.pool_name!r} names no "
                                      f"valid segment: {exc}") from None
        for other in self._registry.managers():
            if other.ipc_name == name:
                raise KVCachedConfigError(
                    f"KVCACHED_IPC_NAME={base!r} with pool_name={self.pool_name!r} names segment {name!r}, which "
                    f"the manager of group {other.group_id} in this process already publishes under; pass a "
                    f"distinct pool_name to each manager (its segment is then '{base}.<pool_name>').")
        return name

    def _set_stream(self) -> None:
        backend = self._group.page_table.backend
        if backend.kind != "cuda" or not getattr(backend, "holds_memory", True):    # a leader without pages
            return
        import torch

        self._pages.stream = int(torch.cuda.current_stream().cuda_stream)

    def set_stream(self, stream: int) -> None:
        """The CUDA stream (a ``cudaStream_t`` as int) whose queued work a page unmap waits for.

        Defaults to torch's current stream when the manager is made; engines that run attention
        on another stream set it here. 0 is the legacy default stream."""
        self._check_open()
        self._pages.stream = as_int(stream, "stream", minimum=0, hint="a cudaStream_t as int, 0 = legacy default",
                                    error=KVCachedArgumentError)

    def _reserve_null_block(self) -> None:
        ids = self._blocks.alloc(1)
        if ids != [0]:
            if ids:
                self._blocks.free(ids)
            raise KVCachedConfigError(
                f"reserve_null_block: block 0 could not be reserved (got {ids}); the layout's first page "
                f"must hold block 0, and one page must fit in the memory (and budget) left")
        self.null_block = 0

    def _attach_budget(self, name: str) -> None:
        from .shm.budget.holder import Budget

        settings = config.settings()
        self._budget = Budget.open(name, settings.global_budget_bytes, policy=settings.global_budget_policy,
                                   weight=settings.share_weight, min_bytes=settings.share_min)
        # Cached handles hold device memory the budget no longer counts: no cache under a budget.
        self._group.page_table.backend.set_handle_cache_capacity(0)
        if self.world_size == 1:
            self._pages.set_budget_gate(self._budget.try_acquire, self._budget.release)
            return
        budget, ranks = self._budget, self.world_size        # the gate counts this rank's bytes
        self._pages.set_budget_gate(lambda nbytes: budget.try_acquire(nbytes * ranks),
                                    lambda nbytes: budget.release(nbytes * ranks))

    def _bind_hot_path(self) -> None:
        """See Note [Hot path binding]."""
        blocks = self._blocks
        self.alloc, self.free = blocks.alloc, blocks.free  # type: ignore[method-assign]
        self.alloc_into, self.free_from = blocks.alloc_into, blocks.free_from  # type: ignore[method-assign]
        self.available_size = (  # type: ignore[method-assign]
            blocks.available_blocks if self._budget is None else self._available_within_budget)

    def _check_open(self) -> None:
        if self._closed_reason is not None:
            raise KVCachedClosedError(self._closed_reason)

    # -- the allocation API (bound to the Cython allocator while the manager is open) ----------
    def alloc(self, n: int) -> list[int] | None:
        """Exactly n distinct block ids, or None (state unchanged) when they cannot be had now."""
        self._check_open()
        return self._blocks.alloc(n)

    def free(self, ids) -> None:
        """Free block ids. Raises BlockStateError, freeing nothing, for an unknown, unallocated or
        repeated id."""
        self._check_open()
        self._blocks.free(ids)

    def alloc_into(self, buf) -> bool:
        """Fill a contiguous int32 buffer (numpy array or CPU tensor) with len(buf) ids; False
        (nothing changed) when they cannot be had."""
        self._check_open()
        return self._blocks.alloc_into(buf)

    def free_from(self, buf) -> None:
        """free() for a contiguous int32 buffer."""
        self._check_open()
        self._blocks.free_from(buf)

    def available_size(self) -> int:
        """Blocks alloc could hand out now, from counters (no driver call): alloc(available_size())
        succeeds and alloc(available_size() + 1) returns None if nothing changes in between.
        Under KVCACHED_GLOBAL_BUDGET it counts only the pages the budget's free bytes can map."""
        self._check_open()
        if self._budget is not None:
            return self._available_within_budget()
        return self._blocks.available_blocks()

    def _available_within_budget(self) -> int:
        """available_size under a global budget: pages to be mapped need budget bytes, pooled
        ones already hold theirs. One lock-free read of the shared total. O(log pages)."""
        return self._blocks.available_blocks(self._budget.free_bytes() // self.page_bytes)  # type: ignore[union-attr]

    def try_to_reserve(self, n: int) -> bool:
        """Set n blocks aside (their pages mapped) for the next allocs; False if they cannot be had."""
        self._check_open()
        return self._blocks.try_to_reserve(as_int(n, "n", minimum=0, error=KVCachedArgumentError))

    def free_reserved(self) -> None:
        """Give back the blocks set aside by try_to_reserve."""
        self._check_open()
        self._blocks.free_reserved()

    def resize(self, new_mem_size: int) -> bool:
        """Let this manager span `new_mem_size` bytes of KV memory (all layers and buffers), i.e.
        new_mem_size // page_bytes pages. False, with nothing changed, when that is past the
        reservation or below the pages holding live blocks. Raises KVCachedArgumentError (a
        ValueError) for a negative or non-integer size."""
        self._check_open()
        new_mem_size = as_int(new_mem_size, "new_mem_size", minimum=0, hint="bytes of KV memory",
                              error=KVCachedArgumentError)
        pages = new_mem_size // self.page_bytes
        if pages > self.num_pages:
            return False
        return self._blocks.resize(pages)

    def trim(self) -> None:
        """Unmap the reserved pool and release cached physical handles."""
        self._check_open()
        self._blocks.trim()

    def clear(self) -> None:
        """Free every block, held ones included; the null block stays allocated.

        With a null block this is free_reserved() plus one free() of every other allocated id
        (block 0 is never handed back: re-allocating it after a full clear would find the
        allocator placing the next block elsewhere). O(blocks)."""
        self._check_open()
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

        Raises KVCachedArgumentError (a ValueError and a TypeError) for a limit outside
        [-1, MAX_LIMIT_BYTES] or a revision outside [0, MAX_REVISION], bools and floats included;
        nothing is changed then."""
        state = self._apply_limit(limit_bytes, revision)
        with self._limit_lock:
            if state["status"] in ("applied", "deferred") and self._tracker is not None and not self.closed:
                self._tracker.set_limit(self._limit_bytes, self._limit_revision, self._limit_status)
        return state

    def _apply_limit(self, limit_bytes: int, revision: int) -> dict:
        """Validate, then apply a limit request (set_memory_limit, or the tracker's watcher)."""
        limit_bytes, revision = check_limit_request(limit_bytes, revision)
        with self._limit_lock:
            self._check_open()
            kind = classify_limit_request(self._limit_bytes, self._limit_revision, limit_bytes, revision)
            if kind in ("stale", "conflict"):
                return self._limit_state(kind)
            if kind == "new":
                self._limit_bytes, self._limit_revision = limit_bytes, revision
                self._pages.set_limit_pages(self._limit_pages())
                if limit_bytes != NO_LIMIT:
                    self._release_cached_handles()
            self._limit_status = "applied" if self._limit_met() else "deferred"
            return self._limit_state(self._limit_status)

    def _limit_pages(self) -> int:
        """The page allocator's limit: the operator's limit or the budget's cap, the lower; -1
        for neither. A limit above the table caps nothing; clamped, it fits the allocator's C
        int. Assumes ``_limit_lock``."""
        bounds = [self._limit_bytes] if self._limit_bytes != NO_LIMIT else []
        if self._cap_bytes != I64_MAX:
            bounds.append(self._cap_bytes)
        return min(min(bounds) // self.page_bytes, self._group.page_table.num_pages) if bounds else -1

    def _release_cached_handles(self) -> None:
        """Give the physical handles the backend keeps for reuse back to the device, so that a
        lowered limit frees memory for other instances (See Note [Limits]); on every rank."""
        self._group.page_table.backend.release_cached()
        if self._group.peers is not None:
            self._group.peers.release_cached()

    def _limit_met(self) -> bool:
        """Whether the memory really mapped (pages whose unmap waits on a fence included) is
        within the limit; unmaps first whatever pending pages the GPU is done with."""
        if self._limit_bytes == NO_LIMIT:
            return True
        self._pages.drain(False)
        return self._mapped_bytes() <= self._limit_bytes

    def _limit_state(self, status: str) -> dict:
        return {"status": status, "limit_bytes": self._limit_bytes, "revision": self._limit_revision,
                "mapped_bytes": self._mapped_bytes()}

    def memory_limit(self) -> dict:
        """The current limit, its revision and status (applied or deferred)."""
        with self._limit_lock:
            return self._limit_state(self._refreshed_limit_status())

    @property
    def limit_status(self) -> str:
        """"applied" or "deferred", without the figures memory_limit() gathers: O(1) unless a
        deferred limit is being checked (engines poll it on their free path)."""
        with self._limit_lock:
            return self._refreshed_limit_status()

    def _refreshed_limit_status(self) -> str:
        self._check_open()
        if self._limit_status == "deferred" and self._limit_met():   # tracker off: no publisher
            self._limit_status = "applied"
        return self._limit_status

    # -- fair share of a global budget (Note [Fair share]) -------------------------------------
    def report_demand(self, blocks: int) -> None:
        """Tell the budget how many blocks this engine wants beyond what it holds (its waiting
        requests' needs), for engines that check before they allocate and so never see alloc
        return None. Kept until the next call; 0 clears it. Published within SHARE_INTERVAL_S
        (the larger of this and the blocks refused since the last round), up to what the
        operator's limit and the capacity let this instance take beyond what it holds (See Note
        [Fair share]). Without a global budget it is kept and has no effect.

        Raises KVCachedArgumentError (a ValueError and a TypeError) for anything but an int in
        [0, I64_MAX]; nothing is changed then."""
        blocks = as_int(blocks, "blocks", minimum=0, maximum=I64_MAX, hint="blocks wanted beyond those held",
                        error=KVCachedArgumentError)
        self._check_open()
        self._reported_demand = blocks

    def pages_of(self, block_ids: Iterable[int]) -> list[int]:
        """The page id each block id lies in: the blocks of one page go back to the device
        together, so an engine that must give memory back frees whole pages' holders (the
        serving loop does, Note [Fair share in the loop]). Ids are not checked. O(len)."""
        self._check_open()
        num, den = self._blocks.id_to_page_num, self._blocks.id_to_page_den
        return [int(b) * num // den for b in block_ids]

    def over_limit_blocks(self) -> int:
        """Blocks this engine must free (preempt) now for its live blocks to fit the pages its
        current limit allows (the operator's limit, or the budget's cap while another instance
        waits for its fair share; the lower), so that the memory moves at once instead of when
        its next allocation fails; 0 if none.

        Exactly: with a limit of L pages, the fewest blocks whose freeing lets the remaining
        live blocks (held ones included) fit on L of the pages that now hold live blocks, i.e.
        live blocks less the blocks the L largest of those pages hold, at least 0. The blocks
        left on the other pages then move into free slots of those L (plan_compaction), and
        over_limit_pages() of them empty. 0 while at most L pages hold live blocks, whatever
        their sizes (a page holding fewer blocks, such as the last one, counts as one page).
        O(1) within the limit; O(pages log pages) beyond it."""
        self._check_open()
        with self._limit_lock:
            limit_pages = self._limit_pages()
        if limit_pages < 0 or self._blocks.stats()["owned_pages"] <= limit_pages:
            return 0
        occupancy = self._blocks.page_occupancy().values()
        kept = sorted((size for _, size in occupancy), reverse=True)[:limit_pages]
        return max(0, sum(live for live, _ in occupancy) - sum(kept))

    def over_limit_pages(self) -> int:
        """Pages holding live blocks beyond the current limit (as over_limit_blocks); 0 if none.
        Freeing over_limit_blocks() blocks lets the blocks fit under the limit, but a page goes
        back only once every block on it is free: this is how many pages must empty. O(1)."""
        self._check_open()
        with self._limit_lock:
            limit_pages = self._limit_pages()
        if limit_pages < 0:
            return 0
        return max(0, self._blocks.stats()["owned_pages"] - limit_pages)

    def plan_compaction(self, pinned: Iterable[int] = ()) -> dict[int, int]:
        """Live blocks to move so that pages beyond the current limit empty without preempting
        the requests on them: {old id: new id}, each new id already allocated on a page that
        stays. The engine copies every old block's K and V to its new id (every layer; every
        rank), points its block tables at the new ids and frees the old ones: their pages then
        empty and go back, behind the fence as after any free. An engine that does not move a
        block frees its new id instead. Pages holding a `pinned` id, a held block
        (try_to_reserve) or the null block stay. {} when nothing is over the limit or no page's
        blocks fit in the free slots of the others: preempt then (over_limit_pages()). Call it
        from the thread that allocates and frees. O(blocks). See Note [Moving blocks instead of
        preempting]."""
        import numpy as np

        self._check_open()
        pinned = [as_int(b, "pinned block id", minimum=0, error=KVCachedArgumentError) for b in pinned]
        pages = self.over_limit_pages()
        if pages <= 0:
            return {}
        states = self._blocks.block_states()
        num, den = self._blocks.id_to_page_num, self._blocks.id_to_page_den
        held = np.flatnonzero((states == 1) | (states == 3))
        held_pages = held * num // den
        live = dict(zip(*(a.tolist() for a in np.unique(held_pages, return_counts=True))))
        capacity = {p: blocks for p, (_, blocks) in self._blocks.page_occupancy(list(live)).items()}
        stay = set(self.pages_of(pinned + np.flatnonzero(states == 3).tolist()))
        if self.null_block is not None:
            stay.update(self.pages_of([self.null_block]))
        victims, destinations = compaction.plan_pages(live, capacity, pages, stay)
        old = held[np.isin(held_pages, victims)].tolist()
        new: list[int] = []
        for page, count in destinations:
            ids = self._blocks.alloc_on(page, count)
            if ids is None:                 # an alloc or a free of another thread came between
                self._blocks.free(new)
                return {}
            new.extend(ids)
        return dict(zip(old, new))

    def share(self) -> dict | None:
        """This instance's place in its global budget: policy, weight, min_bytes, demand_bytes
        (as last published), share_bytes (its fair share now) and cap_bytes (the cap in force:
        I64_MAX when uncapped), as one read of the budget computes them. None without a global
        budget. O(slots)."""
        self._check_open()
        if self._budget is None:
            return None
        snap = self._budget.snapshot()
        mine = next((h for h in snap.holders if h.slot == self._budget.slot), None)
        if mine is None:
            raise KVCachedError(f"budget {self._budget.name!r}: this manager's slot was taken away (the budget "
                                "was deleted or reset while in use); restart the instance")
        return {"policy": snap.policy, "weight": mine.weight, "min_bytes": mine.min_bytes,
                "demand_bytes": mine.demand_bytes, "share_bytes": mine.share_bytes,
                "cap_bytes": self._cap_bytes}

    def _room_bytes(self) -> int:
        """Budget bytes this instance could still take by its own bounds: up to the operator's
        limit and its capacity (pages it may hand out), less what it holds of the budget. Not up
        to the budget's cap: See Note [Fair share]."""
        pages = self._pages.capacity_pages
        limit_bytes = self._limit_bytes             # one read of an int: no lock
        if limit_bytes != NO_LIMIT:
            pages = min(pages, limit_bytes // self.page_bytes)
        return max(0, pages * self.page_bytes - self._budget.held_bytes)  # type: ignore[union-attr]

    @property
    def _bytes_per_block(self) -> int:
        """Budget bytes one block costs: every layer, K and V, every rank (as the gate counts)."""
        return self.block_bytes * self.num_layers * self.num_kv_buffers * self.world_size

    def _share_round(self) -> None:
        """The share job: publish demand, read the cap, apply it to the page allocator through
        the limit path (the pool trimmed first). A failed round is logged by the poller."""
        budget = self._budget
        assert budget is not None, "the share job runs only under a budget"
        failed = self._blocks.num_failed_blocks     # no lock: a free may hold it, waiting on the budget
        refused, self._failed_blocks_seen = failed - self._failed_blocks_seen, failed
        budget.set_demand(min(self._room_bytes(), max(self._reported_demand, refused) * self._bytes_per_block))
        cap = budget.cap_bytes()
        with self._limit_lock:
            if self._closed_reason is not None or cap == self._cap_bytes:
                return
            self._cap_bytes = cap
            self._pages.set_limit_pages(self._limit_pages())

    # -- introspection -------------------------------------------------------------------------
    def get_mapped_memory_size(self, unit: str = "bytes") -> float:
        """Physical memory mapped for this manager: live pages, reserved pool, pending unmaps,
        in `unit` (bytes, b, kb, mb, gb; any case)."""
        scale = _UNITS.get(unit.lower()) if isinstance(unit, str) else None
        if scale is None:
            raise KVCachedArgumentError(f"unit={unit!r} is unknown; use one of {', '.join(_UNITS)}")
        self._check_open()
        mapped = self._mapped_bytes()
        return mapped if scale == 1 else mapped / scale

    def _mapped_bytes(self) -> int:
        stats = self._pages.stats()
        return (stats["in_use"] + stats["reserved"] + stats["pending_unmap"]) * self.page_bytes

    def get_page_occupancy(self, page_ids=None) -> dict:
        """{page_id: (live blocks, blocks the page holds)} for the given pages (default: all
        pages holding blocks). Raises ValueError for a page id out of range."""
        self._check_open()
        return self._blocks.page_occupancy(page_ids)

    def stats(self) -> _BlockAllocatorStats:
        """Block and page counters, consistent per allocator."""
        self._check_open()
        return self._blocks.stats()

    @property
    def ipc_name(self) -> str | None:
        """Name of this manager's shared-memory segment (what kvctl shows); None with the tracker off."""
        return None if self._tracker is None else self._tracker.name

    @property
    def closed(self) -> bool:
        """Whether the manager was closed, shut down or inherited by a forked child."""
        return self._closed_reason is not None

    def check_invariants(self) -> None:
        """Check every invariant of the allocators (O(blocks + pages)); under tensor parallelism
        also that every rank maps the same page ids (one message round)."""
        self._check_open()
        self._blocks.check_invariants()
        if self._group.peers is not None:
            self._group.peers.check_peers(self._group.page_table)

    # -- background publishing and shutdown ---------------------------------------------------
    def _publish(self) -> None:
        """The publishing job: usage into the segment, a deferred limit checked. A failed round
        is logged by the poller, and the next one runs (See Note [One poller per process] in
        shm.poller)."""
        tracker = self._tracker
        assert tracker is not None, "the publisher runs only with a tracker"
        stats = self._pages.stats()
        tracker.publish(stats["in_use"] * self.page_bytes,
                        (stats["reserved"] + stats["pending_unmap"]) * self.page_bytes)
        with self._limit_lock:
            if self._closed_reason is not None:
                return
            if self._limit_status == "deferred" and self._limit_met():
                self._limit_status = "applied"
                self._release_cached_handles()
            # The watcher records its answer after _apply_limit returned, so it may overwrite a
            # flip to "applied" made in between: the segment is reconciled here. See Note [Limits].
            state = (self._limit_bytes, self._limit_revision, self._limit_status)
            if tracker.recorded_limit() != state:
                tracker.set_limit(*state)

    def close(self) -> None:
        """Stop the background jobs and threads, free every block, unmap every page of this manager and
        give back its budget share; afterwards every other method raises KVCachedClosedError.
        Idempotent; in a forked child it touches nothing. See Note [Manager life cycle]."""
        self._close(f"this KVCacheManager of group {self.group_id} is closed: its pages are unmapped and its "
                    f"block ids may belong to a newer manager of the group. Make a new one "
                    f"(get_kv_cache_manager or KVCacheManager).")

    def _close(self, reason: str) -> None:
        if self._forked:
            return
        with self._registry.lock:
            if self._closed_reason is not None:
                return
            with self._limit_lock:              # a limit being applied finishes first
                self._closed_reason = reason
            for name in _HOT_PATH:
                self.__dict__.pop(name, None)
            try:
                self._teardown()
            finally:
                self._registry.remove(self._group, self)

    def _teardown(self) -> None:
        """End every job and thread of this manager, then give back its blocks, pages and budget
        share. Each step runs even if one before it failed; the first error is raised at the end."""
        steps = Steps()
        if self._publisher is not None:
            self._publisher.cancel()            # a publish in progress finishes first
        if self._sharer is not None:
            self._sharer.cancel()               # so does a share round
        if self._tracker is not None:
            steps.run(self._tracker.close)      # ends its jobs: no limit is applied after this
        if hasattr(self, "_blocks"):
            steps.run(self._blocks.close)       # frees every block; stops the refill thread, unmaps every page
        elif hasattr(self, "_pages"):
            steps.run(self._pages.close)
        if self._budget is not None:
            steps.run(self._budget.close)
        steps.raise_first()

    def _mark_forked(self) -> None:
        """In a forked child: make every method raise, and close() a no-op (Note [Manager life
        cycle]). Touches no lock, thread or memory of the parent."""
        self._forked = True
        self._closed_reason = (
            f"this KVCacheManager of group {self.group_id} was made in process {self._pid} and cannot be used in "
            f"its forked child {os.getpid()}: its pages and locks are the parent's. In the child call "
            f"shutdown_kvcached() (it touches nothing of the parent), then init_kvcached() and make a new manager.")
        self._limit_lock = threading.Lock()
        for name in _HOT_PATH:
            self.__dict__.pop(name, None)


def _after_fork_in_child() -> None:
    for manager in list(_all_managers):
        manager._mark_forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


# Note [One manager per group]
# A manager's PageAllocator owns the page ids of its group's page table: it maps and unmaps them
# with no one else to ask. A second live manager over the same group would map page 0 again for
# its own block 0 (the table's fast path trusts its owner) and unmap it under the first one's live
# blocks, so two managers of one group alias memory and fault. The constructor refuses; close()
# the first one to make another, and get_kv_cache_manager hands back the live one. The check and
# the registration happen under the registry's lock, with the whole construction in between: two
# threads constructing at once are serialised, and the loser raises before it has made an
# allocator, a thread or a segment (a check outside the lock let both build allocators over one
# page table, and the loser's close() unmapped pages under the winner's live blocks).
#
# Note [One registry]
# The runtime owns the groups and their managers; a manager only uses what the runtime's Registry
# hands it (its group, the lock, the other managers) and registers and leaves through it, so this
# module imports nothing above it and nothing imports in a circle (tests/test_layers.py checks).
# A manager made directly (KVCacheManager(...), as engines do) gets the runtime's registry from
# registry_provider, which the package sets when it is imported (kvcached/__init__.py, the one
# place that knows both layers); the runtime module is then imported on the first construction,
# and it initialises kvcached with the defaults if init_kvcached() was not called, as before.
#
# Note [Hot path binding]
# alloc, free, alloc_into, free_from and available_size are rebound per instance to the Cython
# allocator's methods, so a call from the engine is one C method call (the class's methods
# document the contract, check that the manager is open and serve after close). The allocator's
# own lock makes them thread-safe. Under a global budget available_size is a Python method that
# passes the budget's free pages to the allocator (available_size counts what alloc can map).
#
# Note [Manager life cycle]
# close() and shutdown_kvcached() end a manager for good: the hot-path bindings are dropped from
# the instance (so the class's methods run and raise KVCachedClosedError) and the Cython
# allocators are closed too, so a bound method an engine kept (`alloc = m.alloc`) raises as well
# (the core's KVCachedError, naming the same fix).
# Without this a closed manager handed out ids that a newer manager of the group owned, and its
# trim() unmapped pages under the newer manager's live blocks. Teardown takes the publishing job
# off the process's poller, then the tracker's jobs (each cancel waits for a run in progress, so a
# limit being applied finishes first; Note [One poller per process] in shm.poller), then closes
# the allocators (refill thread stopped, every page unmapped) and the budget share, in that order,
# so no thread touches a page table being torn down.
# After fork() every manager of the child is marked forked by an at-fork handler: every method
# raises before taking any lock (a lock may have been held by a parent thread that does not exist
# in the child), close() does nothing, and the Cython objects refuse every call by themselves
# (Note [Fork and close] in core/vmm.pyx), so neither the child's calls nor its exit handlers unmap,
# free or hand out the parent's pages.
#
# Note [Limits]
# A limit caps live pages plus the reserved pool. Applying one trims the pool at once; pages that
# hold live blocks are unmapped as they empty, and no page is mapped meanwhile. The status is
# "applied" when the mapped memory is already within the limit, else "deferred" until it is (the
# publishing job notices within PUBLISH_INTERVAL_S and records "applied" in the segment). The
# publisher also rewrites the segment's limit block whenever it differs from the manager's state:
# the tracker's limit-request job writes its answer after _apply_limit returns, and a flip to
# "applied" made in that window would otherwise be overwritten by a stale "deferred" for good.
# Lowering a limit, and meeting a deferred one, also releases the backend's cached physical
# handles (Note [Handle cache]): they hold device memory the limit is meant to give back.
# Revisions order limit changes from several operators: a revision below the current one is
# "stale", the same revision with another limit a "conflict"; neither changes anything. A higher
# limit lets the pool grow back to its minimum; a limit of 0 drains an idle manager completely.
#
# Note [Fair share]
# Under a global budget of the fair policy (kvcached.shm.fairness) the manager takes part in the
# sharing by itself: every SHARE_INTERVAL_S a job on the process's poller publishes its demand
# (the blocks report_demand gave, or those alloc refused since the last round, the larger, in
# budget bytes), computes its cap from the budget and applies it to the page allocator with the
# operator's limit, the lower of the two, through the limit path: the reserved pool is trimmed at
# once (fenced unmaps), live pages go as they empty, and alloc returns None beyond it. The cap is
# internal: the operator's limit, its revisions and status, and what the tracker shows stay the
# operator's. over_limit_blocks tells an engine what to preempt so the memory moves now.
# Refused blocks are counted by the core (num_failed_blocks, next to num_failed_allocs, under the
# allocator's lock it already holds on that path), so the bound C alloc stays one call: counting
# in Python would need a wrapper on every alloc. The job reads the counter without that lock: a
# free holds it while its unmapped pages' bytes go back to the budget, which waits for the
# budget's flock, and the poller's other jobs (the publishing) must not wait behind that. A refused request the engine retries every step
# counts each time, overstating demand within a round; that only widens this instance's share up
# to its weighted slice, and stops as soon as its allocations succeed.
# Demand is published only up to what the instance could take by its own bounds: the operator's
# limit and its capacity (capacity_pages), less the budget bytes it holds (_room_bytes). An
# instance held down by `kvctl limit` kept publishing the blocks its allocs were refused: it sat
# below its share with demand waiting, so the other instance was capped at its share while 6 of
# 16 pages stayed free, for as long as the limit stood. Those blocks are refused whatever the
# budget does, so they are no demand on it. The budget's cap is deliberately not such a bound:
# it is computed from the demand, and demand is how a holder below its share asks for more; a
# demand clipped to the cap could never raise the cap, and a holder capped low would stay there.
#
# Note [Moving blocks instead of preempting]
# A page goes back only when every block on it is free, and an engine's requests take their next
# blocks one at a time from the fullest page, so a page holds blocks of many requests: emptying
# one by preemption throws away the work of all of them (on the H200, three 8B-shaped instances
# under a fair budget preempted 187 times in 30 s against 24 under first come, and lost 12 % of
# their throughput; benchmarks/README.md, bench_share). Once the engine has freed the blocks
# beyond its limit (over_limit_blocks), the live blocks fit its pages under the limit, so the
# emptiest pages' blocks can move into the free slots of the fuller ones instead: a device copy
# of a few blocks per layer and a block-table update, against a recomputed prompt per request.
# plan_compaction chooses the pages (kvcached.compaction: emptiest first, while their blocks fit
# the free slots left) and allocates the destinations with BlockAllocator.alloc_on, which takes
# free ids of a page already in use and maps nothing; the engine copies and frees the old ids,
# and those frees empty the pages through the one free path (fenced unmaps, the budget's bytes
# back). The copy is queued on the engine's stream before the free, so the unmap's fence, recorded
# on that stream, waits for it as for any kernel that read the page.
#
# Note [Tensor-parallel manager]
# Under tensor parallelism (init_kvcached with world_size > 1) the manager lives on the scheduling
# rank only; its page table mirrors every map and unmap to the other ranks (kvcached.tp), so the
# allocator, the reserved pool and the limits work unchanged, and the pool's fast path sends no
# message. The instance is one: page_bytes is the memory a page id takes on all ranks (this
# rank's page bytes x world_size), so limits, resize sizes, get_mapped_memory_size, the tracker
# (kvctl, kvtop) and the global budget all count every rank's memory; the budget gate, which the
# allocator calls with this rank's bytes, is scaled likewise.
