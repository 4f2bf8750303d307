"""The worker side: vLLM's KV cache tensors made by ``alloc_kv_cache`` instead of one static slab.

``allocate_kv_cache`` has the signature and result of ``vllm.v1.worker.utils.allocate_kv_cache``
(one ``[B, H, N, C]`` view per layer, in the spec's dtype, laid out as vLLM's KVCacheLayout
says inside a block), so vLLM's attention backends, and the Mamba layers of hybrid models, read
them unchanged. See Note [One vLLM page per kvcached block] and Note [Mamba state pages].
"""

from __future__ import annotations

import math

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.v1.executor.abstract import Executor
from vllm.v1.executor.uniproc_executor import UniProcExecutor
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import _DIM_B, _DIM_C, _DIM_H, _DIM_N, KVCacheLayout

from ...checks import as_int
from ...config import settings
from ...errors import KVCachedConfigError
from ...runtime import MAX_PAGE_BYTES, alloc_kv_cache, init_kvcached, initialised_page_bytes
from .block_pool import PoolGeometry, set_pool_geometry
from .tp import join_scheduler, publish_geometry, worker_world

# MLAAttentionSpec is a FullAttentionSpec; MambaSpec: the state layers of hybrid models (Note [Mamba state pages])
SUPPORTED_SPECS = (FullAttentionSpec, SlidingWindowSpec, MambaSpec)
DEFAULT_LAYOUT = KVCacheLayout.LBHNC


def allocate_kv_cache(kv_cache_config: KVCacheConfig, device, layout: KVCacheLayout | str | None = None,
                      kernel_block_sizes: list[int] | None = None, *, group_id: int = 0) -> dict[str, torch.Tensor]:
    """Reserve elastic storage for every layer of ``kv_cache_config`` in kvcached group
    ``group_id`` and return {layer name: [B, H, N, C] view}; then point the next ElasticBlockPool
    of this process at that group (set_pool_geometry), so its block ids are rows of these views.

    Layers whose KVCacheTensor placements start at the same byte alias one buffer, as in vLLM
    (cache groups overlay each other). layout: a KVCacheLayout or its name (default: the
    config's, else LBHNC) that keeps a block's H, N and C inside the block.

    kvcached's page must hold whole vLLM pages: initialised here (kvcached not initialised yet)
    its page is the least multiple of KVCACHED_PAGE_SIZE_MB that does. See Note [Pages of whole
    blocks].

    Raises KVCachedConfigError, with nothing allocated, for a spec other than full attention,
    sliding window, MLA or Mamba state (hybrid models), host-resident tensors, KV pages of
    different sizes, kvcached already initialised with pages that vLLM's page does not divide, a
    layout that splits a block, vLLM's sleep mode with a backend other than "kvcached" (Note [A
    sleep-mode backend] in sleep), or a vLLM engine whose executor runs the worker outside the
    scheduler's process (pages are mapped by the process that allocates blocks, the scheduler's:
    vLLM's uniproc executor). See Note [One process]. At tensor_parallel_size > 1 under vLLM's
    multiprocess executor this worker instead joins, as rank TP rank + 1, the kvcached instance
    that the scheduler's pool leads; pipeline parallelism and other executors are refused (See
    Note [vLLM at TP > 1] in tp.py).
    """
    world = worker_world()          # (TP rank, TP size) at TP > 1: See Note [vLLM at TP > 1] in tp.py
    _check_worker_in_scheduler_process(in_scheduler_process=world is None)
    group_id = as_int(group_id, "group_id", minimum=0)
    if not kv_cache_config.kv_cache_tensors:
        return {}
    layout = _resolve_layout(layout if layout is not None else kv_cache_config.kv_cache_layout)
    num_blocks = as_int(kv_cache_config.num_blocks, "kv_cache_config.num_blocks", minimum=1)
    placements = [(tensor, index, name, _layer_spec(kv_cache_config, tensor, name))
                  for tensor in kv_cache_config.kv_cache_tensors for index, name in enumerate(tensor.layers)]
    page_sizes = {spec.page_size_bytes for *_, spec in placements}
    if len(page_sizes) != 1:
        raise KVCachedConfigError(
            f"the KV cache specs have pages of {sorted(page_sizes)} bytes; kvcached gives one group one block size: "
            f"let vLLM unify the page size (hybrid models pad to one page size)")
    page_bytes = page_sizes.pop()
    _init_pages_of_whole_blocks(page_bytes, device, world)
    # See Note [One vLLM page per kvcached block]: one buffer per distinct start byte.
    slots: dict[int, int] = {}
    for tensor, index, _, _ in placements:
        slots.setdefault(tensor.offset + index * tensor.layer_stride, len(slots))
    buffers = alloc_kv_cache((num_blocks, 1, page_bytes), 1, torch.int8, device, len(slots), attention_type="MLA",
                             group_id=group_id)
    kv_caches: dict[str, torch.Tensor] = {}
    for tensor, index, name, spec in placements:
        buffer = buffers[slots[tensor.offset + index * tensor.layer_stride]]
        one_layer = KVCacheTensor(size=buffer.numel(), layers=[name], layer_stride=buffer.stride(0) * num_blocks,
                                  block_stride=buffer.stride(0))
        group_index = _group_index(kv_cache_config, name)
        kernel_block_size = None
        if kernel_block_sizes is not None and group_index < len(kernel_block_sizes):
            kernel_block_size = kernel_block_sizes[group_index]
        (kv_caches[name],) = create_kv_cache_views(buffer, spec, num_blocks, layout, one_layer,
                                                   kernel_block_size=kernel_block_size)
    set_pool_geometry(PoolGeometry(block_size=1, cell_size=page_bytes, num_layers=len(slots), num_kv_buffers=1,
                                   group_id=group_id, num_blocks=num_blocks))
    if world is not None:
        publish_geometry(*world, page_bytes, num_blocks, len(slots), group_id)
    return kv_caches


