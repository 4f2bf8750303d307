"""Argument checks shared by the ops: one layer's K/V cache geometry and the batch descriptors.

Only shapes, dtypes and devices are checked here, never tensor contents: reading a CUDA tensor's
values would stall the stream on every call. The CPU path checks contents where it reads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..checks import as_int, check_kv_layout

MAX_HEAD_DIM = 256
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class CacheGeometry:
    """One layer's cache as the ops see it; strides in elements, in (block, token, head, dim) order
    whatever the kv_layout, taken from the tensors (page_grouped rows are not block_size*KVH*D apart)."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    k_strides: tuple[int, int, int, int]
    v_strides: tuple[int, int, int, int]


def _ordered_strides(cache: torch.Tensor, kv_layout: str) -> tuple[int, int, int, int]:
    s = cache.stride()
    return (s[0], s[1], s[2], s[3]) if kv_layout == "NHD" else (s[0], s[2], s[1], s[3])


_GEOMETRIES: dict[tuple, CacheGeometry] = {}
GEOMETRY_MEMO_SIZE = 1024       # distinct cache shapes remembered; the memo is emptied when full


def cache_geometry(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_layout: str) -> CacheGeometry:
    """Check one layer's K and V caches and read their geometry, once per distinct shape,
    strides, dtype and device (See Note [Geometry memo]). Raises ValueError or TypeError naming
    the bad argument and the fix."""
    key = None
    if isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor) and isinstance(kv_layout, str):
        key = (kv_layout, k_cache.shape, v_cache.shape, k_cache.stride(), v_cache.stride(), k_cache.dtype,
               v_cache.dtype, k_cache.device, v_cache.device)
        geometry = _GEOMETRIES.get(key)
        if geometry is not None:
            return geometry
    geometry = _check_geometry(k_cache, v_cache, kv_layout)
    if len(_GEOMETRIES) >= GEOMETRY_MEMO_SIZE:
        _GEOMETRIES.clear()
    _GEOMETRIES[key] = geometry
    return geometry


def _check_geometry(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_layout: str) -> CacheGeometry:
    check_kv_layout(kv_layout)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(cache, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
        if cache.dim() != 4:
            raise ValueError(f"{name} has shape {tuple(cache.shape)}; one layer's cache is 4-D, "
                             f"{'[blocks, block_size, heads, dim]' if kv_layout == 'NHD' else '[blocks, heads, block_size, dim]'}"
                             f" (pass kv[layer][0] and kv[layer][1] of alloc_kv_cache's tensors)")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype or k_cache.device != v_cache.device:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} on {k_cache.device} and v_cache "
                         f"{tuple(v_cache.shape)} {v_cache.dtype} on {v_cache.device} must match")
    if not k_cache.is_floating_point():
        raise TypeError(f"the caches hold {k_cache.dtype}; use a floating dtype (float32, float16, bfloat16)")
    n, a, b, head_dim = k_cache.shape
    block_size, heads = (a, b) if kv_layout == "NHD" else (b, a)
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim={head_dim} must be in [1, {MAX_HEAD_DIM}]")
    return CacheGeometry(n, block_size, heads, head_dim, _ordered_strides(k_cache, kv_layout),
                         _ordered_strides(v_cache, kv_layout))


# Note [Geometry memo]
# ~~~~~~~~~~~~~~~~~~~~
# Every op call needs the caches' geometry, and checking it costs tens of microseconds of Python
# (a model calls the ops once per layer per step). The checks and the geometry depend only on
# the two tensors' shapes, strides, dtypes and devices and on kv_layout, never on their addresses
# or contents, so a geometry computed once is valid for any tensors that match in those: the memo
# is keyed on exactly them (all layers of one model share an entry), and a key is stored only
# after the checks passed, so a bad pair misses the memo and raises as before. The memo holds
# at most GEOMETRY_MEMO_SIZE keys and is emptied when full (no eviction order to keep under
# threads); a lost entry only costs one check again.


def check_tokens(name: str, tensor: torch.Tensor, geometry: CacheGeometry, cache: torch.Tensor) -> None:
    """``tensor`` is ``[T, heads, head_dim]`` on the cache's device with its dtype."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3 or tensor.shape[2] != geometry.head_dim:
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"{name} has shape {shape}; it must be [tokens, heads, {geometry.head_dim}]")
    if tensor.dtype != cache.dtype or tensor.device != cache.device:
        raise ValueError(f"{name} is {tensor.dtype} on {tensor.device}, the cache {cache.dtype} on {cache.device}; "
                         f"convert it with .to(cache)")


def check_index(name: str, tensor: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    """An int32/int64 index tensor of exactly ``shape`` on ``device``."""
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in INDEX_DTYPES:
        what = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise TypeError(f"{name} is {what}; it must be an int32 or int64 tensor")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, the cache on {device}; move it with .to(cache.device)")


def check_scale(scale: float) -> float:
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale={scale!r} must be a float, usually head_dim ** -0.5") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"scale={scale!r} must be a finite positive float, usually head_dim ** -0.5")
    return value


def check_window(sliding_window) -> int | None:
    """None (full attention) or the number of positions a query sees, itself included."""
    if sliding_window is None:
        return None
    return as_int(sliding_window, "sliding_window", minimum=1, error=ValueError,
                  hint="a query at position p sees positions (p - sliding_window, p]; None for full attention")


def check_query_heads(query: torch.Tensor, geometry: CacheGeometry) -> int:
    """The GQA group size H / KVH."""
    heads = query.shape[1]
    if heads % geometry.num_kv_heads:
        raise ValueError(f"query has {heads} heads, not a multiple of the cache's {geometry.num_kv_heads} KV heads")
    return heads // geometry.num_kv_heads
