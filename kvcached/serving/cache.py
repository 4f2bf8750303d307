"""Paged KV caches the serving loop runs over: kvcached's elastic tensors, or a static torch slab.

Both hold, per layer, a K and a V tensor of blocks (``[N, block_size, KVH, D]`` for NHD,
``[N, KVH, block_size, D]`` for HND) and hand out block ids with ``alloc(n) -> list | None`` and
``free(ids)``. ElasticKVCache is ``alloc_kv_cache`` + a ``KVCacheManager`` (pages mapped as
blocks are handed out; limits and a global budget make alloc return None); StaticKVCache is one
``torch.zeros`` per layer and a free list, the baseline every engine without kvcached has.
"""

from __future__ import annotations

import operator

import torch

from kvcached.checks import as_int, check_kv_layout
from kvcached.errors import BlockStateError, KVCachedClosedError


def kv_geometry(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a transformers decoder config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_key_value_heads, head_dim


def _layer_shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, kv_layout: str) -> tuple:
    if kv_layout == "HND":
        return (2, num_blocks, kv_heads, block_size, head_dim)
    return (2, num_blocks, block_size, kv_heads, head_dim)


class PagedKVCache:
    """What the serving loop needs of a KV cache (see the module docstring)."""

    shares_budget = False       # whether it takes part in a global budget's fair shares

    def __init__(self, config, num_blocks: int, block_size: int, dtype: torch.dtype, kv_layout: str):
        check_kv_layout(kv_layout)
        self.num_blocks = as_int(num_blocks, "num_blocks", minimum=1, error=ValueError)
        self.block_size = as_int(block_size, "block_size", minimum=1, error=ValueError)
        self.num_layers, self.num_kv_heads, self.head_dim = kv_geometry(config)
        self.dtype = dtype
        self.kv_layout = kv_layout
        self.kv: list[torch.Tensor] = []    # per layer, [2, N, ...]: kv[l][0] is K, kv[l][1] is V

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K cache, V cache) of one layer."""
        kv = self.kv[index]
        return kv[0], kv[1]

    @property
    def cell_bytes(self) -> int:
        """Bytes one token takes in one layer's K (or V) buffer."""
        return self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def alloc(self, n: int) -> list[int] | None:
        raise NotImplementedError

    def free(self, ids: list[int]) -> None:
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        """Whether the memory went back (close(), or shutdown_kvcached for kvcached's)."""
        raise NotImplementedError

    def check_open(self) -> None:
        """Raise KVCachedClosedError if the tensors lost their memory: a step over them would
        write into unmapped pages (SIGSEGV on the host, an illegal address on CUDA)."""
        if self.closed:
            raise KVCachedClosedError(f"this {type(self).__name__} was closed (close() or shutdown_kvcached()); "
                                      f"make a new cache and a new ServingLoop over it")

    def check_invariants(self) -> None:
        """Raise AssertionError if the block bookkeeping is inconsistent (tests)."""

    def report_demand(self, blocks: int) -> None:
        """The blocks the loop's waiting requests need: under a fair global budget, what this
        instance's share grows with (KVCacheManager.report_demand). A static cache ignores it."""

    def over_limit_blocks(self) -> int:
        """Blocks to give back now (the loop preempts that many): under a fair global budget,
        what this instance holds beyond its share while another waits. 0 for a static cache."""
        return 0

    def over_limit_pages(self) -> int:
        """Pages that must empty to meet the same cap as over_limit_blocks. 0 for a static cache."""
        return 0

    def pages_of(self, ids: list[int]) -> list[int]:
        """The page each block id lies in (blocks of one page go back to the device together);
        a static cache's blocks are their own pages."""
        return list(ids)

    def plan_compaction(self, pinned: list[int]) -> dict[int, int]:
        """{old id: new id}: blocks to move so that the pages beyond the cap empty without
        preemption, the new ids allocated (KVCacheManager.plan_compaction); {} for a static
        cache, which has no pages to give back."""
        return {}

    def copy_blocks(self, old: list[int], new: list[int]) -> None:
        """Copy blocks old[i] to new[i] (K and V, every layer), queued on the current stream."""
        if not old:
            return
        device = self.kv[0].device
        source, target = (torch.tensor(ids, dtype=torch.int64, device=device) for ids in (old, new))
        for kv in self.kv:      # indexing touches only these blocks; index_select / index_copy_ over
            kv[:, target] = kv[:, source]   # the [2, N, ...] view faulted on unmapped host pages

    def swap_bytes(self, num_blocks: int) -> int:
        """Host bytes swap_out takes for num_blocks blocks (K and V, every layer)."""
        return 2 * self.num_layers * num_blocks * self.block_size * self.cell_bytes

    def swap_out(self, ids: list[int]) -> torch.Tensor:
        """A host copy of blocks `ids` (K and V, every layer), queued on the current stream: pinned
        memory on CUDA, so the copy runs without the host waiting for it. The blocks may be freed
        and reused right after: their next writes come later on the same stream. Read it only
        through swap_in (on the same stream). See Note [Swapping out] in kvcached.serving.swap."""
        device = self.kv[0].device
        source = torch.tensor(ids, dtype=torch.int64, device=device)
        first = self.kv[0]
        host = torch.empty((len(self.kv), 2, len(ids), *first.shape[2:]), dtype=first.dtype,
                           pin_memory=device.type == "cuda")
        for layer, kv in enumerate(self.kv):
            host[layer].copy_(kv[:, source], non_blocking=True)     # indexing touches only these blocks
        return host

    def swap_in(self, host: torch.Tensor, ids: list[int]) -> None:
        """Write a swap_out copy into blocks `ids` (as many as it holds), queued on the current stream."""
        device = self.kv[0].device
        target = torch.tensor(ids, dtype=torch.int64, device=device)
        for layer, kv in enumerate(self.kv):
            kv[:, target] = host[layer].to(device, non_blocking=True)

    def mapped_bytes(self) -> int:
        """Device memory the cache holds now."""
        raise NotImplementedError

    def close(self) -> None:
        """Give the memory back (the tensors must not be used afterwards)."""