def _init_pages_of_whole_blocks(block_bytes: int, device, world: tuple[int, int] | None = None) -> None:
    """Initialise kvcached with pages that hold whole blocks of block_bytes (at TP > 1, `world`:
    as a rank of the scheduler's instance), or check that its pages do. See Note [Pages of whole
    blocks]."""
    page_bytes = initialised_page_bytes()
    if page_bytes is None:
        base_bytes = settings().page_size_mb << 20
        page_bytes = math.lcm(base_bytes, block_bytes)
        if page_bytes > MAX_PAGE_BYTES:
            raise KVCachedConfigError(
                f"vLLM's KV pages of {block_bytes} bytes fill kvcached's pages ({base_bytes} bytes, "
                f"KVCACHED_PAGE_SIZE_MB) whole only at {page_bytes} bytes, past kvcached's largest page of "
                f"{MAX_PAGE_BYTES} bytes: choose a --block-size that makes vLLM's page divide {base_bytes} bytes")
        if world is None:
            init_kvcached(device=device, page_size_bytes=page_bytes)
        else:
            join_scheduler(device, *world, page_bytes)
    elif world is not None:
        join_scheduler(device, *world, page_bytes)      # refuses a runtime initialised otherwise
    if page_bytes % block_bytes:
        whole_mb = math.lcm(page_bytes, block_bytes, 1 << 20) >> 20      # a multiple of the page: of the granularity
        raise KVCachedConfigError(
            f"kvcached is initialised with pages of {page_bytes} bytes, which do not hold whole vLLM KV pages of "
            f"{block_bytes} bytes (vLLM's block ids would straddle pages and some could never be handed out): "
            f"set KVCACHED_PAGE_SIZE_MB={whole_mb} (or leave kvcached uninitialised before vLLM allocates its KV "
            f"cache, which picks such a page)")


