"""Process-wide kvcached state: the backend, the KV groups, and the calls serving code makes.

``init_kvcached`` picks the backend, ``alloc_kv_cache`` reserves a group's ranges and returns its
torch tensors, ``get_kv_cache_manager`` hands out the group's manager, ``shutdown_kvcached``
unmaps and releases everything (init may be called again afterwards). With world_size > 1 the
instance spans the ranks of a tensor-parallel group (kvcached.tp): See Note [Tensor-parallel runtime].

The runtime is the one registry of groups and managers: a manager gets what it needs of it
through ``REGISTRY`` at construction (Note [One registry] in kv_cache_manager).

Lock rule: ``_lock`` guards the registry below; every function here takes it, and so do the
manager's constructor and close(), through ``REGISTRY.lock`` (Note [One manager per group] in
kv_cache_manager). These are start-up and shutdown calls, never on the alloc/free path. See
Note [Runtime life cycle].
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import config
from ._steps import Steps
from .checks import as_int, check_kv_layout
from .errors import KVCachedClosedError, KVCachedConfigError
from .kv_cache_manager import (
    Group,
    KVCacheManager,
    check_geometry,
    check_limit_request,
    refuse_async_sched,
)
from .layout import KVLayout, choose_layout, make_layout
from .limits import classify_limit_request, split_limit

if TYPE_CHECKING:
    from .core import Backend, PageTable
    from .tp import Follower, Leader, TableMirror

logger = logging.getLogger("kvcached")

MAX_PAGE_BYTES = 1 << 30        # KVCACHED_PAGE_SIZE_MB's bound, 1024 MiB
JOINT_KV_ATTENTION = ("hybrid", "mamba", "linear")
ATTENTION_TYPES = ("MHA", "GQA", "MQA", "MLA") + JOINT_KV_ATTENTION


@dataclass
class KVGroup:
    """The elastic storage of one group_id: its layout, ranges, page table and tensors."""

    group_id: int
    layout: KVLayout
    layout_reason: str
    ranges: list
    page_table: PageTable
    tensors: list | None = field(default=None, repr=False)   # repr would read unmapped rows: segfault
    managers: list[KVCacheManager] = field(default_factory=list)
    peers: TableMirror | None = None      # tensor parallelism, scheduling rank: the table's mirror


@dataclass
class _Runtime:
    backend: Backend
    device: str
    page_bytes: int
    tp_rank: int
    world_size: int = 1
    tp: Leader | Follower | None = None     # world_size > 1: rank 0 leads, the others follow
    groups: dict = field(default_factory=dict)
    pid: int = field(default_factory=os.getpid)     # the process that made it; Note [Runtime life cycle]
    forked: bool = False


_lock = threading.RLock()
_runtime: _Runtime | None = None


def _check_usable(rt: _Runtime) -> None:
    if rt.forked:
        raise KVCachedClosedError(
            f"kvcached was initialised in process {rt.pid}; this forked child ({os.getpid()}) cannot use its "
            f"memory. Call shutdown_kvcached() in the child (it touches nothing of the parent), then "
            f"init_kvcached().")


def resolve_device(device: object) -> str:
    """The device string kvcached uses for ``device`` ("cpu" or "cuda:N"); None picks the current
    CUDA device when CUDA is usable, else "cpu". Raises KVCachedConfigError for a device that does
    not exist or is not understood, naming the ones that would work."""
    from .core import cuda_device_count, cuda_unavailable_reason

    if isinstance(device, str) and device.strip().lower() == "none":
        return "none"               # a tensor-parallel leader without pages: Note [Leader without pages]
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
    if text.startswith("cuda:") and text[5:].isascii() and text[5:].isdigit():
        reason = cuda_unavailable_reason()
        if reason is not None:
            raise KVCachedConfigError(f"device={device!r} needs CUDA, which is not usable here: {reason}. "
                                      f"Use device='cpu' for the host backend.")
        if int(text[5:]) >= cuda_device_count():
            raise KVCachedConfigError(f"device={device!r} does not exist: this machine has "
                                      f"{cuda_device_count()} CUDA device(s).")
        return text
    raise KVCachedConfigError(f"device={device!r} is not understood; use 'cpu', 'cuda' or 'cuda:N'.")


def _make_backend(device: str, page_bytes: int, page_source: str, host_capacity_bytes: int | None):
    """The backend of `device` for pages of `page_bytes` (what `page_source` names, for errors)."""
    from .core import CudaBackend, HostBackend

    if device == "cpu":
        granularity = min(2 << 20, page_bytes)
        backend = HostBackend(granularity=granularity, capacity_bytes=host_capacity_bytes)
        if page_bytes > backend.capacity_bytes:
            raise KVCachedConfigError(
                f"{page_source}: pages of {page_bytes} bytes are larger than the host backend's capacity of "
                f"{backend.capacity_bytes} bytes: not one page could be mapped; use a smaller page or a larger "
                f"host_capacity_bytes")
        return backend
    return CudaBackend(int(device.split(":")[1]))


def init_kvcached(tp_rank: int = 0, world_size: int = 1, pp_rank: int = 0, is_worker: bool = False,
                  device=None, async_sched: bool = False, *, page_size_bytes: int | None = None,
                  host_capacity_bytes: int | None = None, tp_group=None, tp_link=None) -> None:
    """Set up kvcached for this process.

    device: "cuda:N", "cuda" or "cpu"; None = the current CUDA device if CUDA is usable, else the
    host backend. page_size_bytes overrides KVCACHED_PAGE_SIZE_MB (tests use small pages), up to
    MAX_PAGE_BYTES; host_capacity_bytes caps the host backend's physical memory (default: the
    machine's RAM). async_sched=True is refused: allocation is synchronous. pp_rank (an int >= 0)
    and is_worker are accepted for compatibility with engines that pass them, and not kept:
    nothing in kvcached depends on them.
    Calling it again with the same arguments is a no-op; with another device, page size or
    world, an error (shut down first).

    world_size > 1 (tensor parallelism): every rank calls it, after
    torch.distributed.init_process_group, with its tp_rank; kvcached makes a gloo group of all
    ranks for its control messages (a collective call), or uses `tp_group` (a gloo group whose
    group ranks are the TP ranks). Rank 0 schedules: only it makes a KVCacheManager; the others
    map what it allocates. device="none" on rank 0 makes a leader without pages (a scheduler
    process that owns no device): ranks 1..world_size-1 hold the memory, its alloc_kv_cache
    returns no tensors and its managers count world_size - 1 ranks. See Note [Tensor-parallel
    runtime] and Note [Leader without pages] in core/ledger.pyx. `tp_link` replaces that
    collective set-up with a link already made for this rank (kvcached.tp.named: ranks that share
    no torch.distributed group, such as vLLM's scheduler and its workers); its rank and world
    size must be tp_rank and world_size.

    Raises KVCachedConfigError for a bad setting or argument, or a torch.distributed state that
    does not match; DriverUnavailableError if CUDA was asked for and cannot be used;
    KVCachedClosedError in a forked child that inherited an initialised kvcached (shut it down in
    the child first); KVCachedTPError if a peer rank does not answer.
    """
    global _runtime
    world_size = as_int(world_size, "world_size", minimum=1, hint="the tensor-parallel size")
    tp_rank = as_int(tp_rank, "tp_rank", minimum=0)
    if world_size > 1 and tp_rank >= world_size:
        raise KVCachedConfigError(f"tp_rank={tp_rank} is outside [0, {world_size}) for world_size={world_size}; "
                                  f"pass this process's rank in the tensor-parallel group")
    as_int(pp_rank, "pp_rank", minimum=0)       # checked, not kept: see the docstring
    refuse_async_sched(async_sched)
    if page_size_bytes is not None:
        page_size_bytes = as_int(page_size_bytes, "page_size_bytes", minimum=1, maximum=MAX_PAGE_BYTES,
                                 hint="bytes, a multiple of the backend granularity, or None for "
                                      "KVCACHED_PAGE_SIZE_MB")
    if host_capacity_bytes is not None:
        host_capacity_bytes = as_int(host_capacity_bytes, "host_capacity_bytes", minimum=1,
                                     hint="bytes of host memory the host backend may map, or None for all of it")
    settings = config.settings()
    logging.getLogger("kvcached").setLevel(settings.log_level)
    page_bytes = settings.page_size_mb << 20 if page_size_bytes is None else page_size_bytes
    page_source = (f"KVCACHED_PAGE_SIZE_MB={settings.page_size_mb}" if page_size_bytes is None
                   else f"page_size_bytes={page_size_bytes}")
    with _lock:
        wanted = resolve_device(device)
        if _runtime is not None:
            _check_usable(_runtime)
            # page_size_bytes=None asks for no particular size: engines call init again without it
            if _runtime.device != wanted or (page_size_bytes is not None and _runtime.page_bytes != page_bytes):
                raise KVCachedConfigError(
                    f"kvcached is already initialised on {_runtime.device} with pages of {_runtime.page_bytes} "
                    f"bytes; call shutdown_kvcached() before init_kvcached(device={device!r}).")
            if world_size > 1 and (_runtime.world_size, _runtime.tp_rank) != (world_size, tp_rank):
                raise KVCachedConfigError(
                    f"kvcached is already initialised as rank {_runtime.tp_rank} of {_runtime.world_size}; call "
                    f"shutdown_kvcached() before init_kvcached(tp_rank={tp_rank}, world_size={world_size}).")
            return
        if wanted == "none" and (world_size < 2 or tp_rank != 0):
            raise KVCachedConfigError(
                f"device='none' (a leader without pages) is for rank 0 of a tensor-parallel instance whose ranks "
                f"1..world_size-1 hold the memory; got tp_rank={tp_rank}, world_size={world_size}: pass a device "
                f"that holds pages, or tp_rank=0 and world_size = the workers + 1")
        backend = None if wanted == "none" else _make_backend(wanted, page_bytes, page_source, host_capacity_bytes)
        tp = None
        if backend is None:
            tp = _start_tp(tp_rank, world_size, tp_group, None, page_bytes, settings.tp_timeout_s,
                           settings.tp_transport, tp_link)
            backend = _ledger_backend(tp, page_bytes)
        if page_bytes <= 0 or page_bytes % backend.granularity:
            fix = (f"set KVCACHED_PAGE_SIZE_MB to a multiple of {max(1, backend.granularity >> 20)}"
                   if page_size_bytes is None else f"pass a multiple of {backend.granularity}")
            raise KVCachedConfigError(
                f"{page_source}: pages of {page_bytes} bytes are not a positive multiple of the {backend.kind} "
                f"granularity ({backend.granularity} bytes); {fix}.")
        if tp is None and world_size > 1:
            tp = _start_tp(tp_rank, world_size, tp_group, backend, page_bytes, settings.tp_timeout_s,
                           settings.tp_transport, tp_link)
        _runtime = _Runtime(backend, wanted, page_bytes, tp_rank, world_size, tp)
        if tp is not None:
            stop_at_exit()          # rank 0 stops its peers at exit; See Note [Tensor-parallel runtime]
        logger.info("kvcached initialised on %s (%s backend, pages of %d bytes, rank %d of %d)", wanted,
                    backend.kind, page_bytes, tp_rank, world_size)


def _start_tp(tp_rank: int, world_size: int, tp_group, backend: Backend | None, page_bytes: int,
              timeout_s: float, transport: str, link=None) -> Leader | Follower:
    """Rank 0: a Leader that has checked every peer's page size (and kept their backend's
    description in `peer_backend`); other ranks: a running Follower. Over `link` when given,
    else over the channel that open_channel sets up."""
    from .tp import Follower, Leader, open_channel

    if link is None:
        channel = open_channel(tp_rank, world_size, tp_group, timeout_s, transport)
    elif (link.rank, link.world_size) != (tp_rank, world_size):
        raise KVCachedConfigError(f"tp_link is rank {link.rank} of {link.world_size}, but init_kvcached was given "
                                  f"tp_rank={tp_rank}, world_size={world_size}: pass the link's rank and size")
    else:
        channel = link
    if tp_rank == 0:
        leader = Leader(channel)
        leader.peer_backend = leader.hello(page_bytes)
        return leader
    follower = Follower(channel, backend, page_bytes)
    follower.start()
    return follower


def _ledger_backend(leader: Leader, page_bytes: int):
    """The backend of a leader without pages: the peers' kind and granularity, no memory."""
    from .core.ledger import LedgerBackend

    kind, granularity, integrated = leader.peer_backend
    if kind not in ("cuda", "host") or granularity <= 0:
        leader.stop()
        raise KVCachedConfigError(f"the tensor-parallel ranks reported a {kind or 'unknown'} backend of {granularity}-byte "
                                  f"granules; a leader without pages needs ranks on cuda or host backends")
    return LedgerBackend(granularity, kind, integrated)