class StaticKVCache(PagedKVCache):
    """One preallocated tensor per layer and a free list of block ids: the comparison baseline."""

    def __init__(self, config, num_blocks: int, *, block_size: int = 16, dtype: torch.dtype = torch.float32,
                 device="cpu", kv_layout: str = "NHD"):
        super().__init__(config, num_blocks, block_size, dtype, kv_layout)
        shape = _layer_shape(self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim, kv_layout)
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
        self._free = list(range(self.num_blocks - 1, -1, -1))     # pop() hands out low ids first
        self._held = bytearray(self.num_blocks)                   # 1 for each id handed out
        self._closed = False

    def alloc(self, n: int) -> list[int] | None:
        """n distinct free block ids, lowest first, or None (nothing changed) when fewer are free.
        Raises TypeError / ValueError for a count that is not an int >= 0, KVCachedClosedError
        after close(). O(n)."""
        self.check_open()
        if isinstance(n, bool):
            raise TypeError(f"alloc(n={n!r}): n must be an integer count, not a bool")
        n = operator.index(n)
        if n < 0:
            raise ValueError(f"alloc(n={n}): n must be >= 0")
        if n > len(self._free):
            return None
        ids = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        for block_id in ids:
            self._held[block_id] = 1
        return ids[::-1]

    def free(self, ids: list[int]) -> None:
        """Give blocks back. Raises BlockStateError for an id out of range, not handed out (a
        double free) or repeated within `ids`, TypeError for a bool or a non-integer, both with
        nothing freed (as kvcached's allocator); KVCachedClosedError after close(). O(len(ids))."""
        self.check_open()
        checked = []
        for item in ids:
            if isinstance(item, bool):
                raise TypeError(f"block id {item!r} is a bool, not a block id; nothing was freed.")
            block_id = operator.index(item)
            if not 0 <= block_id < self.num_blocks:
                raise BlockStateError(f"block id {block_id} is not a block id of this allocator (valid: "
                                      f"[0, {self.num_blocks})); nothing was freed.")
            checked.append(block_id)
        seen = set()
        for block_id in checked:
            if not self._held[block_id]:
                raise BlockStateError(f"block id {block_id} is not allocated (never allocated, or already freed); "
                                      f"nothing was freed.")
            if block_id in seen:
                raise BlockStateError(f"block id {block_id} appears more than once in this call; nothing was freed.")
            seen.add(block_id)
        for block_id in checked:
            self._held[block_id] = 0
        self._free.extend(reversed(checked))

    def available_blocks(self) -> int:
        self.check_open()
        return len(self._free)

    def check_invariants(self) -> None:
        """Every id is free or handed out, exactly once. O(num_blocks)."""
        if self._closed:
            return
        free = set(self._free)
        assert len(free) == len(self._free), "a block id is in the free list twice"
        for block_id in range(self.num_blocks):
            assert (block_id in free) != bool(self._held[block_id]), f"block id {block_id} is free and held, or neither"

    def mapped_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self.kv = []
        self._free = []
        self._closed = True


