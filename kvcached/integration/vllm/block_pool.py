"""ElasticBlockPool: vLLM's BlockPool whose block ids come from a kvcached KVCacheManager.

vLLM's scheduler admits requests on ``get_num_free_blocks()`` alone and takes blocks with
``get_new_blocks``; the stock pool owns every block of a static slab. This pool keeps vLLM's
bookkeeping (block objects, free queue, prefix cache, events) and asks kvcached for the memory:
a block is *held* (allocated in the manager, its page mapped) while it is in use or cached, and
given back as soon as it is free and uncached, so pages unmap as they empty.
See Note [Held blocks], Note [Honest free count] and Note [Pool geometry].

Importing this module imports vLLM; it changes nothing in vLLM (``enable()`` does).
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from ...checks import as_int
from ...errors import BlockStateError, KVCachedConfigError
from ...kv_cache_manager import KVCacheManager
from .tp import lead_workers

STANDALONE_GROUP_BASE = 1 << 16     # kvcached group ids of standalone pools start here
LIMIT_CHECK_S = 0.01                # how often a pool looks at its manager's limit (get_num_free_blocks)
LIMIT_CHECK_MAX_S = 1.0             # ... backing off to this while a deferred limit finds nothing to free


@dataclass(frozen=True)
class PoolGeometry:
    """What one vLLM block is in kvcached terms: the KVCacheManager arguments of a pool.

    block_size * cell_size is the bytes of one block of one buffer of one layer; group_id None
    gives each pool a fresh kvcached group (no tensors: the pool is bookkeeping over real pages);
    num_blocks, when set, restricts the geometry to a pool of exactly that many blocks.
    """

    block_size: int
    cell_size: int
    num_layers: int
    num_kv_buffers: int = 2
    group_id: int | None = None
    num_blocks: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "cell_size", "num_layers", "num_kv_buffers"):
            as_int(getattr(self, name), f"PoolGeometry.{name}", minimum=1)
        if self.group_id is not None:
            as_int(self.group_id, "PoolGeometry.group_id", minimum=0)
        if self.num_blocks is not None:
            as_int(self.num_blocks, "PoolGeometry.num_blocks", minimum=1)


# One cell of 64 bytes per block: a 2 MiB page holds 32768 blocks. See Note [Pool geometry].
STANDALONE_GEOMETRY = PoolGeometry(block_size=1, cell_size=64, num_layers=1, num_kv_buffers=1)

_lock = threading.RLock()     # re-entrant: a pool's finalizer may run in gc while it is held
_geometry: PoolGeometry | None = None
_standalone_ids = itertools.count(STANDALONE_GROUP_BASE)
_idle_standalone_groups: dict[int, list[int]] = {}     # num_blocks -> group ids of closed pools
_live_pools: weakref.WeakSet[ElasticBlockPool] = weakref.WeakSet()     # what sleep mode puts to sleep


def live_pools() -> list[ElasticBlockPool]:
    """The ElasticBlockPools of this process that are not closed (sleep mode's, Note [Sleep])."""
    with _lock:
        return [pool for pool in _live_pools if not pool.manager.closed]


def set_pool_geometry(geometry: PoolGeometry | None) -> None:
    """The geometry the next ElasticBlockPools of this process use; None = STANDALONE_GEOMETRY.

    ``allocate_kv_cache`` (the worker side) sets it to the group of the tensors it made, so the
    scheduler's pool hands out rows of those tensors. See Note [Pool geometry]."""
    global _geometry
    if geometry is not None and not isinstance(geometry, PoolGeometry):
        raise KVCachedConfigError(f"geometry={geometry!r} must be a PoolGeometry or None")
    with _lock:
        _geometry = geometry


def pool_geometry() -> PoolGeometry | None:
    """The geometry set by set_pool_geometry (None: standalone pools)."""
    return _geometry


def _manager_for(num_blocks: int) -> tuple[KVCacheManager, int | None]:
    """A new manager for a pool of num_blocks, and its standalone group id (None for a group set
    by set_pool_geometry), which a later pool may reuse once this one is closed."""
    if _geometry is None:
        workers = lead_workers()        # vLLM at TP > 1: See Note [vLLM at TP > 1] in tp.py
        if workers is not None:
            set_pool_geometry(PoolGeometry(**workers))      # for the pools that follow too
    with _lock:
        geometry = _geometry or STANDALONE_GEOMETRY
        if geometry.num_blocks not in (None, num_blocks):
            raise KVCachedConfigError(
                f"the pool geometry set for this process is for num_blocks={geometry.num_blocks}, but vLLM builds "
                f"a BlockPool of num_gpu_blocks={num_blocks}: the KV tensors (allocate_kv_cache) and the scheduler "
                f"must come from one KVCacheConfig; call set_pool_geometry(None) for a standalone pool")
        standalone = None
        if geometry.group_id is None:
            idle = _idle_standalone_groups.get(num_blocks)
            standalone = idle.pop() if idle else next(_standalone_ids)
    group_id = standalone if standalone is not None else geometry.group_id
    assert group_id is not None
    try:
        manager = KVCacheManager(num_blocks, geometry.block_size, geometry.cell_size, geometry.num_layers,
                                 num_kv_buffers=geometry.num_kv_buffers, group_id=group_id, reserve_null_block=True)
    except BaseException:
        if standalone is not None:
            _recycle(num_blocks, standalone)
        raise
    if manager.layout == "page_grouped":
        _close_manager(manager, num_blocks, standalone)
        raise KVCachedConfigError(
            "KVCACHED_LAYOUT=page_grouped gives sparse block ids, but vLLM indexes its blocks 0..num_gpu_blocks-1: "
            "use per_layer, interleaved or auto for vLLM")
    return manager, standalone


def _recycle(num_blocks: int, group_id: int) -> None:
    with _lock:
        _idle_standalone_groups.setdefault(num_blocks, []).append(group_id)


def _close_manager(manager: KVCacheManager, num_blocks: int, standalone_group: int | None) -> None:
    """Finalizer of a pool: close its manager, and let a later standalone pool reuse the group."""
    if manager.closed:
        return
    manager.close()
    if standalone_group is not None:
        _recycle(num_blocks, standalone_group)


class ElasticBlockPool(BlockPool):
    """A vLLM BlockPool whose blocks are held from a kvcached KVCacheManager only while they are
    in use or cached. Same constructor as vLLM's BlockPool; ``manager`` takes limits.

    It extends vLLM's pool rather than copying it: every public method that moves blocks
    (get_new_blocks, free_blocks, touch, unpin_blocks) calls vLLM's own and adds kvcached's part
    around it, so vLLM's free queue, prefix cache, events and metrics are its own code of the
    installed release. See Note [Extending vLLM's pool].
    Within one kvcached page, ids are handed out in exactly the order of vLLM's free queue;
    across pages kvcached fills the fullest mapped page first, so that pages empty and unmap.
    Not thread-safe, like vLLM's pool (the scheduler calls it from one thread).
    """

    # False: a page whose blocks are all free goes back to kvcached even if some are cached, so
    # memory follows the load; True: cached blocks keep their pages (vLLM's cache, whole).
    keep_idle_cached_pages = False

    def __init__(self, num_gpu_blocks: int, *args, **kwargs):
        # vLLM's own arguments, passed through: they differ between the supported releases.
        super().__init__(num_gpu_blocks, *args, **kwargs)
        manager, standalone_group = _manager_for(num_gpu_blocks)
        self.manager = manager
        # Bound once: a closed manager's bound methods raise too (Note [Manager life cycle]).
        self._alloc, self._free, self._available_size = manager.alloc, manager.free, manager.available_size
        # held[b] == 1: block b is allocated in the manager. See Note [Held blocks].
        self._held = bytearray(num_gpu_blocks)
        self._held[self.null_block.block_id] = 1
        self._num_unheld_free = num_gpu_blocks - 1      # blocks in the free queue that are not held
        self._borrowed: set[int] = set()    # in use but not held: See Note [Claiming a block]
        self._count_every_free_block = False
        # Ids are dense: page p holds ids [p * per_page, (p + 1) * per_page) (the null block's page
        # 0 is never clipped but by num_blocks, which then fits in it).
        self._blocks_per_page = per_page = manager.get_page_occupancy([0])[0][1]
        # Blocks with ref_cnt > 0 per page, the null block counted: See Note [Idle pages].
        self._in_use_by_page = [0] * -(-num_gpu_blocks // per_page)
        self._in_use_by_page[self.null_block.block_id // per_page] = 1
        self._limit_check_s = LIMIT_CHECK_S
        self._next_limit_check = 0.0
        self._finalizer = weakref.finalize(self, _close_manager, manager, num_gpu_blocks, standalone_group)
        self._asleep = False            # See Note [Sleep]
        with _lock:
            _live_pools.add(self)

    def close(self) -> None:
        """Close the manager: every page of this pool is unmapped; the pool is unusable after."""
        self._finalizer()

    # -- counting --------------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        """Free blocks that get_new_blocks can hand out now: the free ones this pool holds (cached
        ones included) plus what kvcached can allocate under its limit and budget.
        See Note [Honest free count]. O(log pages): one available_size() (counters only, no
        driver call) while some free block is not held, else one attribute read as vLLM's pool."""
        num_free = self.free_block_queue.num_free_blocks
        unheld = self._num_unheld_free
        if not unheld or self._count_every_free_block:
            return num_free
        if not self._borrowed:
            # kvcached's free ids are exactly the free blocks this pool does not hold, so
            # available_size() never exceeds their number.
            return num_free - unheld + self._available_size()
        # Ids of borrowed blocks are free in kvcached but kept for their borrowers.
        share = self._available_size() - len(self._borrowed)
        return num_free - unheld + max(0, min(share, unheld))

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset (every cache entry dropped; False, nothing changed, while a block is in
        use), with blocks in use counted from the free queue rather than from the
        (limit-dependent) free count, so that a limit does not make the reset refuse; then every
        page that holds no block in use goes back to kvcached at once (release_free_pages): all
        but the null block's. O(blocks)."""
        self._count_every_free_block = True
        try:
            reset = super().reset_prefix_cache()
        finally:
            self._count_every_free_block = False
        if reset:
            self.release_free_pages()
        return reset

    # -- sleep mode: See Note [Sleep] ------------------------------------------------------------
    @property
    def asleep(self) -> bool:
        """Whether sleep() gave every page back and wake_up() has not run since."""
        return self._asleep

    def sleep(self) -> None:
        """Give kvcached every block this pool holds, the null block too, so that no page of it
        stays mapped, and hand out none until wake_up(): vLLM's sleep discards the KV cache. The
        prefix cache is reset first, so no entry outlives the bytes it names. Idempotent.

        Raises BlockStateError, with nothing changed, while a block is in use (vLLM's sleep
        aborts or preempts the requests and resets the cache first). O(blocks)."""
        if self._asleep:
            return
        in_use = self.num_gpu_blocks - 1 - self.free_block_queue.num_free_blocks
        if in_use or not self.reset_prefix_cache():
            raise BlockStateError(
                f"{in_use} blocks of this pool are in use, so its KV cache cannot be released: put vLLM to sleep "
                f"with LLM.sleep(level >= 1), which aborts (or preempts) the requests and resets the prefix cache "
                f"first, or finish the requests before sleep()")
        held = self._held
        self._release([block for block in self.free_block_queue.iter_blocks_after(None) if held[block.block_id]])
        manager = self.manager
        manager.free([self.null_block.block_id])
        held[self.null_block.block_id] = 0
        self._asleep = True
        resized = manager.resize(0)     # no page can be mapped: alloc returns None, available_size() is 0
        assert resized, "no block is allocated, so no page can hold one"
        manager.trim()                  # the reserved pool and cached handles go too

    def wake_up(self) -> None:
        """Undo sleep(): the pool spans its pages again and holds its null block (whose page is
        mapped afresh); every other block is free and uncached. Idempotent.

        Raises BlockStateError, staying asleep, if kvcached hands out another id than the null
        block's first (its group was used by someone else meanwhile). O(1) but the mapping."""
        if not self._asleep:
            return
        manager = self.manager
        manager.resize(manager.num_pages * manager.page_bytes)
        null_id = self.null_block.block_id
        ids = manager.alloc(1)
        if ids != [null_id]:
            if ids:
                manager.free(ids)
            manager.resize(0)
            raise BlockStateError(f"waking up, kvcached handed out block {ids} instead of the null block "
                                  f"{null_id}: another user allocated from this pool's kvcached group while it slept")
        self._held[null_id] = 1
        self._asleep = False

    # -- allocation ------------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """num_blocks blocks with ref_cnt 1: first fresh ones from kvcached, then free blocks this
        pool holds, in free-queue order (vLLM evicts their prefix-cache entries).

        kvcached picks the blocks; they are put at the front of vLLM's free queue and vLLM's own
        get_new_blocks takes them (See Note [Extending vLLM's pool]). Raises ValueError, as
        vLLM's pool does, when num_blocks > get_num_free_blocks(); nothing is changed then.
        O(num_blocks) with one alloc and one count when kvcached has them all, else a count
        first, and a walk of the free queue for the held blocks."""
        if num_blocks <= self._num_unheld_free and not self._borrowed:
            ids = self._alloc(num_blocks)
            if ids is not None:
                self._num_unheld_free -= num_blocks
                held, all_blocks = self._held, self.blocks
                for block_id in ids:
                    held[block_id] = 1
                return self._hand_out([all_blocks[block_id] for block_id in ids])
        return self._get_new_blocks_counted(num_blocks)

    def _get_new_blocks_counted(self, num_blocks: int) -> list[KVCacheBlock]:
        """get_new_blocks when kvcached alone does not cover it (its limit or budget, too few
        free blocks not held, borrowed blocks)."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        unheld = self._num_unheld_free
        fresh = self._take_unheld(min(num_blocks, unheld)) if unheld else []
        if len(fresh) == num_blocks:
            return self._hand_out(fresh)
        held = self._held_free_blocks(num_blocks - len(fresh), fresh)
        if held is None:                # kvcached's share shrank since the count: See Note [Honest free count]
            self._give_back(fresh)
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool (its memory limit or "
                             f"budget shrank meanwhile)")
        return self._hand_out(fresh + held)

    def _hand_out(self, blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """vLLM's get_new_blocks over exactly these free blocks, which this pool holds: they go to
        the front of vLLM's free queue, in this order, and vLLM takes them from there."""
        queue = self.free_block_queue
        remove = queue.remove
        for block in blocks:
            remove(block)
        queue.prepend_n(blocks)
        taken = super().get_new_blocks(len(blocks))
        in_use, per_page = self._in_use_by_page, self._blocks_per_page
        for block in taken:
            in_use[block.block_id // per_page] += 1
        return taken

    def _take_unheld(self, n: int) -> list[KVCacheBlock]:
        """Up to n free blocks allocated from kvcached, still in the free queue (fewer, possibly
        none, when its limit or budget stops it). A borrowed id among them is now held for its
        borrower and not returned (Note [Claiming a block])."""
        blocks: list[KVCacheBlock] = []
        held, all_blocks, borrowed = self._held, self.blocks, self._borrowed
        ids = self._alloc(n)
        while True:
            if ids is None:             # short of n: as many as kvcached can give now
                want = min(n - len(blocks), self._available_size())
                ids = self._alloc(want) if want > 0 else None
                if ids is None:
                    return blocks
            for block_id in ids:
                held[block_id] = 1
                if block_id in borrowed:
                    borrowed.discard(block_id)
                else:
                    blocks.append(all_blocks[block_id])
                    self._num_unheld_free -= 1
            if len(blocks) >= n:
                return blocks
            ids = self._alloc(n - len(blocks))

    def _held_free_blocks(self, n: int, fresh: list[KVCacheBlock]) -> list[KVCacheBlock] | None:
        """The first n held blocks of the free queue (still in it) other than the fresh ones
        (just taken from kvcached, held, still in the queue), or None if there are fewer."""
        found: list[KVCacheBlock] = []
        if n > self.free_block_queue.num_free_blocks - self._num_unheld_free - len(fresh):
            return None
        held = self._held
        if fresh:
            held = bytearray(held)      # a copy: the fresh ones are not what is looked for
            for block in fresh:
                held[block.block_id] = 0
        for block in self.free_block_queue.iter_blocks_after(None):
            if held[block.block_id]:
                found.append(block)
                if len(found) == n:
                    return found
        return None

    def _give_back(self, blocks: list[KVCacheBlock]) -> None:
        """Undo _take_unheld: the blocks (still free, in the queue) go back to kvcached."""
        if not blocks:
            return
        self._free([block.block_id for block in reversed(blocks)])
        for block in blocks:
            self._held[block.block_id] = 0
        self._num_unheld_free += len(blocks)

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """vLLM's touch; a block that kvcached does not hold for this pool (a free, uncached
        block taken as a hit, as connectors and vLLM's tests do) is claimed from it."""
        leaving = [block for block in blocks if not block.ref_cnt and not block.is_null]
        super().touch(blocks)
        if not leaving:
            return
        held, in_use, per_page = self._held, self._in_use_by_page, self._blocks_per_page
        claim: list[int] = []
        for block in _distinct(leaving):
            in_use[block.block_id // per_page] += 1
            if not held[block.block_id]:
                claim.append(block.block_id)
        if claim:
            self._num_unheld_free -= len(claim)
            self._claim(claim)

    def unpin_blocks(self, blocks: Iterable[KVCacheBlock], on_reuse: Callable[[KVCacheBlock], None]) -> None:
        """vLLM's unpin_blocks; the blocks stay held (readable until reused). A borrowed block it
        frees is a plain free block again (kvcached never held it for us), which kvcached may
        hand out next, and on_reuse hears of that."""
        blocks = list(blocks)
        super().unpin_blocks(blocks, on_reuse)
        in_use, per_page, borrowed = self._in_use_by_page, self._blocks_per_page, self._borrowed
        for block in _distinct([block for block in blocks if not block.ref_cnt]):
            in_use[block.block_id // per_page] -= 1
            if borrowed and block.block_id in borrowed:
                self._forget_borrowed(block)

    def _claim(self, block_ids: list[int]) -> None:
        """Make kvcached hold these ids (free in it, in use here). See Note [Claiming a block]."""
        wanted = set(block_ids)
        others: list[int] = []
        batch = len(wanted)
        while wanted:
            count = min(batch, self.manager.available_size())
            ids = self.manager.alloc(count) if count > 0 else None
            if not ids:
                break
            for block_id in ids:
                if block_id in wanted or block_id in self._borrowed:
                    wanted.discard(block_id)
                    self._borrowed.discard(block_id)
                    self._held[block_id] = 1
                else:
                    others.append(block_id)
            batch *= 2
        if others:
            others.reverse()            # back in the order kvcached handed them out
            self.manager.free(others)
        self._borrowed |= wanted

    # -- freeing ---------------------------------------------------------------------------------
    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """vLLM's free, then the blocks of this pool that became free and hold no prefix-cache
        entry go back to kvcached (their pages unmap as they empty); under a deferred limit,
        free pages of cached blocks go back too. See Note [Held blocks].
        O(blocks) plus kvcached's free; O(blocks on a page) for a page left with none in use."""
        blocks = ordered_blocks if isinstance(ordered_blocks, list) else list(ordered_blocks)
        super().free_blocks(blocks)
        freed = [block for block in blocks if not block.ref_cnt and block.pool is self and not block.is_null]
        if freed:
            self._give_back_freed(freed)
        self._follow_limit()

    def _give_back_freed(self, freed: list[KVCacheBlock]) -> None:
        """kvcached's part of free_blocks: the blocks that vLLM's free left with ref_cnt 0."""
        released: list[int] = []
        emptied: list[int] = []         # pages left with no block in use
        held, in_use, per_page = self._held, self._in_use_by_page, self._blocks_per_page
        cached_by_block = self.cached_block_hashes_by_block or None     # hashes beyond a block's own
        borrowed = self._borrowed
        for block in _distinct(freed):
            block_id = block.block_id
            page = block_id // per_page
            in_use[page] -= 1
            if not in_use[page]:
                emptied.append(page)
            if borrowed and block_id in borrowed:
                self._forget_borrowed(block)    # not held: See Note [Claiming a block]
            elif (held[block_id] and block.block_hash is None
                    and (cached_by_block is None or block_id not in cached_by_block)):
                held[block_id] = 0
                released.append(block_id)
        if released:
            released.reverse()          # kvcached hands out the last freed id first
            self._free(released)
            self._num_unheld_free += len(released)
        # With no held free block (no cache, nothing unpinned) no page can be idle.
        if (emptied and not self.keep_idle_cached_pages
                and self.free_block_queue.num_free_blocks > self._num_unheld_free):
            self._release_idle_pages(emptied)

    def _release_idle_pages(self, pages: list[int]) -> None:
        """Give back the held (free, cached) blocks of these pages, which hold no block in use
        any more: See Note [Held blocks] and Note [Idle pages]. O(blocks on those pages)."""
        per_page, held, in_use, all_blocks = self._blocks_per_page, self._held, self._in_use_by_page, self.blocks
        for page in pages:
            if not in_use[page]:        # (a page may be listed twice, or refilled by a watcher)
                start = page * per_page
                self._release([all_blocks[block_id] for block_id in range(start, min(start + per_page, len(held)))
                               if held[block_id]])

    def _forget_borrowed(self, block: KVCacheBlock) -> None:
        """A borrowed block became free: it is a plain free block again (kvcached never gave it
        to us); a cache entry made meanwhile is dropped, as its data was never backed."""
        self._borrowed.discard(block.block_id)
        self._num_unheld_free += 1
        if block.block_hash is not None or block.block_id in self.cached_block_hashes_by_block:
            self.evict_blocks({block.block_id})

    def release_free_pages(self) -> int:
        """Give kvcached every free block this pool holds (prefix-cache entries dropped) on pages
        that hold no block in use, so those pages unmap; returns the number of blocks given back.

        Runs by itself while the manager's limit is deferred (Note [Held blocks]).
        O(free blocks + pages)."""
        per_page = self._blocks_per_page
        held = self._held
        by_page: dict[int, list[KVCacheBlock]] = {}
        for block in self.free_block_queue.iter_blocks_after(None):
            if held[block.block_id]:
                by_page.setdefault(block.block_id // per_page, []).append(block)
        if not by_page:
            return 0
        occupancy = self.manager.get_page_occupancy(list(by_page))
        released = [block for page, blocks in by_page.items() if occupancy[page][0] == len(blocks)
                    for block in blocks]
        self._release(released)
        return len(released)

    def _release(self, blocks: list[KVCacheBlock]) -> None:
        """Free held blocks (ref_cnt 0) go back to kvcached: vLLM reuses them first (its
        get_new_blocks drops their prefix-cache entries, with their events, and tells the readers
        of unpinned ones), frees them to the front of its queue, and their ids go to kvcached.
        See Note [Extending vLLM's pool]."""
        if not blocks:
            return
        queue = self.free_block_queue
        for block in blocks:
            queue.remove(block)
        queue.prepend_n(blocks)
        taken = BlockPool.get_new_blocks(self, len(blocks))
        BlockPool.free_blocks(self, taken)      # uncached now: to the front, in this order
        held = self._held
        for block in blocks:
            held[block.block_id] = 0
        self._free([block.block_id for block in reversed(blocks)])
        self._num_unheld_free += len(blocks)

    def _follow_limit(self) -> None:
        """While the manager's limit is deferred, give back free pages: looked at every
        LIMIT_CHECK_S, backing off to LIMIT_CHECK_MAX_S while a deferred limit finds nothing."""
        now = time.monotonic()
        if now < self._next_limit_check:
            return
        if self.manager.limit_status == "deferred" and not self.release_free_pages():
            self._limit_check_s = min(2 * self._limit_check_s, LIMIT_CHECK_MAX_S)
        else:
            self._limit_check_s = LIMIT_CHECK_S
        self._next_limit_check = now + self._limit_check_s

    # -- checking --------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Check the pool against vLLM's rules and against the manager. O(blocks)."""
        free_ids = [block.block_id for block in self.free_block_queue.get_all_free_blocks()]
        free = set(free_ids)
        assert len(free) == len(free_ids) == self.free_block_queue.num_free_blocks, "free queue count or duplicates"
        # Asleep, the manager holds nothing, the null block neither: See Note [Sleep].
        assert self.null_block.block_id not in free and self._held[self.null_block.block_id] != self._asleep, \
            "null block"
        num_held = num_unheld_free = 0
        for block in self.blocks:
            block_id = block.block_id
            held = self._held[block_id]
            num_held += held
            if block.is_null:
                continue
            assert (block.ref_cnt == 0) == (block_id in free), f"block {block_id}: ref_cnt {block.ref_cnt} vs queue"
            assert block.ref_cnt >= 0, f"block {block_id}: ref_cnt {block.ref_cnt}"
            if block_id in self._borrowed:
                assert not held and block.ref_cnt > 0, f"borrowed block {block_id} held or free"
            elif not held:
                assert block.ref_cnt == 0 and block.block_hash is None, f"unheld block {block_id} in use or cached"
                num_unheld_free += 1
        assert num_unheld_free == self._num_unheld_free, "count of free blocks not held"
        in_use_by_page = [0] * len(self._in_use_by_page)
        for block in self.blocks:
            if block.is_null or block.ref_cnt:
                in_use_by_page[block.block_id // self._blocks_per_page] += 1
        assert in_use_by_page == self._in_use_by_page, "blocks in use per page"
        # kvcached's free ids are the unheld free blocks and the borrowed ones.
        assert self._available_size() <= num_unheld_free + len(self._borrowed), "kvcached offers more than it has"
        assert self.manager.stats()["allocated"] == num_held, "manager and pool disagree on held blocks"
        held_by_page: dict[int, int] = {}
        for block_id in range(self.num_gpu_blocks):
            if self._held[block_id]:
                page = block_id // self._blocks_per_page
                held_by_page[page] = held_by_page.get(page, 0) + 1
        live_by_page = {page: live for page, (live, _) in self.manager.get_page_occupancy().items() if live}
        assert held_by_page == live_by_page, "held blocks per page differ from the manager's pages"
        self.manager.check_invariants()


def _distinct(blocks: list[KVCacheBlock]) -> Iterable[KVCacheBlock]:
    """The blocks, each once, in order: a block may be listed twice in one call of vLLM's."""
    if len(blocks) < 2:
        return blocks
    return {block.block_id: block for block in blocks}.values()


# Note [Held blocks]
# A block is held (allocated in the KVCacheManager, its page mapped) exactly while vLLM may read
# it: in use (ref_cnt > 0), free but cached (its KV is a prefix-cache entry), released by
# unpin_blocks (readable until reused), or the null block. A free block without a hash goes back
# to kvcached in free_blocks, so a page is unmapped once its last such block is freed. vLLM's
# free queue is kept whole: held free blocks sit where vLLM puts them (cached ones appended, LRU)
# and blocks kvcached holds for us are in the queue too, where vLLM would have prepended them.
# kvcached hands out ids of one page last-freed first, lowest first on a fresh page, so ids given
# back in reverse come out in the queue's order: within a page the pool hands out exactly the
# ids vLLM's own pool would (its tests check that order). get_new_blocks takes fresh ids first
# and then held free blocks in queue order, as vLLM pops uncached blocks before cached ones.
# Eviction by page: when free_blocks leaves a page with no block in use (only free cached ones),
# the page goes back with its cache entries (keep_idle_cached_pages=False, the default), so the
# mapped memory follows the blocks in use; the cache lives on pages that running requests keep.
# The null block's page never empties, so a pool of one page keeps vLLM's cache whole.
# release_free_pages is the same eviction for every page at once: it drops the cache entries of free blocks on pages
# that hold nothing in use, so those whole pages unmap. A lowered limit needs it: kvcached defers
# the limit until pages empty, and pages of cached blocks would never empty. free_blocks looks
# at the limit every LIMIT_CHECK_S and, while it is deferred, releases such pages, so the free
# count falls to what the limit leaves as requests finish. Not in get_num_free_blocks: vLLM
# looks up prefix hits (free cached blocks), then counts free blocks, then touches the hits, and
# a release in between would hand a hit's block back to kvcached; no free comes in between.
#
# Note [Idle pages]
# A page goes back to kvcached with the cache entries of its free blocks once no block on it is
# in use (keep_idle_cached_pages False). Finding such pages by scanning every page a call's freed
# blocks lie on cost ~0.7 % of a step with prefix caching (a request's blocks spread over many
# pages), so _in_use_by_page counts the blocks with ref_cnt > 0 per page (the null block counted,
# so its page never empties), kept at every 0 <-> 1 change of a ref_cnt, after vLLM's own method
# made it: get_new_blocks (_hand_out), touch, free_blocks, unpin_blocks. A page whose count
# falls to 0 in free_blocks is idle, and only its blocks are looked at. check_invariants recounts.
# The measurements: benchmarks/README.md (bench_vllm_scheduler); the pool's earlier rounds:
# benchmarks/HISTORY.md.
#
# Note [Claiming a block]
# vLLM's touch() takes any free block as a prefix hit. Hits normally are cached blocks, which
# this pool holds; a connector (or vLLM's own tests) may touch a free block that kvcached holds
# for no one, and it must then back that very id. KVCacheManager has no call that allocates a
# given id, so _claim allocates in growing batches until the ids come up and frees the others
# back in reverse, which leaves kvcached's order of handing out ids as it was. Within one page
# the wanted ids come first (kvcached's order is the free queue's), so it costs one batch. If a
# limit stops the search first, the block is *borrowed*: in use, not held (not counted as
# allocatable, and kept for its user if kvcached hands the id out later); nothing maps its page
# until then, so only a bookkeeping-only pool (standalone, no tensors) may rely on that. The
# free count takes the borrowed ids out of kvcached's share whether or not kvcached could offer
# them now, so it may fall short by up to their number (vLLM then admits less; it never raises).
#
# Note [Honest free count]
# vLLM admits a request when get_num_free_blocks() covers it and then calls get_new_blocks
# without catching its ValueError. The count is the held free blocks plus what kvcached can
# allocate now (available_size: limit, global budget and reserved pool included), so allocating
# exactly that many succeeds. It is asked afresh on every call (~50 a step, one per running
# request): kvcached's share can shrink without this pool doing anything (a limit applied by the
# tracker's watcher thread, budget taken by another process, device memory taken by another
# process as of the allocator's last look), and a count kept from an earlier call would turn
# such a shrink into vLLM's uncaught ValueError. A shrink between vLLM's count and its
# get_new_blocks is the one window left: get_new_blocks first asks kvcached for all the blocks
# at once (which succeeds only if a fresh count would cover them), else counts again and
# raises, with nothing changed, when the fresh count does not cover the request (vLLM's own
# pool raises there too); a shrink inside get_new_blocks, after that count, is covered from
# held free (cached) blocks, and only if those fall short does it raise, having given back what
# it took. Only new pages are refused: blocks in pages already mapped and the reserved pool stay
# allocatable under a lowered limit or a taken budget, so the window matters only when the
# allocation needs pages the shrink took away. Closing it needs kvcached to keep what it
# promised (a reservation per count), which the manager does not offer.
#
# Note [Extending vLLM's pool]
# The pool subclasses vLLM's BlockPool and changes only which free block is handed out and when
# a block's memory comes and goes; the work on vLLM's structures is vLLM's own code, called
# through its public methods (free queue remove/prepend_n, get_new_blocks, free_blocks, touch,
# unpin_blocks, evict_blocks), so the same pool runs on every supported release and what vLLM
# changes in a release (events, metrics, watchers of unpinned blocks, null-block handling) it
# gets with it. kvcached picks the ids (fullest mapped page first): get_new_blocks puts the
# picked blocks at the front of vLLM's free queue and lets vLLM's get_new_blocks take them;
# free_blocks, touch and unpin_blocks call vLLM's first and then look at the blocks that left or
# joined the free queue (ref_cnt 0 <-> 1) to keep the held flags, the per-page counts and
# kvcached's allocation in step. Giving cached blocks back (_release) is vLLM's reuse of them
# (get_new_blocks: their cache entries dropped with events, readers of unpinned blocks told)
# followed by vLLM's free, after which they are plain free blocks at the front of the queue;
# with a metrics collector that reuse samples them as allocated, as vLLM's own reuse does.
# No field of vLLM's is written and no private method of it called. The cost against the
# earlier pool that repeated vLLM 0.33's code inline (benchmarks/README.md, bench_vllm_scheduler;
# the rounds in benchmarks/HISTORY.md): CPU time of a stream 0.97x stock's against 1.04x for the
# inlined pool; the wall-clock benchmark on the same (heavily loaded) machine gave 1.09-1.11x
# against 1.05-1.10x, within its noise there. No inlined path is kept; if a quiet-machine run of
# bench_vllm_scheduler shows the 5 % goal missed, the candidates are the fresh take in
# get_new_blocks (a queue move and a count per call) and the second walk in free_blocks.
#
# Note [Sleep]
# vLLM's sleep (LLM.sleep(level >= 1), the /sleep endpoint) discards the KV cache: it aborts or
# preempts the requests, resets the prefix cache, and then the worker's sleep-mode backend
# frees the memory; wake_up maps it again, and the first step starts from blocks that vLLM
# writes (attention) or zeroes (Mamba state) before it reads them. kvcached's backend
# (kvcached.integration.vllm.sleep, sleep_mode_backend="kvcached") calls sleep() on every live
# pool of the process: the reset already gave back every page but the null block's, and
# sleep() frees the remaining held blocks and the null block, then shrinks the manager to no
# page (resize(0)) and trims its reserved pool, so nothing is mapped and no block can be
# handed out: the free count is 0 while asleep, and vLLM's scheduler is paused anyway. This is
# the one state in which the pool holds its null block without kvcached holding it for it
# (check_invariants knows). wake_up() spans the pages again and allocates the null block, which
# kvcached hands out first on a group with nothing allocated (lowest id of a fresh page). Every
# page is mapped afresh as blocks are taken (trim released the physical handles: zeros on the
# host backend, undefined bytes of a new allocation on a GPU), and no cache entry survives a
# sleep (the reset drops them all), so no block is read as a hit of bytes from before it: vLLM
# writes or zeroes each new block before its first read, as after start-up. Idle pools (the free queue
# only) sleep; a pool with a block in use refuses, changing nothing, as vLLM's own reset does.
#
# Note [Pool geometry]
# vLLM builds its BlockPool from num_gpu_blocks alone, in the scheduler, after the worker made
# the KV tensors. The worker side (allocate_kv_cache) makes them in a kvcached group and calls
# set_pool_geometry with that group, so the pool's manager hands out rows of those tensors; the
# two must run in one process (vLLM's uniproc executor), as kvcached maps pages in the process
# that allocates. With no geometry set, each pool gets a fresh standalone group of 64-byte
# blocks: real pages and limits, no tensors (vLLM's scheduler tests, the benchmark). A 2 MiB
# page then holds 32768 blocks, so a small pool lives in one page and sees vLLM's exact ids.
# A closed pool's standalone group is reused by the next pool of the same size.
