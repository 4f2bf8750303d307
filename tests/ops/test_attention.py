"""kvcached.ops: write_kv, paged_attention and paged_decode against SDPA on dense copies.

Every case writes random K/V through write_kv into blocks placed at random, then compares the
paged result with torch's scaled_dot_product_attention over the dense per-request K/V (float64).
Caches are plain tensors poisoned with NaN outside the written slots (a read of any block outside
the tables, or of a slot past seq_len, would make the output NaN), and kvcached tensors of every
layout on the host backend with the zero page off and no pool (a read of an unmapped page faults).
The Triton kernel runs against the torch path on CUDA (marker gpu) and, where triton is installed
(>= 3.9, or an older one with numpy < 2.4), on the CPU under TRITON_INTERPRET=1. The prefill
kernel's own tests are in test_triton_prefill.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _stacks import KV_PAGE_BYTES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcached import KVCacheManager, alloc_kv_cache, init_kvcached
from kvcached.checks import KV_LAYOUTS
from kvcached.errors import KVCachedArgumentError
from kvcached.ops import paged_attention, paged_decode, write_kv

LAYOUTS = ("per_layer", "interleaved", "page_grouped")
HEAD_DIMS = (16, 48, 64, 80, 96, 128, 256)
BLOCK_SIZES = (16, 32, 64, 128)
GARBAGE = 1 << 30                        # unused block-table entries: read one and the index fails


def cache_shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, kv_layout: str) -> tuple:
    if kv_layout == "NHD":
        return (num_blocks, block_size, kv_heads, head_dim)
    return (num_blocks, kv_heads, block_size, head_dim)


def plain_caches(num_blocks, block_size, kv_heads, head_dim, kv_layout, dtype=torch.float32, device="cpu"):
    """A K and a V cache full of NaN: only what write_kv stores is a number."""
    shape = cache_shape(num_blocks, block_size, kv_heads, head_dim, kv_layout)
    return (torch.full(shape, float("nan"), dtype=dtype, device=device),
            torch.full(shape, float("nan"), dtype=dtype, device=device))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """SDPA (float64) of q [q_len, H, D], the last q_len positions, over dense k/v [S, KVH, D]."""
    q_len, heads, _ = q.shape
    length, kv_heads, _ = k.shape
    q_pos = torch.arange(length - q_len, length)[:, None]
    k_pos = torch.arange(length)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    kk = k.double().transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
    vv = v.double().transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
    return F.scaled_dot_product_attention(q.double().cpu().transpose(0, 1), kk.cpu(), vv.cpu(), attn_mask=mask,
                                          scale=scale).transpose(0, 1)


class Batch:
    """Random requests written into the given block ids of one layer's caches."""

    def __init__(self, k_cache, v_cache, kv_layout: str, block_ids: list[int], seq_lens: list[int],
                 q_lens: list[int], heads: int, seed: int = 0, padding: int = GARBAGE):
        gen = torch.Generator().manual_seed(seed)
        geometry_shape = k_cache.shape
        self.block_size = geometry_shape[1] if kv_layout == "NHD" else geometry_shape[2]
        kv_heads = geometry_shape[2] if kv_layout == "NHD" else geometry_shape[1]
        head_dim = geometry_shape[3]
        device, dtype = k_cache.device, k_cache.dtype
        order = torch.randperm(len(block_ids), generator=gen).tolist()
        free = [block_ids[i] for i in order]
        bs = self.block_size
        max_blocks = max(-(-n // bs) for n in seq_lens) + 1
        self.block_tables = torch.full((len(seq_lens), max_blocks), padding, dtype=torch.int32)
        self.dense = []
        keys, values, slots = [], [], []
        for r, length in enumerate(seq_lens):
            ids = [free.pop() for _ in range(-(-length // bs))]
            self.block_tables[r, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
            k = torch.randn(length, kv_heads, head_dim, generator=gen).to(dtype)
            v = torch.randn(length, kv_heads, head_dim, generator=gen).to(dtype)
            self.dense.append((k, v))
            keys.append(k)
            values.append(v)
            slots.append(torch.tensor([ids[t // bs] * bs + t % bs for t in range(length)]))
        # One write for the whole batch, in a shuffled order, with skipped (-1) NaN tokens mixed in.
        key, value, slot = torch.cat(keys), torch.cat(values), torch.cat(slots)
        extra = key.shape[0] // 10 + 1
        junk = torch.full((extra, kv_heads, head_dim), float("nan"), dtype=dtype)
        order = torch.randperm(key.shape[0] + extra, generator=gen)
        write_kv(torch.cat([key, junk])[order].to(device), torch.cat([value, junk])[order].to(device),
                 k_cache, v_cache, torch.cat([slot, torch.full((extra,), -1)])[order].to(device),
                 kv_layout=kv_layout)
        self.block_tables = self.block_tables.to(device)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                                            device=device)
        self.queries = [torch.randn(n, heads, head_dim, generator=gen).to(dtype) for n in q_lens]
        self.query = torch.cat(self.queries).to(device)
        self.scale = head_dim ** -0.5

    def expected(self, window: int | None) -> torch.Tensor:
        return torch.cat([reference(q, k, v, self.scale, window) for q, (k, v) in zip(self.queries, self.dense)])


def assert_close(out: torch.Tensor, expected: torch.Tensor, atol: float) -> None:
    assert torch.isfinite(out).all(), "NaN/inf in the output: a slot outside the tables or past seq_len was read"
    err = (out.double().cpu() - expected).abs().max().item()
    assert err <= atol, f"max abs error {err} > {atol}"


@st.composite
def batches(draw, decode: bool | None = None):
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    kv_heads = draw(st.sampled_from((1, 2, 4)))
    group = draw(st.sampled_from((1, 2, 3, 8)))
    seq_lens = draw(st.lists(st.integers(1, 3 * block_size + 5), min_size=1, max_size=4))
    is_decode = draw(st.booleans()) if decode is None else decode
    q_lens = [1 if is_decode else draw(st.integers(1, n)) for n in seq_lens]
    window = draw(st.one_of(st.none(), st.integers(1, 2 * block_size)))
    kv_layout = draw(st.sampled_from(KV_LAYOUTS))
    return dict(block_size=block_size, head_dim=head_dim, kv_heads=kv_heads, heads=kv_heads * group,
                seq_lens=seq_lens, q_lens=q_lens, window=window, kv_layout=kv_layout, seed=draw(st.integers(0, 99)))


def make_plain_batch(case: dict, dtype=torch.float32, device="cpu", spare_blocks: int = 3,
                     padding: int = GARBAGE) -> tuple:
    bs = case["block_size"]
    needed = sum(-(-n // bs) for n in case["seq_lens"])
    num_blocks = needed + spare_blocks
    k_cache, v_cache = plain_caches(num_blocks, bs, case["kv_heads"], case["head_dim"], case["kv_layout"], dtype,
                                    device)
    batch = Batch(k_cache, v_cache, case["kv_layout"], list(range(num_blocks)), case["seq_lens"], case["q_lens"],
                  case["heads"], case["seed"], padding)
    return k_cache, v_cache, batch


# -- attention on plain caches -------------------------------------------------------------------

@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_paged_attention_matches_sdpa(case):
    k_cache, v_cache, batch = make_plain_batch(case)
    out = paged_attention(batch.query, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                          batch.scale, sliding_window=case["window"], kv_layout=case["kv_layout"])
    assert out.shape == batch.query.shape
    assert_close(out, batch.expected(case["window"]), 1e-5)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(decode=True))
def test_paged_decode_matches_sdpa(case):
    k_cache, v_cache, batch = make_plain_batch(case)
    out = paged_decode(batch.query, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.scale,
                       sliding_window=case["window"], kv_layout=case["kv_layout"])
    assert_close(out, batch.expected(case["window"]), 1e-5)


@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_non_contiguous_query_and_bf16(kv_layout):
    """HF hands the query over as a transposed view; bf16 as a model would run."""
    case = dict(block_size=16, head_dim=64, kv_heads=2, heads=8, seq_lens=[20, 47, 3], q_lens=[20, 5, 1],
                window=None, kv_layout=kv_layout, seed=1)
    k_cache, v_cache, batch = make_plain_batch(case, dtype=torch.bfloat16)
    query = batch.query.transpose(0, 1).contiguous().transpose(0, 1)
    assert not query.is_contiguous()
    out = paged_attention(query, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                          batch.scale, kv_layout=kv_layout)
    assert_close(out, batch.expected(None), 3e-2)
    last = batch.query_start_loc[1:].long() - 1
    decode = paged_decode(query[last], k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.scale,
                          kv_layout=kv_layout)
    assert_close(decode, batch.expected(None)[last], 3e-2)


def test_window_blocks_before_the_window_are_not_read():
    """Blocks wholly before a sliding window may be released by an engine: they are never read."""
    case = dict(block_size=16, head_dim=32, kv_heads=1, heads=2, seq_lens=[100, 70], q_lens=[1, 1], window=20,
                kv_layout="NHD", seed=2)
    k_cache, v_cache, batch = make_plain_batch(case)
    for r, length in enumerate(case["seq_lens"]):
        first_needed = (length - case["window"]) // 16
        for col in range(first_needed):
            k_cache[batch.block_tables[r, col]] = float("nan")
            v_cache[batch.block_tables[r, col]] = float("nan")
        batch.block_tables[r, :first_needed] = GARBAGE
    out = paged_decode(batch.query, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.scale,
                       sliding_window=case["window"])
    assert_close(out, batch.expected(case["window"]), 1e-5)


# -- the block-table contract ----------------------------------------------------------------------

def read_columns(case: dict, r: int) -> range:
    """The block-table columns of request r that attention reads: from the block of the first
    position its queries see (the sliding window's start) to the block of its last cached token."""
    bs, seq_len, q_len, window = case["block_size"], case["seq_lens"][r], case["q_lens"][r], case["window"]
    first_token = max(0, seq_len - q_len - window + 1) if window is not None else 0
    return range(first_token // bs, (seq_len - 1) // bs + 1)


def attend(case: dict, k_cache, v_cache, batch) -> list[torch.Tensor]:
    """paged_attention, and paged_decode too when every request has one query."""
    args = dict(sliding_window=case["window"], kv_layout=case["kv_layout"])
    outs = [paged_attention(batch.query, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                            batch.query_start_loc, batch.scale, **args)]
    if all(n == 1 for n in case["q_lens"]):
        outs.append(paged_decode(batch.query, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.scale,
                                 **args))
    return outs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_minus_one_padding_outside_the_read_columns(case):
    """-1 past each row's blocks (and before its sliding window, blocks an engine may release)
    is never read: the output matches the reference."""
    k_cache, v_cache, batch = make_plain_batch(case, padding=-1)
    for r in range(len(case["seq_lens"])):
        batch.block_tables[r, :read_columns(case, r).start] = -1
    for out in attend(case, k_cache, v_cache, batch):
        assert_close(out, batch.expected(case["window"]), 1e-5)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(), st.data())
def test_bad_block_id_in_the_read_columns_is_refused(case, data):
    """A negative id (torch would read it as a block from the end) or one past the cache's blocks
    where attention reads is refused on the CPU, naming the entry and the fix; -1 padding past
    the length is accepted."""
    k_cache, v_cache, batch = make_plain_batch(case, padding=-1)
    num_blocks = k_cache.shape[0]
    r = data.draw(st.integers(0, len(case["seq_lens"]) - 1), label="request")
    col = data.draw(st.sampled_from(read_columns(case, r)), label="column")
    bad = data.draw(st.sampled_from([-1, -2, -num_blocks, num_blocks, num_blocks + 7, 2**31 - 1]), label="id")
    batch.block_tables[r, col] = bad
    args = dict(sliding_window=case["window"], kv_layout=case["kv_layout"])
    message = (rf"block_tables\[{r}, {col}\]={bad} is not a block of the cache \(ids 0\.\.{num_blocks - 1}\)"
               rf".*used prefix")
    with pytest.raises(KVCachedArgumentError, match=message):
        paged_attention(batch.query, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                        batch.scale, **args)
    if all(n == 1 for n in case["q_lens"]):
        with pytest.raises(KVCachedArgumentError, match=message):
            paged_decode(batch.query, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.scale, **args)


# -- write_kv --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_write_kv_stores_exactly_the_slots(kv_layout):
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = plain_caches(6, 16, 2, 80, kv_layout)
    key, value = torch.randn(30, 2, 80, generator=gen), torch.randn(30, 2, 80, generator=gen)
    slots = torch.randperm(6 * 16, generator=gen)[:30]
    slots[::4] = -1
    write_kv(key, value, k_cache, v_cache, slots.to(torch.int32), kv_layout=kv_layout)
    as_nhd = (lambda c: c) if kv_layout == "NHD" else (lambda c: c.transpose(1, 2))
    flat_k, flat_v = as_nhd(k_cache).reshape(96, 2, 80), as_nhd(v_cache).reshape(96, 2, 80)
    kept = slots >= 0
    assert torch.equal(flat_k[slots[kept]], key[kept]) and torch.equal(flat_v[slots[kept]], value[kept])
    untouched = torch.ones(96, dtype=torch.bool)
    untouched[slots[kept]] = False
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()


def test_write_kv_refuses_and_writes_nothing():
    k_cache, v_cache = plain_caches(2, 16, 1, 32, "NHD")
    key = torch.zeros(3, 1, 32)
    with pytest.raises(IndexError, match="slot 32, past the cache's 32 slots"):
        write_kv(key, key, k_cache, v_cache, torch.tensor([0, 5, 32]))
    assert torch.isnan(k_cache).all() and torch.isnan(v_cache).all()
    with pytest.raises(ValueError, match="convert it"):
        write_kv(key.double(), key.double(), k_cache, v_cache, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"\[tokens, 1, 32\]"):
        write_kv(torch.zeros(3, 2, 32), torch.zeros(3, 2, 32), k_cache, v_cache, torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match="int32 or int64"):
        write_kv(key, key, k_cache, v_cache, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match=r"slot_mapping has shape \(2,\)"):
        write_kv(key, key, k_cache, v_cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="kv_layout='XYZ'"):
        write_kv(key, key, k_cache, v_cache, torch.tensor([0, 1, 2]), kv_layout="XYZ")
    assert torch.isnan(k_cache).all()


# -- argument checks -------------------------------------------------------------------------------

def _decode_args(**over):
    k_cache, v_cache = plain_caches(4, 16, 2, 64, "NHD")
    args = dict(query=torch.zeros(2, 4, 64), k_cache=k_cache, v_cache=v_cache,
                block_tables=torch.zeros(2, 2, dtype=torch.int32), seq_lens=torch.tensor([3, 17], dtype=torch.int32),
                scale=0.125)
    args.update(over)
    return args


@pytest.mark.parametrize("over, error, match", [
    (dict(query=torch.zeros(2, 3, 64)), ValueError, "3 heads, not a multiple of the cache's 2 KV heads"),
    (dict(query=torch.zeros(2, 4, 32)), ValueError, r"\[tokens, heads, 64\]"),
    (dict(query=torch.zeros(2, 4, 64, dtype=torch.float16)), ValueError, "convert it"),
    (dict(k_cache=torch.zeros(4, 16, 2, 300), v_cache=torch.zeros(4, 16, 2, 300)), ValueError,
     r"head_dim=300 must be in \[1, 256\]"),
    (dict(v_cache=torch.zeros(4, 16, 2, 32)), ValueError, "must match"),
    (dict(k_cache=torch.zeros(4, 16, 64), v_cache=torch.zeros(4, 16, 64)), ValueError, "4-D"),
    (dict(block_tables=torch.zeros(3, 2, dtype=torch.int32)), ValueError, r"block_tables has shape \(3, 2\)"),
    (dict(block_tables=torch.zeros(2, 2)), TypeError, "int32 or int64"),
    (dict(seq_lens=torch.tensor([3, 33], dtype=torch.int32)), ValueError, r"seq_lens\[1\]=33 must be in \[1, 32\]"),
    (dict(seq_lens=torch.tensor([0, 3], dtype=torch.int32)), ValueError, r"seq_lens\[0\]=0"),
    (dict(scale=float("nan")), ValueError, "scale=nan"),
    (dict(scale=-1.0), ValueError, "finite positive"),
    (dict(scale="x"), TypeError, "scale='x'"),
    (dict(sliding_window=0), ValueError, "sliding_window=0"),
    (dict(sliding_window=True), ValueError, "sliding_window=True"),
    (dict(sliding_window=4.0), ValueError, "sliding_window=4.0"),
    (dict(kv_layout="nhd"), ValueError, "kv_layout='nhd'"),
])
def test_decode_refuses(over, error, match):
    with pytest.raises(error, match=match):
        paged_decode(**_decode_args(**over))


@pytest.mark.parametrize("qsl, match", [
    ([0, 1, 3], "must rise from 0 to the 2 query tokens"),
    ([0, 0, 2], "each request having at least one"),
    ([1, 1, 2], "must rise from 0"),
])
def test_attention_refuses_query_start_loc(qsl, match):
    args = _decode_args()
    with pytest.raises(ValueError, match=match):
        paged_attention(args.pop("query"), query_start_loc=torch.tensor(qsl, dtype=torch.int32), **args)


def test_attention_refuses_more_queries_than_tokens():
    args = _decode_args(seq_lens=torch.tensor([3, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"request 1 has 3 queries but seq_lens\[1\]=2"):
        paged_attention(torch.zeros(4, 4, 64), query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32),
                        **{k: v for k, v in args.items() if k != "query"})


@pytest.mark.parametrize("num_decodes, error, match", [
    (2, KVCachedArgumentError, r"num_decodes=2 but request 1 has 3 queries"),
    (3, KVCachedArgumentError, r"num_decodes=3 is out of range|num_decodes=3"),
    (-1, KVCachedArgumentError, "num_decodes=-1"),
    (1.0, KVCachedArgumentError, "num_decodes=1.0"),
])
def test_attention_refuses_a_wrong_num_decodes(num_decodes, error, match):
    """num_decodes names leading requests of one query each: any other value is refused."""
    args = _decode_args(seq_lens=torch.tensor([3, 5], dtype=torch.int32))
    with pytest.raises(error, match=match):
        paged_attention(torch.zeros(4, 4, 64), query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32),
                        num_decodes=num_decodes, **{k: v for k, v in args.items() if k != "query"})


# -- kvcached tensors of every layout --------------------------------------------------------------

@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block_size, kv_heads, head_dim, heads", [(16, 2, 64, 8), (32, 1, 128, 4)])
def test_every_layout_through_kvcached(kv_env, layout, kv_layout, block_size, kv_heads, head_dim, heads):
    """alloc_kv_cache tensors on the host backend, zero page off, no pool: only the pages of the
    blocks a KVCacheManager handed out are mapped, so a read of any other page faults. Within
    mapped pages, blocks allocated but left out of the tables hold NaN."""
    kv_env(LAYOUT=layout, ZERO_PAGE=0, MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=0)
    init_kvcached(device="cpu", page_size_bytes=KV_PAGE_BYTES)
    num_layers, num_blocks = 3, 96
    shape = (2, num_blocks, *cache_shape(1, block_size, kv_heads, head_dim, kv_layout)[1:])
    kv = alloc_kv_cache(shape, block_size, torch.float32, "cpu", num_layers, kv_layout=kv_layout)
    manager = KVCacheManager(num_blocks, block_size, kv_heads * head_dim * 4, num_layers)
    seq_lens, q_lens = [5, 3 * block_size + 7, 2 * block_size, 1], [5, 4, 1, 1]
    needed = sum(-(-n // block_size) for n in seq_lens)
    ids = manager.alloc(needed + 4)
    assert ids is not None
    for layer in range(num_layers):
        for buffer in (0, 1):
            kv[layer][buffer][ids] = float("nan")
    for layer in range(num_layers):
        k_cache, v_cache = kv[layer][0], kv[layer][1]
        batch = Batch(k_cache, v_cache, kv_layout, ids, seq_lens, q_lens, heads, seed=layer)
        window = None if layer == 0 else block_size + layer
        out = paged_attention(batch.query, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                              batch.query_start_loc, batch.scale, sliding_window=window, kv_layout=kv_layout)
        assert_close(out, batch.expected(window), 1e-5)
        last = batch.query_start_loc[1:].long() - 1
        decode = paged_decode(batch.query[last], k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.scale,
                              sliding_window=window, kv_layout=kv_layout)
        assert_close(decode, batch.expected(window)[last], 1e-5)
    manager.free(ids)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_minus_one_in_the_length_on_kvcached_tensors(kv_env, layout):
    """-1 read as the last row of a kvcached tensor is an unmapped page with small pages (a
    segfault): refused before any gather, while -1 padding past the length works."""
    kv_env(LAYOUT=layout, ZERO_PAGE=0, MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=0)
    init_kvcached(device="cpu", page_size_bytes=KV_PAGE_BYTES)
    block_size, kv_heads, head_dim, heads, num_blocks = 16, 2, 64, 4, 96
    kv = alloc_kv_cache((2, num_blocks, block_size, kv_heads, head_dim), block_size, torch.float32, "cpu", 1)
    manager = KVCacheManager(num_blocks, block_size, kv_heads * head_dim * 4, 1)
    seq_lens = [5, 2 * block_size + 1]
    ids = manager.alloc(sum(-(-n // block_size) for n in seq_lens))
    k_cache, v_cache = kv[0][0], kv[0][1]
    batch = Batch(k_cache, v_cache, "NHD", ids, seq_lens, [1, 1], heads, padding=-1)
    expected = batch.expected(None)
    assert_close(paged_decode(batch.query, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.scale),
                 expected, 1e-5)
    batch.block_tables[1, 2] = -1
    with pytest.raises(KVCachedArgumentError, match=r"block_tables\[1, 2\]=-1 is not a block"):
        paged_decode(batch.query, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.scale)
    manager.free(ids)


# -- the Triton kernels ----------------------------------------------------------------------------

def _triton_cases() -> list[dict]:
    cases = []
    for i, (bs, d, kvh, group) in enumerate([(16, 128, 8, 4), (16, 80, 2, 8), (32, 96, 4, 1), (64, 256, 1, 16),
                                             (128, 64, 2, 3), (16, 48, 1, 32)]):
        for kv_layout in KV_LAYOUTS:
            seq_lens = [1, bs - 1, 5 * bs + 3, 700][: 2 + i % 3]
            cases.append(dict(block_size=bs, head_dim=d, kv_heads=kvh, heads=kvh * group, seq_lens=seq_lens,
                              q_lens=[1] * len(seq_lens), window=(None, 37, bs)[i % 3], kv_layout=kv_layout, seed=i))
    return cases


TRITON_CASES = _triton_cases()


def _run_triton_case(case: dict, device: str, dtype: torch.dtype, num_splits: int | None) -> None:
    from kvcached.ops._args import cache_geometry
    from kvcached.ops.triton_decode import paged_decode_triton

    k_cache, v_cache, batch = make_plain_batch(case, dtype=dtype, device=device)
    geometry = cache_geometry(k_cache, v_cache, case["kv_layout"])
    out = paged_decode_triton(batch.query, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.scale,
                              case["window"], geometry, num_splits=num_splits)
    assert_close(out, batch.expected(case["window"]), 1e-5 if dtype == torch.float32 else 2e-2)


def _triton_interpreter_usable() -> str | None:
    try:
        import triton
    except ImportError:
        return "triton is not installed"
    import numpy

    triton_version = tuple(int(x) for x in triton.__version__.split(".")[:2])
    numpy_version = tuple(int(x) for x in numpy.__version__.split(".")[:2])
    if triton_version < (3, 9) and numpy_version >= (2, 4):
        return (f"triton {triton.__version__} with numpy {numpy.__version__}: interpreters before 3.9 fail "
                f"on numpy >= 2.4")
    return None


@pytest.mark.skipif(_triton_interpreter_usable() is not None, reason=str(_triton_interpreter_usable()))
def test_triton_kernels_under_the_interpreter(tmp_path):
    """The decode kernel (1 and 3 splits) and the write kernel, run on the CPU by Triton's
    interpreter, in a child process (TRITON_INTERPRET is read when the kernels are defined)."""
    script = textwrap.dedent("""
        import sys, torch
        sys.path[:0] = {paths!r}
        import test_attention as t
        from kvcached.ops._args import cache_geometry
        from kvcached.ops.triton_write import write_kv_triton
        for case in t.TRITON_CASES[::3]:
            for splits in (1, 3):
                t._run_triton_case(case, "cpu", torch.float32, splits)
        for kv_layout in t.KV_LAYOUTS:
            k_cache, v_cache = t.plain_caches(4, 16, 2, 80, kv_layout)
            key, value = torch.randn(9, 2, 80), torch.randn(9, 2, 80)
            slots = torch.tensor([3, -1, 17, 63, 0, -1, 40, 41, 20])
            write_kv_triton(key, value, k_cache, v_cache, slots, cache_geometry(k_cache, v_cache, kv_layout))
            ref_k, ref_v = t.plain_caches(4, 16, 2, 80, kv_layout)
            t.write_kv(key, value, ref_k, ref_v, slots, kv_layout=kv_layout)
            assert torch.equal(k_cache.nan_to_num(7.0), ref_k.nan_to_num(7.0))
            assert torch.equal(v_cache.nan_to_num(7.0), ref_v.nan_to_num(7.0))
        print("interpreted ok")
    """).format(paths=[str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])])
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "interpreted ok" in done.stdout, done.stderr[-4000:]


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not usable here")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype, num_splits", [(torch.float32, 1), (torch.bfloat16, 4), (torch.bfloat16, None)],
                         ids=["fp32-1split", "bf16-4splits", "bf16-auto"])
@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: f"bs{c['block_size']}-d{c['head_dim']}-{c['kv_layout']}")
def test_triton_decode_on_cuda(case, dtype, num_splits):
    _run_triton_case(case, "cuda", dtype, num_splits)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_triton_matches_torch_path_on_cuda(kv_layout):
    """The dispatch: paged_attention on CUDA (decode batch -> Triton) against the torch path."""
    from kvcached.ops._args import cache_geometry
    from kvcached.ops.attention import decode_torch

    case = dict(block_size=16, head_dim=128, kv_heads=8, heads=32, seq_lens=[1, 100, 1024, 333], q_lens=[1] * 4,
                window=None, kv_layout=kv_layout, seed=5)
    k_cache, v_cache, batch = make_plain_batch(case, dtype=torch.bfloat16, device="cuda")
    out = paged_attention(batch.query, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                          batch.scale, kv_layout=kv_layout)
    torch_path = decode_torch(batch.query, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.scale, None,
                              cache_geometry(k_cache, v_cache, kv_layout), kv_layout)
    assert torch.isfinite(out).all()
    assert (out.float() - torch_path.float()).abs().max().item() < 2e-2


@given(programs=st.integers(1, 100_000), per_sm=st.lists(st.integers(1, 32), min_size=1, max_size=4),
       sms=st.integers(1, 200))
def test_the_fullest_last_wave_is_chosen(programs, per_sm, sms):
    """The decode kernel's pipeline depth is the choice whose last wave of programs is fullest
    (Note [Pipeline stages]); equal occupancies tie, and a tie keeps the first choice."""
    from kvcached.ops.waves import fullest_last_wave

    choices = dict(enumerate(per_sm))
    fills = {c: (programs / (n * sms)) / -(-programs // (n * sms)) for c, n in choices.items()}
    chosen = fullest_last_wave(programs, choices, sms)
    assert fills[chosen] == max(fills.values())
    assert chosen == min(c for c, f in fills.items() if f == fills[chosen])


def test_the_last_wave_rule_on_the_h200s_measured_shapes():
    """The H200's decode kernel: 3 stages hold 3 programs a multiprocessor, 2 stages 4; 132 of
    them. Measured (Note [Pipeline stages]): 64 x 8 programs ran faster at 2 stages, 88 x 8 at 3."""
    from kvcached.ops.waves import fullest_last_wave

    h200 = {3: 3, 2: 4}
    assert fullest_last_wave(64 * 8, h200, 132) == 2
    assert fullest_last_wave(88 * 8, h200, 132) == 3
    assert fullest_last_wave(256 * 8, h200, 132) == 2
    assert fullest_last_wave(16 * 8, h200, 132) == 3      # under one wave either way: the fuller one


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", TRITON_CASES[::4], ids=lambda c: f"bs{c['block_size']}-d{c['head_dim']}")
def test_decode_pipeline_depths_agree_bit_for_bit_on_cuda(case):
    """Each launch picks its pipeline depth (Note [Pipeline stages]); the depths compute the same
    sums in the same order, so a batch's output does not depend on which one it got."""
    from kvcached.ops import triton_decode
    from kvcached.ops._args import cache_geometry

    k_cache, v_cache, batch = make_plain_batch(case, dtype=torch.bfloat16, device="cuda")
    geometry = cache_geometry(k_cache, v_cache, case["kv_layout"])
    for splits in (1, 4):
        outs = [triton_decode.paged_decode_triton(batch.query, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                                                  batch.scale, case["window"], geometry, num_splits=splits,
                                                  num_stages=stages)
                for stages in triton_decode.PIPELINE_STAGES]
        assert all(torch.equal(out, outs[0]) for out in outs[1:]), splits
        assert_close(outs[0], batch.expected(case["window"]), 2e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_write_kv_triton_on_cuda(kv_layout):
    k_cache, v_cache = plain_caches(8, 16, 2, 96, kv_layout, torch.bfloat16, "cuda")
    ref_k, ref_v = plain_caches(8, 16, 2, 96, kv_layout, torch.bfloat16, "cpu")
    key, value = torch.randn(50, 2, 96).bfloat16(), torch.randn(50, 2, 96).bfloat16()
    slots = torch.randperm(128)[:50]
    slots[::7] = -1
    write_kv(key.cuda(), value.cuda(), k_cache, v_cache, slots.cuda(), kv_layout=kv_layout)
    write_kv(key, value, ref_k, ref_v, slots, kv_layout=kv_layout)
    assert torch.equal(k_cache.cpu().nan_to_num(7.0), ref_k.nan_to_num(7.0))
    assert torch.equal(v_cache.cpu().nan_to_num(7.0), ref_v.nan_to_num(7.0))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_through_kvcached_on_cuda(kv_env, layout, kv_layout):
    """VMM-mapped tensors, zero page off, no pool: the Triton kernels touch only mapped pages (an
    access to an unmapped one is an illegal-address error), and agree with the torch path."""
    from kvcached.core import cuda_unavailable_reason

    if cuda_unavailable_reason() is not None:
        pytest.skip(cuda_unavailable_reason())
    kv_env(LAYOUT=layout, ZERO_PAGE=0, MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=0)
    init_kvcached(device="cuda:0")
    block_size, kv_heads, head_dim, heads, num_layers, num_blocks = 16, 8, 128, 32, 4, 4096
    shape = (2, num_blocks, *cache_shape(1, block_size, kv_heads, head_dim, kv_layout)[1:])
    kv = alloc_kv_cache(shape, block_size, torch.bfloat16, "cuda:0", num_layers, kv_layout=kv_layout)
    manager = KVCacheManager(num_blocks, block_size, kv_heads * head_dim * 2, num_layers)
    seq_lens = [1, 700, 64, 1024, 17]
    ids = manager.alloc(sum(-(-n // block_size) for n in seq_lens))
    for layer in range(num_layers):
        batch = Batch(kv[layer][0], kv[layer][1], kv_layout, ids, seq_lens, [1] * len(seq_lens), heads, seed=layer)
        out = paged_decode(batch.query, kv[layer][0], kv[layer][1], batch.block_tables, batch.seq_lens, batch.scale,
                           kv_layout=kv_layout)
        torch.cuda.synchronize()
        assert_close(out, batch.expected(None), 2e-2)
    manager.free(ids)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernels_run_while_the_cache_base_page_is_unmapped(kv_env, layout):
    """The page at a cache's base address is unmapped while it holds no live block; Triton's
    launcher refuses such a tensor (See Note [Cache base address]), so the kernels must not hand
    it one. Blocks on later pages are written and read as usual."""
    from cuda.bindings import driver

    from kvcached.core import cuda_unavailable_reason

    if cuda_unavailable_reason() is not None:
        pytest.skip(cuda_unavailable_reason())
    kv_env(LAYOUT=layout, ZERO_PAGE=0, MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=0)
    init_kvcached(device="cuda:0")
    block_size, kv_heads, head_dim, heads, num_layers, num_blocks = 16, 8, 128, 32, 2, 4096
    kv = alloc_kv_cache((2, num_blocks, block_size, kv_heads, head_dim), block_size, torch.bfloat16, "cuda:0",
                        num_layers)
    manager = KVCacheManager(num_blocks, block_size, kv_heads * head_dim * 2, num_layers)
    probe = manager.alloc(1)
    blocks_per_page = manager.get_page_occupancy()[0][1]
    manager.free(probe)
    first_page = manager.alloc(blocks_per_page)
    seq_lens = [33, 300, 1]
    ids = manager.alloc(sum(-(-n // block_size) for n in seq_lens))
    manager.free(first_page)
    manager.trim()
    torch.cuda.synchronize()
    assert 0 not in manager.get_page_occupancy()
    status, _ = driver.cuPointerGetAttribute(driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
                                             kv[0][0].data_ptr())
    assert status != driver.CUresult.CUDA_SUCCESS, "the base page is still mapped: the test proves nothing"
    for layer in range(num_layers):
        k_cache, v_cache = kv[layer][0], kv[layer][1]
        batch = Batch(k_cache, v_cache, "NHD", ids, seq_lens, [1] * len(seq_lens), heads, seed=layer)
        out = paged_decode(batch.query, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.scale)
        torch.cuda.synchronize()
        assert_close(out, batch.expected(None), 2e-2)
    manager.free(ids)
