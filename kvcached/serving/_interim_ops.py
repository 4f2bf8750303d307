"""Interim torch versions of kvcached.ops.write_kv / paged_attention, used only until
kvcached.ops provides them (same signatures; removed once it does)."""

from __future__ import annotations

import torch


def write_kv(key, value, k_cache, v_cache, slot_mapping, *, kv_layout="NHD") -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1] if kv_layout == "NHD" else k_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    if kv_layout == "NHD":
        k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
        v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)
    else:
        k_cache[blocks, :, offsets] = key[keep].to(k_cache.dtype)
        v_cache[blocks, :, offsets] = value[keep].to(v_cache.dtype)


def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, *,
                    sliding_window=None, kv_layout="NHD"):
    out = torch.empty_like(query)
    heads = query.shape[1]
    for r in range(block_tables.shape[0]):
        start, end = int(query_start_loc[r]), int(query_start_loc[r + 1])
        length = int(seq_lens[r])
        if end == start:
            continue
        block_size = k_cache.shape[1] if kv_layout == "NHD" else k_cache.shape[2]
        blocks = block_tables[r, :(length + block_size - 1) // block_size].long()
        if kv_layout == "NHD":
            k = k_cache[blocks].flatten(0, 1)[:length]
            v = v_cache[blocks].flatten(0, 1)[:length]
        else:
            k = k_cache[blocks].transpose(1, 2).flatten(0, 1)[:length]
            v = v_cache[blocks].transpose(1, 2).flatten(0, 1)[:length]
        groups = heads // k.shape[1]
        k = k.repeat_interleave(groups, dim=1).transpose(0, 1)
        v = v.repeat_interleave(groups, dim=1).transpose(0, 1)
        q = query[start:end].transpose(0, 1)
        qpos = torch.arange(length - (end - start), length, device=query.device)[:, None]
        kpos = torch.arange(length, device=query.device)[None, :]
        mask = kpos <= qpos
        if sliding_window is not None:
            mask &= kpos > qpos - sliding_window
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale).transpose(0, 1)
    return out
