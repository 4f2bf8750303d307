"""Process-wide kvcached state: the backend, the KV groups, and the calls serving code makes.

``init_kvcached`` picks the backend, ``alloc_kv_cache`` reserves a group's ranges and returns its
torch tensors, ``get_kv_cache_manager`` hands out the group's manager, ``shutdown_kvcached``
unmaps and releases everything (init may be called again afterwards).

Lock rule: ``_lock`` guards the registry below; every function here takes it. These are start-up
and shutdown calls, never on the alloc/free path.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from . import config
from .errors import KVCachedConfigError
from .layout import choose_layout, make_layout

logger = logging.getLogger("kvcached")

SHAPE_KINDS = ("flash_attn", "flashinfer", "mla")
MAX_HANDLE_CACHE = 256          # the backend's bound (_MAX_CACHED_HANDLES)
JOINT_KV_ATTENTION = ("hybrid", "mamba", "linear")
ATTENTION_TYPES = ("MHA", "GQA", "MQA", "MLA") + JOINT_KV_ATTENTION


@dataclass
class KVGroup:
    """The elastic storage of one group_id: its layout, ranges, page table and tensors."""

    group_id: int
    layout: object                      # kvcached.layout.KVLayout
    layout_reason: str
    ranges: list
    page_table: object                  # kvcached._core.PageTable
    tensors: list | None = field(default=None, repr=False)   # repr would read unmapped rows: segfault
    managers: list = field(default_factory=list)


@dataclass
class _Runtime:
    backend: object                     # kvcached._core.Backend
    device: str
    page_bytes: int
    tp_rank: int
    pp_rank: int
    is_worker: bool
    async_sched: bool
    groups: dict = field(default_factory=dict)


_lock = threading.RLock()
_runtime: _Runtime | None = None


def _parse_device(device) -> str:
    from ._core import cuda_device_count, cuda_unavailable_reason

    if device is None:
        if cuda_unavailable_reason() is not None:
            return "cpu"
        try:
            import torch

            return f"cuda:{torch.cuda.current_device()}"
        except Exception:
            return "cuda:0"
    text = str(device).strip().lower()
    if text == "cpu":
        return "cpu"
    if text == "cuda":
        text = "cuda:0"
    if text.startswith("cuda:") and text[5:].isdigit():
        reason = cuda_unavailable_reason()
        if reason is not None:
            raise KVCachedConfigError(f"device={device!r} needs CUDA, which is not usable here: {reason}. "
                                      f"Use device='cpu' for the host backend.")
        if int(text[5:]) >= cuda_device_count():
            raise KVCachedConfigError(f"device={device!r} does not exist: this machine has "
                                      f"{cuda_device_count()} CUDA device(s).")
        return text
    raise KVCachedConfigError(f"device={device!r} is not understood; use 'cpu', 'cuda' or 'cuda:N'.")


def _make_backend(device: str, page_bytes: int, host_capacity_bytes: int | None):
    from ._core import CudaBackend, HostBackend

    if device == "cpu":
        granularity = min(2 << 20, page_bytes)
        return HostBackend(granularity=granularity, capacity_bytes=host_capacity_bytes)
    return CudaBackend(int(device.split(":")[1]))


def init_kvcached(tp_rank: int = 0, world_size: int = 1, pp_rank: int = 0, is_worker: bool = False,
                  device=None, async_sched: bool = False, *, page_size_bytes: int | None = None,
                  host_capacity_bytes: int | None = None) -> None:
    """Set up kvcached for this process.

    device: "cuda:N", "cuda" or "cpu"; None = the current CUDA device if CUDA is usable, else the
    host backend. page_size_bytes overrides KVCACHED_PAGE_SIZE_MB (tests use small pages);
    host_capacity_bytes caps the host backend's physical memory (default: the machine's RAM).
    Calling it again with the same device is a no-op; with another, an error (shut down first).

    Raises KVCachedConfigError for a bad setting or argument; DriverUnavailableError if CUDA was
    asked for and cannot be used.
    """
    global _runtime
    if world_size != 1:
        raise KVCachedConfigError(
            f"world_size={world_size}: this release runs one kvcached instance per process and maps pages "
            f"in the process that allocates them; start one instance per rank with world_size=1.")
    if page_size_bytes is not None and (isinstance(page_size_bytes, bool) or not isinstance(page_size_bytes, int)
                                        or page_size_bytes <= 0):
        raise KVCachedConfigError(f"page_size_bytes={page_size_bytes!r} must be a positive int (bytes), a multiple "
                                  f"of the backend granularity, or None for KVCACHED_PAGE_SIZE_MB")
    settings = config.settings()
    logging.getLogger("kvcached").setLevel(settings.log_level)
    page_bytes = settings.page_size_mb << 20 if page_size_bytes is None else page_size_bytes
    with _lock:
        wanted = _parse_device(device)
        if _runtime is not None:
            # page_size_bytes=None asks for no particular size: engines call init again without it
            if _runtime.device != wanted or (page_size_bytes is not None and _runtime.page_bytes != page_bytes):
                raise KVCachedConfigError(
                    f"kvcached is already initialised on {_runtime.device} with pages of {_runtime.page_bytes} "
                    f"bytes; call shutdown_kvcached() before init_kvcached(device={device!r}).")
            return
        backend = _make_backend(wanted, page_bytes, host_capacity_bytes)
        if page_bytes <= 0 or page_bytes % backend.granularity:
            raise KVCachedConfigError(
                f"page size {page_bytes} bytes is not a positive multiple of the {backend.kind} granularity "
                f"({backend.granularity} bytes); set KVCACHED_PAGE_SIZE_MB to a multiple of "
                f"{max(1, backend.granularity >> 20)}.")
        _runtime = _Runtime(backend, wanted, page_bytes, tp_rank, pp_rank, is_worker, async_sched)
        logger.info("kvcached initialised on %s (%s backend, pages of %d bytes)", wanted, backend.kind, page_bytes)


def runtime() -> _Runtime:
    """The initialised runtime; initialises with the defaults if needed."""
    with _lock:
        if _runtime is None:
            init_kvcached()
        return _runtime


def _shape_kind(kvcache_shape, block_size: int, attention_type: str, kv_layout: str):
    """(shape_kind, num_blocks, block_shape in NHD order, num_kv_buffers) of an engine's shape."""
    shape = tuple(int(x) for x in kvcache_shape)
    if attention_type == "MLA":
        if kv_layout != "NHD":
            raise KVCachedConfigError("kv_layout='HND' has no meaning for MLA (no head dimension); use NHD")
        if len(shape) != 3 or shape[1] != block_size:
            raise KVCachedConfigError(
                f"MLA kvcache_shape must be (num_blocks, block_size={block_size}, dim), got {shape}")
        return "mla", shape[0], (shape[1], shape[2]), 1
    if len(shape) != 5:
        raise KVCachedConfigError(
            f"kvcache_shape {shape} is not understood: use FlashAttention (2, N, block_size, heads, head_dim), "
            f"FlashInfer (N, 2, block_size, heads, head_dim) or attention_type='MLA' with (N, block_size, dim)")
    if kv_layout == "HND":
        tail = (shape[3], shape[2], shape[4])        # stored (heads, block, dim); NHD block shape
    else:
        tail = shape[2:]
    if shape[0] == 2:
        kind, num_blocks = "flash_attn", shape[1]
    elif shape[1] == 2:
        kind, num_blocks = "flashinfer", shape[0]
    else:
        raise KVCachedConfigError(f"kvcache_shape {shape} has no K/V dimension of size 2 in front")
    if tail[0] != block_size:
        raise KVCachedConfigError(f"kvcache_shape {shape} holds blocks of {tail[0]} tokens, not block_size={block_size}")
    return kind, num_blocks, tail, 2


