"""The Triton kernel behind write_kv on CUDA: one program per (token, KV head).

Imported only when a CUDA cache is written: the CPU torch wheel has no triton.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-not-found, unused-ignore]

from ._args import CacheGeometry
from .triton_decode import cache_pointer, device_of, element_type


@triton.jit(do_not_specialize=["slot_ptr"])     # See Note [One compile per model] in triton_decode
def _write_kernel(key_ptr, value_ptr, k_cache_addr, v_cache_addr, slot_ptr,
                  skt, skh, skd, svt, svh, svd,
                  ck_block, ck_token, ck_head, ck_dim, cv_block, cv_token, cv_head, cv_dim,
                  BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                  CACHE_DTYPE: tl.constexpr):
    k_cache_ptr = cache_pointer(k_cache_addr, CACHE_DTYPE, False)
    v_cache_ptr = cache_pointer(v_cache_addr, CACHE_DTYPE, False)
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        d = tl.arange(0, D_PAD)
        inside = d < HEAD_DIM
        k = tl.load(key_ptr + token * skt + head * skh + d * skd, mask=inside)
        v = tl.load(value_ptr + token * svt + head * svh + d * svd, mask=inside)
        tl.store(k_cache_ptr + block * ck_block + offset * ck_token + head * ck_head + d * ck_dim, k, mask=inside)
        tl.store(v_cache_ptr + block * cv_block + offset * cv_token + head * cv_head + d * cv_dim, v, mask=inside)


def write_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, geometry: CacheGeometry) -> None:
    """Launch the write kernel; arguments already checked by write_kv."""
    tokens, heads = key.shape[0], key.shape[1]
    with device_of(k_cache):
        _write_kernel[(tokens, heads)](
            key, value, k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping,
            *key.stride(), *value.stride(), *geometry.k_strides, *geometry.v_strides,
            BLOCK_SIZE=geometry.block_size, HEAD_DIM=geometry.head_dim,
            D_PAD=triton.next_power_of_2(geometry.head_dim), CACHE_DTYPE=element_type(k_cache))