class ElasticKVCache(PagedKVCache):
    """kvcached's tensors (``alloc_kv_cache``) and the group's ``KVCacheManager``.

    Pages are mapped as blocks are handed out and unmapped as they empty; ``manager`` takes
    memory limits, and a global budget (KVCACHED_GLOBAL_BUDGET) is honoured by alloc returning
    None. Call ``kvcached.init_kvcached`` first to pick the device or page size; otherwise the
    defaults apply. With the page_grouped layout the block ids are sparse (kvcached.layout).

    Under tensor parallelism (``init_kvcached(tp_rank=r, world_size=w)`` on every rank) build it
    on every rank from that rank's ``shard_config``: rank 0's cache has the manager, whose block
    ids are backed on every rank once alloc returns; on the other ranks ``manager`` is None and
    only the tensors are used (alloc and free raise RuntimeError). See Note [Leader and workers]
    in kvcached.serving.tp.
    """

    def __init__(self, config, num_blocks: int, *, block_size: int = 16, dtype: torch.dtype = torch.float32,
                 device="cpu", kv_layout: str = "NHD", group_id: int = 0, pool_name: str | None = None):
        from kvcached import KVCacheManager, alloc_kv_cache
        from kvcached.runtime import REGISTRY

        super().__init__(config, num_blocks, block_size, dtype, kv_layout)
        self.tp_rank = REGISTRY.tp_rank
        shape = _layer_shape(self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim, kv_layout)
        self.kv = alloc_kv_cache(shape, self.block_size, dtype, str(device), self.num_layers, kv_layout=kv_layout,
                                 group_id=group_id)
        self.manager = None if self.tp_rank else KVCacheManager(
            self.num_blocks, self.block_size, self.cell_bytes, self.num_layers, world_size=REGISTRY.world_size,
            group_id=group_id, pool_name=pool_name)
        self.shares_budget = self.manager is not None and self.manager.share() is not None

    def _scheduler(self):
        if self.manager is None:
            raise RuntimeError(f"this is tensor-parallel rank {self.tp_rank}: block ids come from rank 0's cache "
                               f"(its manager maps them on every rank); use this cache's tensors only")
        return self.manager

    def alloc(self, n: int) -> list[int] | None:
        return self._scheduler().alloc(n)

    def free(self, ids: list[int]) -> None:
        self._scheduler().free(ids)

    def available_blocks(self) -> int:
        return self._scheduler().available_size()

    def report_demand(self, blocks: int) -> None:
        if self.shares_budget:
            self.manager.report_demand(blocks)

    def over_limit_blocks(self) -> int:
        """Only under a global budget: the fair cap moves memory between instances, and waiting
        for this instance's next failed alloc would hold the other one up for steps."""
        return self.manager.over_limit_blocks() if self.shares_budget else 0

    def over_limit_pages(self) -> int:
        return self.manager.over_limit_pages() if self.shares_budget else 0

    def pages_of(self, ids: list[int]) -> list[int]:
        return self._scheduler().pages_of(ids)

    def plan_compaction(self, pinned: list[int]) -> dict[int, int]:
        return self.manager.plan_compaction(pinned) if self.shares_budget else {}

    def mapped_bytes(self) -> int:
        """Memory the cache holds now; under tensor parallelism, rank 0 counts every rank's."""
        return int(self._scheduler().get_mapped_memory_size())

    @property
    def closed(self) -> bool:
        return self.manager is not None and self.manager.closed

    def check_invariants(self) -> None:
        """The manager's (rank 0); a closed cache has none left to check."""
        if self.manager is not None and not self.manager.closed:
            self.manager.check_invariants()

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