def initialised_as() -> tuple[int, int] | None:
    """(tp_rank, world_size) of this process's kvcached, or None if it is not initialised."""
    with _lock:
        return None if _runtime is None else (_runtime.tp_rank, _runtime.world_size)


def runtime() -> _Runtime:
    """The initialised runtime; initialises with the defaults if needed."""
    with _lock:
        if _runtime is None:
            init_kvcached()
        rt = _runtime
        assert rt is not None
        _check_usable(rt)
        return rt


def initialised_page_bytes() -> int | None:
    """The page size, in bytes, of this process's initialised kvcached; None before
    init_kvcached (or after shutdown_kvcached). Initialises nothing. O(1)."""
    with _lock:
        return None if _runtime is None else _runtime.page_bytes


def _shape_kind(kvcache_shape, block_size: int, attention_type: str, kv_layout: str):
    """(shape_kind, num_blocks, block_shape in NHD order, num_kv_buffers) of an engine's shape."""
    try:
        dims = list(kvcache_shape)
    except TypeError:
        raise KVCachedConfigError(f"kvcache_shape={kvcache_shape!r} must be a sequence of ints") from None
    shape = tuple(as_int(x, f"kvcache_shape[{i}]", minimum=1, hint=f"kvcache_shape={tuple(dims)!r} holds sizes")
                  for i, x in enumerate(dims))
    if attention_type == "MLA":
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
    name, reason = choose_layout(settings.layout, rt.backend.kind, joint_kv,
                                 integrated_memory=rt.backend.integrated_memory)
    layout = make_layout(name, num_layers, num_kv_buffers, block_bytes, rt.page_bytes, num_blocks,
                         rt.backend.granularity)
    ranges = [rt.backend.reserve(size) for size in layout.range_sizes()]
    page_table = layout.page_table(rt.backend, ranges, zero_page=settings.zero_page)
    # Room in the handle cache for every mapping of one page id: a page unmapped and mapped
    # again (pool 0, or a pool edge) then skips cuMemCreate/cuMemRelease for all of them.
    # Under a global budget the cache stays off (KVCacheManager._attach_budget says why).
    if settings.global_budget is None and rt.backend.cache_capacity < page_table.num_segments:
        from .core import MAX_HANDLE_CACHE_SIZE

        rt.backend.set_handle_cache_capacity(min(page_table.num_segments, MAX_HANDLE_CACHE_SIZE))
    group = KVGroup(group_id, layout, reason, ranges, page_table)
    if rt.tp is not None:
        try:
            _join_peers(rt, group)
        except BaseException:
            page_table.close()
            raise
    rt.groups[group_id] = group
    logger.info("group %d: %s layout (%s), %d pages of %d bytes", group_id, name, reason, layout.num_pages,
                page_table.page_bytes)
    return group


