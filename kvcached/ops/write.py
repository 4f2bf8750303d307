"""write_kv: store a batch's new keys and values into their cache slots.

A slot is ``block_id * block_size + offset``; -1 skips the token (padding, or a token whose K/V
is already cached). On CUDA a Triton kernel does it without reading the slot mapping on the host
(no stream stall, capturable in a CUDA graph); elsewhere torch indexing.
"""

from __future__ import annotations

import torch

from ._args import cache_geometry, check_index, check_tokens


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, kv_layout: str = "NHD") -> None:
    """Write ``key[t]`` and ``value[t]`` (``[T, KVH, D]``) to slot ``slot_mapping[t]`` of one
    layer's caches; tokens whose slot is negative are skipped.

    The caches are ``[blocks, block_size, KVH, D]`` (NHD) or ``[blocks, KVH, block_size, D]`` (HND),
    any strides (kvcached views included). O(T * KVH * D).

    Raises TypeError/ValueError for shapes, dtypes or devices that do not match, and (CPU only,
    where it costs nothing) IndexError for a slot past the cache; nothing is written then. On
    CUDA, slots are the caller's contract: a slot past the cache is a device fault.
    """
    geometry = cache_geometry(k_cache, v_cache, kv_layout)
    check_tokens("key", key, geometry, k_cache)
    check_tokens("value", value, geometry, k_cache)
    if key.shape != value.shape or key.shape[1] != geometry.num_kv_heads:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must both be "
                         f"[tokens, {geometry.num_kv_heads}, {geometry.head_dim}]")
    check_index("slot_mapping", slot_mapping, (key.shape[0],), k_cache.device)
    if key.shape[0] == 0:
        return
    if k_cache.is_cuda:
        from .triton_write import write_kv_triton

        write_kv_triton(key, value, k_cache, v_cache, slot_mapping, geometry)
        return
    slots = slot_mapping.long()
    keep = slots >= 0
    slots = slots[keep]
    limit = geometry.num_blocks * geometry.block_size
    if slots.numel() and int(slots.max()) >= limit:
        raise IndexError(f"slot_mapping holds slot {int(slots.max())}, past the cache's {limit} slots "
                         f"({geometry.num_blocks} blocks of {geometry.block_size}); slot = block_id * block_size "
                         f"+ offset, -1 to skip")
    blocks, offsets = slots // geometry.block_size, slots % geometry.block_size
    if kv_layout == "NHD":
        k_cache[blocks, offsets] = key[keep]
        v_cache[blocks, offsets] = value[keep]
    else:
        k_cache[blocks, :, offsets] = key[keep]
        v_cache[blocks, :, offsets] = value[keep]
