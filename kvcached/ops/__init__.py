"""Paged attention over kvcached tensors: write K/V into blocks, attend through block tables.

Every op takes ONE layer's K and V caches, ``kv[layer][0]`` and ``kv[layer][1]`` of
``alloc_kv_cache`` in any layout, or any tensors of the same shape and strides: NHD
``[blocks, block_size, KVH, D]`` or HND ``[blocks, KVH, block_size, D]`` (``kv_layout="HND"``).

- :func:`write_kv` stores a batch's new K/V at their slots (``block_id * block_size + offset``).
- :func:`paged_attention` is causal attention of a packed batch (prefill and decode mixed).
- :func:`paged_decode` is one query per sequence: a Triton kernel on CUDA, torch elsewhere.

Index tensors (slot mappings, block tables, lengths, query starts) are int32 or int64.
"""

from .attention import paged_attention, paged_decode
from .write import write_kv

__all__ = ["paged_attention", "paged_decode", "write_kv"]
