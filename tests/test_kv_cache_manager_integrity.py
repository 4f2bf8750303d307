"""Data integrity through the real views: what is written to a live block stays there, whatever
else is allocated, freed, unmapped and mapped again, and no two live blocks share memory.

For each layout x engine shape, a seeded churn of alloc/free writes a pattern unique to
(block, layer, buffer) into every block it is handed, and after each step reads every live block
back through the tensors alloc_kv_cache returned. Only allocated rows are touched: an unmapped row
faults on the host backend, as on the GPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvcached import KVCacheManager, alloc_kv_cache, init_kvcached

from _stacks import KV_PAGE_BYTES

LAYOUTS = ("per_layer", "interleaved", "page_grouped")
SHAPE_KINDS = ("flash_attn", "flashinfer", "mla")
NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS = 3, 150, 16, 2
# Dense layouts get block sizes that do not divide the 64 KiB page (blocks straddle pages);
# page_grouped needs dividing ones.
GEOMETRY = {"dense": (24, 40), "page_grouped": (32, 64)}     # (head_dim, MLA dim)
DTYPE = torch.int32


def block_view(kv, shape_kind: str, layer: int, buffer: int, b: int):
    t = kv[layer]
    if shape_kind == "flash_attn":
        return t[buffer, b]
    if shape_kind == "flashinfer":
        return t[b, buffer]
    return t[b]


def gather(kv, shape_kind: str, layer: int, buffer: int, ids: list):
    idx = torch.tensor(ids, dtype=torch.long)
    t = kv[layer]
    if shape_kind == "flash_attn":
        return t[buffer][idx]
    if shape_kind == "flashinfer":
        return t[idx, buffer]
    return t[idx]


def pattern(b: int, layer: int, buffer: int) -> int:
    return (b * NUM_LAYERS + layer) * 2 + buffer + 1


def setup(kv_env, layout: str, shape_kind: str):
    kv_env(LAYOUT=layout, MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=1)
    head_dim, mla_dim = GEOMETRY["page_grouped" if layout == "page_grouped" else "dense"]
    init_kvcached(device="cpu", page_size_bytes=KV_PAGE_BYTES)
    if shape_kind == "mla":
        shape, buffers, cell = (NUM_BLOCKS, BLOCK_SIZE, mla_dim), 1, mla_dim * DTYPE.itemsize
        kv = alloc_kv_cache(shape, BLOCK_SIZE, DTYPE, "cpu", NUM_LAYERS, attention_type="MLA")
    else:
        blk = (BLOCK_SIZE, HEADS, head_dim)
        shape = (2, NUM_BLOCKS, *blk) if shape_kind == "flash_attn" else (NUM_BLOCKS, 2, *blk)
        buffers, cell = 2, HEADS * head_dim * DTYPE.itemsize
        kv = alloc_kv_cache(shape, BLOCK_SIZE, DTYPE, "cpu", NUM_LAYERS)
    m = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, cell, NUM_LAYERS, num_kv_buffers=buffers)
    return m, kv, buffers


def check_live(m, kv, shape_kind: str, buffers: int, live: list) -> None:
    if not live:
        return
    spans = []
    for layer in range(NUM_LAYERS):
        for buffer in range(buffers):
            got = gather(kv, shape_kind, layer, buffer, live).reshape(len(live), -1)
            want = torch.tensor([pattern(b, layer, buffer) for b in live], dtype=DTYPE)[:, None]
            bad = (got != want).any(dim=1)
            assert not bool(bad.any()), (
                f"layer {layer} buffer {buffer}: blocks {[live[i] for i in bad.nonzero().flatten().tolist()][:8]} "
                f"changed")
            for b in live:
                v = block_view(kv, shape_kind, layer, buffer, b)
                assert v.is_contiguous()
                spans.append((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size(), b, layer, buffer))
    spans.sort()
    for (s0, e0, *who0), (s1, e1, *who1) in zip(spans, spans[1:]):
        assert e0 <= s1, f"{who0} and {who1} share memory"


@pytest.mark.parametrize("shape_kind", SHAPE_KINDS)
@pytest.mark.parametrize("layout", [*LAYOUTS[:2], pytest.param(LAYOUTS[2], marks=pytest.mark.slow)])
def test_churn_keeps_every_live_block(kv_env, layout, shape_kind):
    m, kv, buffers = setup(kv_env, layout, shape_kind)
    rng = random.Random(f"{layout}/{shape_kind}")
    live: list = []
    unmaps_seen = 0
    for step in range(40):
        if live and (rng.random() < 0.45 or m.available_size() == 0):
            rng.shuffle(live)
            k = rng.randint(1, len(live))
            m.free(live[:k])
            del live[:k]
        else:
            n = rng.randint(1, max(1, min(40, m.available_size())))
            ids = m.alloc(n)
            assert ids is not None and len(ids) == n
            assert not set(ids) & set(live)
            for b in ids:
                assert 0 <= b < kv[0].shape[1 if shape_kind == "flash_attn" else 0]
                for layer in range(NUM_LAYERS):
                    for buffer in range(buffers):
                        block_view(kv, shape_kind, layer, buffer, b).fill_(pattern(b, layer, buffer))
            live += ids
        check_live(m, kv, shape_kind, buffers, live)
        unmaps_seen = m.stats()["pages"]["num_unmaps"]
        if step % 10 == 9:
            m.check_invariants()
    assert unmaps_seen > 0, "the churn never unmapped a page: it tests less than it should"
    m.free(live)
    assert m.stats()["allocated"] == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_remapped_block_is_writable_and_isolated(kv_env, layout):
    """Fill a whole page's worth of blocks, free them all (the page is unmapped: max pool 1 and
    a second page emptied first), allocate again: the new blocks are backed and independent."""
    m, kv, buffers = setup(kv_env, layout, "flash_attn")
    first = m.alloc(m.available_size())
    for b in first:
        for layer in range(NUM_LAYERS):
            for buffer in range(2):
                block_view(kv, "flash_attn", layer, buffer, b).fill_(pattern(b, layer, buffer))
    check_live(m, kv, "flash_attn", 2, first)
    m.free(first)
    m.trim()
    assert m.get_mapped_memory_size() == 0
    again = m.alloc(len(first))
    assert sorted(again) == sorted(first)
    for b in again:
        for layer in range(NUM_LAYERS):
            for buffer in range(2):
                block_view(kv, "flash_attn", layer, buffer, b).fill_(pattern(b, layer, buffer))
    check_live(m, kv, "flash_attn", 2, again)