def _requested_rows(view, shape_kind: str, num_blocks: int):
    """The view cut to the num_blocks rows that were asked for: a dense layout's last page may
    hold ids past them, which the manager never hands out (kvcached.layout: Tensor extents)."""
    return view[:, :num_blocks] if shape_kind == "flash_attn" else view[:num_blocks]


def _create_group(rt: _Runtime, group_id: int, num_layers: int, num_kv_buffers: int, block_bytes: int,
                  num_blocks: int, joint_kv: bool) -> KVGroup:
    settings = config.settings()
    name, reason = choose_layout(settings.layout, rt.backend.kind, joint_kv)
    layout = make_layout(name, num_layers, num_kv_buffers, block_bytes, rt.page_bytes, num_blocks,
                         rt.backend.granularity)
    ranges = [rt.backend.reserve(size) for size in layout.range_sizes()]
    page_table = layout.page_table(rt.backend, ranges, zero_page=settings.zero_page)
    # Room in the handle cache for every mapping of one page id: a page unmapped and mapped
    # again (pool 0, or a pool edge) then skips cuMemCreate/cuMemRelease for all of them.
    # Under a global budget the cache stays off (KVCacheManager._attach_budget says why).
    if settings.global_budget is None and rt.backend.cache_capacity < page_table.num_segments:
        rt.backend.set_handle_cache_capacity(min(page_table.num_segments, MAX_HANDLE_CACHE))
    group = KVGroup(group_id, layout, reason, ranges, page_table)
    rt.groups[group_id] = group
    logger.info("group %d: %s layout (%s), %d pages of %d bytes", group_id, name, reason, layout.num_pages,
                page_table.page_bytes)
    return group