def _join_peers(rt: _Runtime, group: KVGroup) -> None:
    """Rank 0: wait until every peer has this group's table with the same geometry, then mirror
    the table to them. Other ranks: serve the table to rank 0."""
    from .tp import Leader

    table = group.page_table
    geometry = (config.LAYOUTS.index(group.layout.name), table.num_pages, table.num_segments, table.map_bytes)
    if isinstance(rt.tp, Leader):
        rt.tp.register(group.group_id, geometry)
        group.peers = rt.tp.table_mirror(group.group_id)
        table.set_mirror(group.peers)
    elif rt.tp is not None:
        rt.tp.add_table(group.group_id, table, geometry, _current_stream(rt))


def _current_stream(rt: _Runtime) -> int:
    """The CUDA stream current on this rank's device (0 on the host): a follower's unmap waits
    for the work queued on it."""
    if rt.backend.kind != "cuda":
        return 0
    import torch

    return int(torch.cuda.current_stream(rt.device).cuda_stream)


def alloc_kv_cache(kvcache_shape, block_size: int, dtype, device, num_layers: int, attention_type: str = "MHA",
                   kv_layout: str = "NHD", group_id: int = 0) -> list:
    """Reserve the elastic KV storage of `group_id` and return one torch tensor per layer.

    kvcache_shape is one layer's shape: FlashAttention ``(2, N, block_size, heads, head_dim)``,
    FlashInfer ``(N, 2, block_size, heads, head_dim)`` or, with attention_type="MLA",
    ``(N, block_size, dim)``; kv_layout "HND" puts heads before tokens. The tensors are views of
    virtual memory: a block is backed once a KVCacheManager of this group hands it out. They have
    exactly the requested shape, except with the opt-in page_grouped layout, whose block ids are
    sparse and whose N is the id space (see kvcached.layout). Only rows of allocated blocks may be
    read or written: an unallocated row has no memory behind it, so printing a tensor, summing it
    or saving it faults (a segfault on the host backend, an illegal address on CUDA), unless
    KVCACHED_ZERO_PAGE=1 backs every unallocated row with read-only zeros.

    Under tensor parallelism every rank calls it with its own shard's shape (the same number of
    blocks and bytes per block on every rank) and device; rank 0's call waits, up to
    KVCACHED_TP_TIMEOUT_S, for the others' (KVCachedConfigError if a rank's geometry differs).

    Raises KVCachedConfigError for a shape, dtype, device or group that does not fit.
    """
    import torch

    if attention_type not in ATTENTION_TYPES:
        raise KVCachedConfigError(f"attention_type={attention_type!r} is unknown; use one of {', '.join(ATTENTION_TYPES)}")
    check_kv_layout(kv_layout, has_heads=attention_type != "MLA")
    if not isinstance(dtype, torch.dtype):
        raise KVCachedConfigError(f"dtype={dtype!r} is not a torch.dtype")
    block_size = as_int(block_size, "block_size", minimum=1, hint="tokens per block")
    num_layers = as_int(num_layers, "num_layers", minimum=1)
    group_id = as_int(group_id, "group_id", minimum=0)
    with _lock:
        if _runtime is None:
            init_kvcached(device=device)
        rt = runtime()
        if device is not None and resolve_device(device) != rt.device:
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
            if num_blocks < group.layout.num_blocks:
                raise KVCachedConfigError(
                    f"alloc_kv_cache: kvcache_shape has {num_blocks} blocks, but the manager that made group "
                    f"{group_id} hands out {group.layout.num_blocks}: ids {num_blocks}..{group.layout.num_blocks - 1} "
                    f"would be no rows of kv[layer]; pass {group.layout.num_blocks} blocks, or call alloc_kv_cache "
                    f"before making the manager")
            if joint_kv and group.layout.name != "interleaved":
                raise KVCachedConfigError(
                    f"group {group_id} was made by a manager with the {group.layout.name} layout, but "
                    f"attention_type={attention_type!r} needs interleaved: call alloc_kv_cache before making "
                    f"the manager")
        if rt.device == "none":             # no memory here to view: Note [Leader without pages]
            group.tensors = []
            return group.tensors
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
    num_blocks, block_size, cell_size, num_layers, num_kv_buffers, group_id = check_geometry(
        num_blocks, block_size, cell_size, num_layers, num_kv_buffers, group_id)
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
                              group_id=group_id, pool_name=pool_name, registry=REGISTRY)


