"""Paged attention over kvcached tensors: write K/V into blocks, attend through block tables.

Every op takes ONE layer's K and V caches, ``kv[layer][0]`` and ``kv[layer][1]`` of
``alloc_kv_cache`` in any layout, or any tensors of the same shape and strides: NHD
``[blocks, block_size, KVH, D]`` or HND ``[blocks, KVH, block_size, D]`` (``kv_layout="HND"``).

- :func:`write_kv` stores a batch's new K/V at their slots (``block_id * block_size + offset``).
- :func:`paged_attention` is causal attention of a packed batch (prefill, chunked prefill and
  decode mixed): on CUDA one launch of a Triton kernel (triton_prefill; triton_decode when every
  request has one query), torch elsewhere.
- :func:`paged_decode` is one query per sequence: a Triton kernel on CUDA, torch elsewhere.

On CUDA nothing is read back to the host (no stream stall; a step can be captured in a CUDA
graph): only shapes, dtypes and devices are checked there, and the contents of the index tensors
(slot mappings, block tables, lengths, query starts: int32 or int64) are the caller's contract.
The CPU path checks them. A cache pair's geometry is checked once per distinct shape and strides.
"""

from .attention import paged_attention, paged_decode
from .write import write_kv

__all__ = ["paged_attention", "paged_decode", "write_kv"]