def alloc_kv_cache(kvcache_shape, block_size: int, dtype, device, num_layers: int, attention_type: str = "MHA",
                   kv_layout: str = "NHD", group_id: int = 0) -> list:
    """Reserve the elastic KV storage of `group_id` and return one torch tensor per layer.

    kvcache_shape is one layer's shape: FlashAttention ``(2, N, block_size, heads, head_dim)``,
    FlashInfer ``(N, 2, block_size, heads, head_dim)`` or, with attention_type="MLA",
    ``(N, block_size, dim)``; kv_layout "HND" puts heads before tokens. The tensors are views of
    virtual memory: a block is backed once a KVCacheManager of this group hands it out. They have
    exactly the requested shape, except with the opt-in page_grouped layout, whose block ids are
    sparse and whose N is the id space (see kvcached.layout).

    Raises KVCachedConfigError for a shape, dtype, device or group that does not fit.
    """
    import torch

    if attention_type not in ATTENTION_TYPES:
        raise KVCachedConfigError(f"attention_type={attention_type!r} is unknown; use one of {', '.join(ATTENTION_TYPES)}")
    if kv_layout not in ("NHD", "HND"):
        raise KVCachedConfigError(f"kv_layout={kv_layout!r} is unknown; use 'NHD' or 'HND'")
    if not isinstance(dtype, torch.dtype):
        raise KVCachedConfigError(f"dtype={dtype!r} is not a torch.dtype")
    if isinstance(group_id, bool) or not isinstance(group_id, int) or group_id < 0:
        raise KVCachedConfigError(f"group_id={group_id!r} must be an int >= 0")
    with _lock:
        if _runtime is None:
            init_kvcached(device=device)
        rt = _runtime
        if device is not None and _parse_device(device) != rt.device:
            raise KVCachedConfigError(f"device={device!r} differs from the initialised device {rt.device}")
        existing = rt.groups.get(group_id)
        if existing is not None and existing.tensors is not None:
            raise KVCachedConfigError(f"group_id={group_id} already has KV tensors; use another group_id or "
                                      f"call shutdown_kvcached() first")
        kind, num_blocks, block_shape, num_kv_buffers = _shape_kind(kvcache_shape, block_size, attention_type,
                                                                    kv_layout)
        block_bytes = dtype.itemsize
        for extent in block_shape:
            block_bytes *= extent
        joint_kv = attention_type in JOINT_KV_ATTENTION
        if existing is None:
            group = _create_group(rt, group_id, num_layers, num_kv_buffers, block_bytes, num_blocks, joint_kv)
        else:
            # A manager came first and made the group (kv_group): give it tensors if its geometry fits.
            group = kv_group(group_id, num_layers, num_kv_buffers, block_bytes, num_blocks)
            if joint_kv and group.layout.name != "interleaved":
                raise KVCachedConfigError(
                    f"group {group_id} was made by a manager with the {group.layout.name} layout, but "
                    f"attention_type={attention_type!r} needs interleaved: call alloc_kv_cache before making "
                    f"the manager")
        try:
            views = group.layout.views([r.tensor() for r in group.ranges], kind, dtype, block_shape, kv_layout)
        except BaseException:
            if existing is None:            # a failed call leaves no group behind
                del rt.groups[group_id]
                group.page_table.close()
            raise
        group.tensors = [_requested_rows(view, kind, num_blocks) for view in views] \
            if group.layout.name != "page_grouped" else views
        return group.tensors