def managers() -> list[KVCacheManager]:
    """Every live manager of this process (for instance-wide limits); none in a forked child."""
    with _lock:
        if _runtime is None or _runtime.forked:
            return []
        return [m for g in _runtime.groups.values() for m in g.managers]


def set_instance_memory_limit(limit_bytes: int, *, revision: int) -> dict:
    """Cap the KV memory of this whole process (every manager) at `limit_bytes`; -1 removes it.

    The limit is divided across the managers in proportion to their capacities, in whole pages
    (``limits.split_limit``), and each share is applied with ``set_memory_limit`` at the
    same `revision`. A revision that is stale or conflicting for any manager changes none of them.
    Returns ``{"status", "limit_bytes", "revision", "managers": [each manager's result]}``: status
    "applied", "deferred" (some share is below that manager's live pages, see Note [Limits] in
    kv_cache_manager), "stale" or "conflict". O(managers).

    Raises KVCachedArgumentError (a ValueError) for a limit outside [-1, MAX_LIMIT_BYTES] or a
    revision outside [0, MAX_REVISION], bools and floats included (nothing changed).
    """
    limit_bytes, revision = check_limit_request(limit_bytes, revision)
    with _lock:
        runtime()
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
    their address ranges stay reserved until the last of them is dropped. Every manager is
    closed: its methods raise KVCachedClosedError. In a forked child it only forgets what the
    child inherited, touching nothing of the parent; init_kvcached may follow in both cases.
    Under tensor parallelism rank 0 then tells the other ranks to unmap everything and stop, and
    a rank > 0 first waits (KVCACHED_TP_TIMEOUT_S) for that (Note [Tensor-parallel runtime]).
    Each step runs even if one before it failed; the first error is raised at the end
    (KVCachedTPError on rank 0 if a peer died)."""
    global _runtime
    with _lock:
        if _runtime is None:
            return
        rt, _runtime = _runtime, None
        if rt.forked:
            config.reload_settings()
            return
        steps = Steps()
        if rt.tp is not None and rt.tp_rank:    # a peer: rank 0 unmaps through it first
            steps.run(_stop_following, rt)
        for group in rt.groups.values():
            for manager in list(group.managers):
                steps.run(manager._close,
                          f"the KVCacheManager of group {group.group_id} was closed by shutdown_kvcached(): call "
                          f"init_kvcached() and alloc_kv_cache() again, then make a new manager.")
            steps.run(group.page_table.close)
        if rt.tp is not None and not rt.tp_rank:
            steps.run(_stop_peers, rt)
        steps.run(rt.backend.release_cached)
        rt.groups.clear()
        config.reload_settings()
        steps.raise_first()


def _stop_peers(rt: _Runtime) -> None:
    """Rank 0's shutdown: every peer unmaps what is left and stops serving."""
    from .tp import Leader

    assert isinstance(rt.tp, Leader)
    rt.tp.stop()