def _check_worker_in_scheduler_process(in_scheduler_process: bool = True) -> None:
    """Refuse, while vLLM initialises a worker (its current config is set), sleep mode with a
    backend other than kvcached's, and (in_scheduler_process: TP = 1) an executor that runs the
    worker in a process of its own. See Note [One process]."""
    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None:         # called by code that builds its own pool in this process
        return
    model_config = vllm_config.model_config
    if model_config is not None and model_config.enable_sleep_mode and model_config.sleep_mode_backend != "kvcached":
        raise KVCachedConfigError(
            f"vLLM's sleep mode is on with sleep_mode_backend={model_config.sleep_mode_backend!r}, which cannot "
            f"release kvcached's KV cache (it is not in vLLM's memory pool): use sleep_mode_backend='kvcached' "
            f"(--sleep-mode-backend kvcached), registered by kvcached's plugin. See Note [A sleep-mode backend]")
    if not in_scheduler_process:
        return
    backend = vllm_config.parallel_config.distributed_executor_backend
    executor = Executor.get_class(vllm_config)
    if not issubclass(executor, UniProcExecutor):
        raise KVCachedConfigError(
            f"vLLM runs this worker with the {executor.__name__} (distributed_executor_backend={backend!r}), in a "
            f"process other than the scheduler's, whose ElasticBlockPool would then map no page of these tensors: "
            f"kvcached needs the worker in the scheduler's process: distributed_executor_backend='uni' "
            f"(--distributed-executor-backend uni, vLLM's default for one GPU; on vLLM's CPU platform also "
            f"VLLM_ENABLE_V1_MULTIPROCESSING=0, without which vLLM replaces 'uni' by 'mp')")


def _resolve_layout(layout: KVCacheLayout | str | None) -> KVCacheLayout:
    if layout is None:
        return DEFAULT_LAYOUT
    if isinstance(layout, str):
        try:
            layout = KVCacheLayout[layout]
        except KeyError:
            raise KVCachedConfigError(f"layout={layout!r} is not a KVCacheLayout; use one of "
                                      f"{', '.join(m.name for m in KVCacheLayout)}") from None
    if not isinstance(layout, KVCacheLayout):
        raise KVCachedConfigError(f"layout={layout!r} must be a KVCacheLayout or its name")
    if not _block_holds_page(layout):
        fitting = [m.name for m in KVCacheLayout if _block_holds_page(m)]
        raise KVCachedConfigError(
            f"KV cache layout {layout.name} puts a dimension of the page outside the block, so one block is not "
            f"one range of memory that kvcached can map: use one of {', '.join(fitting)} (VLLM_KV_CACHE_LAYOUT)")
    return layout


def _block_holds_page(layout: KVCacheLayout) -> bool:
    """Whether B comes before H, N and C in memory order (a block is one range of memory)."""
    order = layout.stride_order
    return order.index(_DIM_B) < min(order.index(dim) for dim in (_DIM_H, _DIM_N, _DIM_C))


def _group_index(kv_cache_config: KVCacheConfig, layer_name: str) -> int:
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        if layer_name in group.layer_names:
            return index
    raise KVCachedConfigError(f"layer {layer_name!r} has a KV cache tensor but belongs to no KV cache group")


def _layer_spec(kv_cache_config: KVCacheConfig, tensor: KVCacheTensor, layer_name: str) -> KVCacheSpec:
    if tensor.host_resident:
        raise KVCachedConfigError(f"layer {layer_name!r} has a host-resident KV cache tensor (HiSparse); kvcached "
                                  f"backs device KV caches only: run without HiSparse")
    spec = kv_cache_config.kv_cache_groups[_group_index(kv_cache_config, layer_name)].kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = spec.kv_cache_specs[layer_name]
    if not isinstance(spec, SUPPORTED_SPECS) or not spec.has_layer_views:
        raise KVCachedConfigError(
            f"layer {layer_name!r} has a {type(spec).__name__}; kvcached's vLLM integration backs full attention, "
            f"sliding window, MLA and Mamba state layers (FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec, "
            f"MambaSpec): run this model without kvcached (unset KVCACHED_VLLM)")
    return spec