def kv_group(group_id: int, num_layers: int, num_kv_buffers: int, block_bytes: int, num_blocks: int) -> KVGroup:
    """The group `group_id`, created without tensors if alloc_kv_cache did not make it.

    Raises KVCachedConfigError if the existing group's geometry differs."""
    with _lock:
        rt = runtime()
        group = rt.groups.get(group_id)
        if group is None:
            return _create_group(rt, group_id, num_layers, num_kv_buffers, block_bytes, num_blocks, False)
        layout = group.layout
        expected = (layout.num_layers, layout.num_kv_buffers, layout.block_bytes)
        if expected != (num_layers, num_kv_buffers, block_bytes):
            raise KVCachedConfigError(
                f"group {group_id} holds (num_layers, num_kv_buffers, block_bytes) = {expected}, but the manager "
                f"asks for {(num_layers, num_kv_buffers, block_bytes)}: pass the same geometry as alloc_kv_cache "
                f"(block_bytes = block_size * cell_size)")
        if num_blocks > layout.max_block_id:
            raise KVCachedConfigError(f"num_blocks={num_blocks} exceeds group {group_id}'s {layout.max_block_id} "
                                      f"blocks; ask alloc_kv_cache for more")
        return group


def get_kv_cache_manager(num_blocks: int, block_size: int, cell_size: int, num_layers: int,
                         num_kv_buffers: int = 2, group_id: int = 0, pool_name: str | None = None):
    """The manager of `group_id`, created on first use; later calls with the same arguments get the
    same manager. Raises KVCachedConfigError when the group's live manager was made with other
    arguments (a group has one manager at a time)."""
    from .kv_cache_manager import KVCacheManager

    with _lock:
        rt = runtime()
        group = rt.groups.get(group_id)
        for manager in group.managers if group is not None else ():
            if (manager.pool_name, manager.num_blocks, manager.block_size, manager.cell_size, manager.num_layers,
                    manager.num_kv_buffers) == (pool_name, num_blocks, block_size, cell_size, num_layers,
                                                num_kv_buffers):
                return manager
        # Otherwise a live manager of the group makes the constructor refuse: See Note
        # [One manager per group] in kv_cache_manager.
        return KVCacheManager(num_blocks, block_size, cell_size, num_layers, num_kv_buffers=num_kv_buffers,
                              group_id=group_id, pool_name=pool_name)


def managers() -> list:
    """Every live manager of this process (for instance-wide limits)."""
    with _lock:
        if _runtime is None:
            return []
        return [m for g in _runtime.groups.values() for m in g.managers]


def set_instance_memory_limit(limit_bytes: int, *, revision: int) -> dict:
    """Cap the KV memory of this whole process (every manager) at `limit_bytes`; -1 removes it.

    The limit is divided across the managers in proportion to their capacities, in whole pages
    (``mem_info_tracker.split_limit``), and each share is applied with ``set_memory_limit`` at the
    same `revision`. A revision that is stale or conflicting for any manager changes none of them.
    Returns ``{"status", "limit_bytes", "revision", "managers": [each manager's result]}``: status
    "applied", "deferred" (some share is below that manager's live pages, see Note [Limits] in
    kv_cache_manager), "stale" or "conflict". O(managers).

    Raises ValueError for a limit below -1 or a negative revision (nothing changed).
    """
    from .mem_info_tracker import NO_LIMIT, classify_limit_request, split_limit

    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes < NO_LIMIT:
        raise ValueError(f"limit_bytes={limit_bytes!r} must be an int >= 0, or -1 for no limit")
    if isinstance(revision, bool) or not isinstance(revision, int) or revision < 0:
        raise ValueError(f"revision={revision!r} must be an int >= 0")
    with _lock:
        pools = managers()
        page_sizes = {m.page_bytes for m in pools}
        shares = split_limit(limit_bytes, [m.num_pages * m.page_bytes for m in pools],
                             page_sizes.pop() if len(page_sizes) == 1 else 0)
        for verdict in ("stale", "conflict"):
            for m, share in zip(pools, shares):
                current = m.memory_limit()
                if classify_limit_request(current["limit_bytes"], current["revision"], share, revision) == verdict:
                    return {"status": verdict, "limit_bytes": limit_bytes, "revision": revision,
                            "managers": [m.memory_limit() for m in pools]}
        results = [m.set_memory_limit(share, revision=revision) for m, share in zip(pools, shares)]
        status = "deferred" if any(r["status"] == "deferred" for r in results) else "applied"
        return {"status": status, "limit_bytes": limit_bytes, "revision": revision, "managers": results}


def shutdown_kvcached() -> None:
    """Stop every manager, unmap and release every page and handle, forget the groups.

    Tensors returned by alloc_kv_cache must not be used afterwards (their pages are unmapped);
    their address ranges stay reserved until the last of them is dropped."""
    global _runtime
    with _lock:
        if _runtime is None:
            return
        rt, _runtime = _runtime, None
        for group in rt.groups.values():
            for manager in list(group.managers):
                manager.close()
            group.page_table.close()
        rt.backend.release_cached()
        rt.groups.clear()
        config.reload_settings()