def _stop_following(rt: _Runtime) -> None:
    """A peer's shutdown: wait (KVCACHED_TP_TIMEOUT_S) for rank 0 to stop it, then refuse its
    later requests. See Note [Tensor-parallel runtime]."""
    from .tp import Follower

    follower = rt.tp
    assert isinstance(follower, Follower)
    if not follower.wait_stopped(follower.channel.timeout_s):
        logger.warning("rank %d: rank 0 did not shut kvcached down within KVCACHED_TP_TIMEOUT_S; this rank's pages "
                       "are unmapped now and rank 0's later requests are refused", rt.tp_rank)
    follower.close()


def wait_for_scheduler(timeout_s: float | None = None) -> bool:
    """On a rank > 0 of a tensor-parallel instance: block until rank 0 has shut kvcached down
    (or was lost), for at most `timeout_s` seconds (None: no bound). Returns whether it has.
    Meanwhile this rank's service thread keeps mapping what rank 0 allocates. Raises
    KVCachedConfigError on rank 0 or without tensor parallelism."""
    from .tp import Leader

    with _lock:
        rt = runtime()
        follower = rt.tp
        if follower is None or isinstance(follower, Leader):
            raise KVCachedConfigError(f"wait_for_scheduler() is for ranks > 0 of a tensor-parallel instance; this is "
                                      f"rank {rt.tp_rank} of {rt.world_size}")
    return follower.wait_stopped(timeout_s)