# Note [One vLLM page per kvcached block]
# vLLM 0.33 stores one layer's block as a "page" of H x N cells of C bytes (K and V packed in C,
# or one latent vector for MLA), and places layers in one flat buffer at offset + l *
# layer_stride + b * block_stride; layers whose placements start at the same byte share the
# bytes (cache groups of a hybrid model overlay each other, a block id belonging to one group
# at a time). Here every distinct start byte becomes one kvcached buffer of blocks of
# page_size_bytes (alloc_kv_cache's MLA form (N, 1, page_bytes) in int8: one opaque cell per
# block), and vLLM's own create_kv_cache_views cuts the [B, H, N, C] view of each layer out of
# its buffer with kvcached's block stride, so padding, kernel-block splitting and the layout's
# order inside a block are vLLM's. A layout that puts H, N or C outside B (LHBNC, BHLNC) spreads
# one block over the whole buffer: no page could back a block, so it is refused.
#
# Note [Mamba state pages]
# A hybrid model (Qwen3-Next, Granite 4.0-H, Jamba, Falcon-H1) has attention groups and Mamba
# groups (MambaSpec: a recurrent state per request instead of per-token KV). vLLM 0.33 makes
# their pages one size before it places them: the platform grows the attention block until its
# page is at least the Mamba state (Platform._align_hybrid_block_size) and pads the Mamba page to
# it (MambaSpec.page_size_padded), so a block id of the shared pool is one page of any group and
# the groups overlay one buffer, layer i of each group at the same byte. A Mamba layer's view is
# the same [B, H, N, C] int8 view as any other (C = the packed state bytes, the padding beyond
# them in the block stride), which MambaBase.bind_kv_cache cuts into its conv and SSM state
# tensors by byte offsets within C. So nothing here is specific to Mamba: the page size is one,
# the overlay is the start bytes', and create_kv_cache_views handles the padding; kvcached's
# pages back blocks of the padded page size. vLLM zeroes the blocks it hands to a Mamba group
# (KVCacheConfig.needs_kv_cache_zeroing, through the attention layers' views, which overlay the
# Mamba ones) because a state is read before it is written: that works on these views as on
# vLLM's slab, as each address it computes is a view's own. Specs whose layers take the raw
# buffer instead of a view (has_layer_views False: HiSparse) stay refused. The test builds
# vLLM's own config for hybrid model configs and compares every view and byte with vLLM's.
#
# Note [Pages of whole blocks]
# vLLM numbers its blocks 0..num_blocks-1 and hands out every one of them; kvcached hands out
# only the blocks lying wholly inside a page (kvcached.layout: a block that straddles two pages is
# never handed out). Plain attention pages are powers of two and divide kvcached's 2 MiB page,
# but the unified page of a hybrid model is not: the attention block grows to cover the Mamba
# state in steps of the kernel's block size (Granite-4.0-H-like: 96 tokens x 128 bytes = 12 KiB;
# Qwen3-Next: hundreds of tokens, pages of an odd multiple of 64 KiB), and neither is an MLA page
# of 576-byte latents. With a 2 MiB page and 12 KiB blocks every 171st id straddles, and vLLM's
# pool could never be given all its ids. Padding each block to a power of two would waste up to
# half the cache; a page of lcm(KVCACHED_PAGE_SIZE_MB, vLLM's page) wastes nothing and keeps block
# ids dense, at the price of a coarser unit of elasticity (6 MiB in the example, still one
# mapping per page id). The page size is one per process, fixed by init_kvcached, so it is chosen
# here when vLLM's allocation is the first use of kvcached; a process that initialised kvcached
# with other pages gets the exact KVCACHED_PAGE_SIZE_MB to use.
#
# Note [One process]
# kvcached maps a page in the process whose KVCacheManager allocates a block on it: vLLM's
# scheduler, through its ElasticBlockPool. The pool hands out rows of the worker's tensors only
# if both live in one process (set_pool_geometry is process-local); a worker elsewhere leaves the
# scheduler with a standalone pool that maps nothing of the tensors, and the first KV write
# faults. Which process runs the worker is decided by vLLM's executor: UniProcExecutor ("uni",
# and "external_launcher", its subclass) builds the worker inside the engine core's process,
# where the scheduler is, while MultiprocExecutor ("mp") and Ray start worker processes even for
# one GPU (vLLM 0.33 v1/executor/, v1/engine/core.py). VLLM_ENABLE_V1_MULTIPROCESSING moves the
# engine core, scheduler and executor together, out of the frontend's process, which splits
# nothing; but vLLM's CPU platform turns "uni" into "mp" unless it is 0 (platforms/cpu.py), so
# the message names both. The check is on the executor class, resolved as vLLM
# resolves it (Executor.get_class), in the worker: its initialize_from_config runs under
# set_current_vllm_config (v1/worker/worker_base.py), and the plugin loads in worker processes
# too, so the refusal comes from the process that would make the unusable tensors, before it
# makes them. The scheduler side cannot tell: vLLM builds its pool from num_gpu_blocks alone, no
# config current, exactly as its scheduler tests and the benchmark build standalone pools.