def stop_at_exit() -> None:
    """Shut kvcached down at interpreter exit, before the trackers and budget handles made so far
    close themselves (atexit runs the last registration first). Assumes _lock."""
    atexit.unregister(_shutdown_at_exit)
    atexit.register(_shutdown_at_exit)


class _Registry:
    """The runtime as its managers see it (kv_cache_manager.Registry). See Note [One registry]
    in kv_cache_manager."""

    @property
    def lock(self) -> threading.RLock:
        return _lock        # read at each use: the fork handler replaces it

    @property
    def world_size(self) -> int:
        rt = runtime()       # the ranks that hold pages: a leader without pages holds none
        return rt.world_size - 1 if rt.device == "none" else rt.world_size

    @property
    def tp_rank(self) -> int:
        rt = runtime()
        return rt.tp_rank if rt.world_size > 1 else 0

    def group(self, group_id: int, num_layers: int, num_kv_buffers: int, block_bytes: int,
              num_blocks: int) -> KVGroup:
        return kv_group(group_id, num_layers, num_kv_buffers, block_bytes, num_blocks)

    def managers(self) -> list[KVCacheManager]:
        return managers()

    def add(self, group: Group, manager: KVCacheManager) -> None:
        group.managers.append(manager)
        stop_at_exit()

    def remove(self, group: Group, manager: KVCacheManager) -> None:
        if manager in group.managers:
            group.managers.remove(manager)


REGISTRY = _Registry()


def _shutdown_at_exit() -> None:
    try:
        shutdown_kvcached()
    except Exception:                  # exit must not fail on clean-up
        logger.exception("kvcached: shutdown at exit failed")


def _after_fork_in_child() -> None:
    """Runs in the child right after fork(): a new lock (the old one may be held by a thread
    that does not exist here), and the inherited runtime marked unusable. Touches nothing else."""
    global _lock
    _lock = threading.RLock()
    if _runtime is not None:
        _runtime.forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


# Note [Runtime life cycle]
# shutdown_kvcached() closes every manager (their methods raise KVCachedClosedError afterwards),
# then every group's page table, then the backend's handle cache. It also runs at interpreter
# exit, registered again by each new manager so that it runs before the trackers' and budget
# handles' own at-exit handlers: managers stop their threads before their segments go.
# A forked child inherits the runtime, its managers and their memory: on the host backend every
# mapped page is a shared mapping of the parent's pool memfd, so an unmap, a punched hole or a
# page handed out again would zero or alias the parent's live blocks; on CUDA the driver is
# unusable after fork. An at-fork handler gives the child a fresh _lock and marks the runtime
# forked (and kv_cache_manager's marks every manager): the inherited runtime then refuses every
# call, and shutdown_kvcached() in the child, or at its exit, only forgets it. The Cython core
# refuses to touch anything from an object made before the fork, its deallocators included
# (Note [Fork and close] in core/vmm.pyx), so the child's exit leaves the parent's cache untouched.
#
# Note [Tensor-parallel runtime]
# With world_size > 1 every rank of the TP group runs init_kvcached and alloc_kv_cache with its
# own device and shard shape; rank 0 alone makes managers and allocates (the scheduling rank),
# and its page tables carry a mirror (kvcached.tp.TableMirror) so that every map and unmap is
# repeated on the other ranks, all or nothing. The control messages go over a gloo group made in
# init_kvcached (dist.new_group: collective, so every rank calls init at the same point) beside
# the model's own group. init checks that every rank uses the same page size; rank 0's
# alloc_kv_cache waits for every rank's table of the group (same layout, page count and mapping
# sizes) before mirroring it. shutdown_kvcached on rank 0 closes its managers (their unmaps go to
# the peers), then tells every peer to unmap the rest and stop; on a peer it first waits for that
# (at most KVCACHED_TP_TIMEOUT_S; wait_for_scheduler() waits without bound), then refuses later
# requests and closes its tables. Each rank shuts down at exit too, so a normal exit of every rank
# needs no call. A peer that dies makes rank 0's next call that needs it raise KVCachedTPError,
# and every one after (the ranks no longer agree on what is mapped): restart every rank.
# A forked child inherits none of it: the runtime is marked forked and its shutdown only forgets.
