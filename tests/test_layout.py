"""Layouts over real ranges and real mappings (HostBackend): every byte written through a view lands
where the layout table says, block intervals are sound, and bad input is refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvcached.core import HostBackend
from kvcached.errors import KVCachedConfigError
from kvcached.layout import (
    LAYOUT_NAMES,
    SHAPE_KINDS,
    choose_layout,
    make_layout,
)

GRANULE = 64 << 10
CAPACITY = 64 << 20
SENTINEL = 0xA5


class Geometry:
    """One KV group laid out, reserved, fully mapped and viewed."""

    def __init__(self, name, shape_kind, num_layers, dtype, block_shape, page_bytes, num_blocks,
                 kv_layout="NHD"):
        self.shape_kind, self.kv_layout, self.dtype = shape_kind, kv_layout, dtype
        self.num_buffers = 1 if shape_kind == "mla" else 2
        itemsize = torch.empty((), dtype=dtype).element_size()
        block_bytes = math.prod(block_shape) * itemsize
        self.layout = make_layout(name, num_layers, self.num_buffers, block_bytes, page_bytes, num_blocks, GRANULE)
        self.layout.check_invariants()
        self.backend = HostBackend(granularity=GRANULE, capacity_bytes=CAPACITY)
        self.ranges = [self.backend.reserve(size) for size in self.layout.range_sizes()]
        self.table = self.layout.page_table(self.backend, self.ranges)
        assert self.table.map(list(range(self.layout.num_pages)))
        self.raw = [r.tensor().numpy() for r in self.ranges]
        for raw in self.raw:  # every mapped byte starts as the sentinel
            raw[:] = SENTINEL
        self.views = self.layout.views([r.tensor() for r in self.ranges], shape_kind, dtype, block_shape, kv_layout)
        if shape_kind == "mla" or kv_layout == "NHD":
            self.inner = tuple(block_shape)
        else:
            self.inner = (block_shape[1], block_shape[0], block_shape[2])

    def close(self):
        self.views = self.raw = None
        self.table.close()

    def write(self, view, buffer, ids, data):
        """Write data (uint8 [len(ids), block_bytes]) into rows ids of one buffer of a layer view."""
        src = torch.from_numpy(data).view(self.dtype).reshape(len(ids), *self.inner)
        index = torch.from_numpy(ids)
        if self.shape_kind == "flash_attn":
            view[buffer, index] = src
        elif self.shape_kind == "flashinfer":
            view[index, buffer] = src
        else:
            view[index] = src

    def read(self, view, buffer, ids):
        index = torch.from_numpy(ids)
        if self.shape_kind == "flash_attn":
            rows = view[buffer, index]
        elif self.shape_kind == "flashinfer":
            rows = view[index, buffer]
        else:
            rows = view[index]
        return rows.contiguous().view(torch.uint8).reshape(len(ids), -1).numpy()

    def raw_blocks(self, ids, layer, buffer):
        """The raw bytes the layout table assigns to (ids, layer, buffer), uint8 [len(ids), B]."""
        B = self.layout.block_bytes
        locs = [self.layout.byte_location(int(b), layer, buffer) for b in ids]
        return np.stack([self.raw[ri][off:off + B] for ri, off in locs]) if locs else np.empty((0, B), np.uint8)


def roundtrip(g: Geometry, seed: int = 0):
    """Write a distinct random pattern to every usable (block, layer, buffer) through the views and
    check every mapped byte of every range against the layout table. Returns the pattern."""
    lay = g.layout
    ids = lay.block_ids()
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(lay.num_layers, g.num_buffers, len(ids), lay.block_bytes), dtype=np.uint8)
    # A first byte unique per (block, layer, buffer) when there are few enough of them.
    data[..., 0] = (np.arange(data[..., 0].size) % 251).reshape(data.shape[:3])
    for layer, view in enumerate(g.views):
        assert view.data_ptr() >= min(r.address for r in g.ranges)
        for buffer in range(g.num_buffers):
            g.write(view, buffer, ids, data[layer, buffer])

    expected = [np.full(r.size_bytes, SENTINEL, np.uint8) for r in g.ranges]
    for layer in range(lay.num_layers):
        for buffer in range(g.num_buffers):
            for row, b in enumerate(ids):
                ri, off = lay.byte_location(int(b), layer, buffer)
                expected[ri][off:off + lay.block_bytes] = data[layer, buffer, row]
    for ri, raw in enumerate(g.raw):  # every byte of every range is mapped here
        mismatch = np.flatnonzero(raw != expected[ri])
        assert mismatch.size == 0, f"range {ri}: {mismatch.size} bytes differ, first at {mismatch[:4]}"
    for layer, view in enumerate(g.views):  # and the views read back what they wrote
        for buffer in range(g.num_buffers):
            assert np.array_equal(g.read(view, buffer, ids), data[layer, buffer])
    return data


def check_intervals(g: Geometry):
    """Intervals are disjoint, inside max_block_id, map back to their page; every (block, layer,
    buffer) lies inside a mapping of its own page and overlaps no other."""
    lay = g.layout
    first, count = lay.page_first_block, lay.page_num_blocks
    assert first.dtype == np.int64 and count.dtype == np.int32
    assert int(count.sum()) == lay.usable_blocks >= lay.num_blocks
    ids = lay.block_ids()
    assert len(np.unique(ids)) == len(ids) and ids.min() >= 0 and ids.max() < lay.max_block_id
    assert ids.max() == lay.max_block_id - 1
    for page in range(lay.num_pages):
        span = np.arange(first[page], first[page] + count[page])
        assert all(b * lay.id_to_page_num // lay.id_to_page_den == page for b in span)
    # fewest pages: one page less would not hold num_blocks
    assert int(count[:-1].sum()) < lay.num_blocks

    intervals = []
    for b in ids:
        page = lay.page_of(int(b))
        segments = [(a, a + lay.map_bytes) for a in g.table.segment_addresses(page)]
        for layer in range(lay.num_layers):
            for buffer in range(g.num_buffers):
                ri, off = lay.byte_location(int(b), layer, buffer)
                start = g.ranges[ri].address + off
                assert any(lo <= start and start + lay.block_bytes <= hi for lo, hi in segments), \
                    (int(b), layer, buffer, page)
                intervals.append((start, start + lay.block_bytes))
    intervals.sort()
    for (_, end), (start, _) in zip(intervals, intervals[1:]):
        assert end <= start, "two (block, layer, buffer) overlap in memory"


def check_unmap_keeps_others(g: Geometry, data):
    lay = g.layout
    ids = lay.block_ids()
    pages = [p for p in range(lay.num_pages) if lay.page_num_blocks[p] > 0]
    victim = pages[len(pages) // 2]
    g.table.unmap([victim])
    keep = np.array([b for b in ids if lay.page_of(int(b)) != victim], dtype=np.int64)
    rows = np.searchsorted(ids, keep)
    for layer, view in enumerate(g.views):
        for buffer in range(g.num_buffers):
            if len(keep):
                assert np.array_equal(g.read(view, buffer, keep), data[layer, buffer, rows])
                assert np.array_equal(g.raw_blocks(keep, layer, buffer), data[layer, buffer, rows])
    assert g.table.map([victim])  # touching the page again is safe once it is mapped back


def block_shape_for(shape_kind, block_size, heads, head_dim):
    return (block_size, heads * head_dim) if shape_kind == "mla" else (block_size, heads, head_dim)


# -- parametrised: every layout x shape kind x kv_layout, a dividing and a straddling block -------
CASES = [
    # (block_size, heads, head_dim, dtype, page_bytes): 16 KiB divides 64 KiB; 24 KiB does not
    (16, 2, 256, torch.float16, GRANULE),
    (12, 4, 128, torch.bfloat16, GRANULE),
]


SHAPES = [(kind, kv) for kind in SHAPE_KINDS for kv in ("NHD", "HND") if not (kind == "mla" and kv == "HND")]


@pytest.mark.parametrize("shape_kind, kv_layout", SHAPES)
@pytest.mark.parametrize("name", LAYOUT_NAMES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_layout_roundtrip(name, shape_kind, kv_layout, case):
    block_size, heads, head_dim, dtype, page_bytes = CASES[case]
    block_bytes = block_size * heads * head_dim * dtype.itemsize
    if name == "page_grouped" and page_bytes % block_bytes:
        with pytest.raises(KVCachedConfigError, match="per_layer or interleaved"):
            make_layout(name, 3, 2, block_bytes, page_bytes, 10, GRANULE)
        return
    g = Geometry(name, shape_kind, 3, dtype, block_shape_for(shape_kind, block_size, heads, head_dim),
                 page_bytes, 10, kv_layout)
    try:
        data = roundtrip(g)
        check_intervals(g)
        check_unmap_keeps_others(g, data)
    finally:
        g.close()


@st.composite
def geometries(draw):
    name = draw(st.sampled_from(LAYOUT_NAMES))
    shape_kind = draw(st.sampled_from(SHAPE_KINDS))
    kv_layout = "NHD" if shape_kind == "mla" else draw(st.sampled_from(["NHD", "HND"]))
    num_layers = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.int8]))
    if draw(st.booleans()):  # a block that divides the page
        block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
        heads = draw(st.sampled_from([1, 2, 4]))
        head_dim = draw(st.sampled_from([16, 32, 64, 128]))
    else:
        block_size = draw(st.integers(1, 24))
        heads = draw(st.integers(1, 5))
        head_dim = draw(st.sampled_from([8, 24, 40, 96, 128, 192]))
    page_bytes = GRANULE * draw(st.integers(1, 2))
    num_blocks = draw(st.integers(1, 40))
    return name, shape_kind, kv_layout, num_layers, dtype, block_size, heads, head_dim, page_bytes, num_blocks


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(geometries(), st.integers(0, 2**32 - 1))
def test_layout_roundtrip_random(geometry, seed):
    name, shape_kind, kv_layout, num_layers, dtype, block_size, heads, head_dim, page_bytes, num_blocks = geometry
    block_shape = block_shape_for(shape_kind, block_size, heads, head_dim)
    block_bytes = math.prod(block_shape) * dtype.itemsize
    buffers = 1 if shape_kind == "mla" else 2
    if block_bytes > page_bytes:
        with pytest.raises(KVCachedConfigError, match="larger than a page"):
            make_layout(name, num_layers, buffers, block_bytes, page_bytes, num_blocks, GRANULE)
        return
    if name == "page_grouped" and page_bytes % block_bytes:
        with pytest.raises(KVCachedConfigError, match="divide"):
            make_layout(name, num_layers, buffers, block_bytes, page_bytes, num_blocks, GRANULE)
        return
    lay = make_layout(name, num_layers, buffers, block_bytes, page_bytes, num_blocks, GRANULE)
    assume(lay.num_pages * num_layers * buffers * page_bytes <= 24 << 20)
    g = Geometry(name, shape_kind, num_layers, dtype, block_shape, page_bytes, num_blocks, kv_layout)
    try:
        data = roundtrip(g, seed)
        check_intervals(g)
        check_unmap_keeps_others(g, data)
    finally:
        g.close()


# -- geometry facts -------------------------------------------------------------------------------
def test_dense_pages_hold_only_whole_blocks():
    P, B = 64 << 10, 48 << 10  # P/B = 4/3: pages hold 1, 0, 1, 1, 0, 1, ... blocks
    for name in ("per_layer", "interleaved"):
        lay = make_layout(name, 2, 2, B, P, 7, GRANULE)
        assert list(lay.page_num_blocks) == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]
        assert list(lay.block_ids()) == [0, 3, 4, 7, 8, 11, 12]  # 1, 2, 5, ... straddle two pages
        assert lay.max_block_id == 13 and lay.usable_blocks == 7
        assert (lay.id_to_page_num, lay.id_to_page_den) == (B, P)
    assert make_layout("per_layer", 2, 2, B, P, 7, GRANULE).map_bytes == P
    assert make_layout("interleaved", 2, 2, B, P, 7, GRANULE).map_bytes == 4 * P


def test_page_grouped_ids_and_extents():
    L, K, P, B = 3, 2, 64 << 10, 16 << 10
    lay = make_layout("page_grouped", L, K, B, P, 10, GRANULE)
    bpp, ids_per_page = P // B, L * K * (P // B)
    assert lay.num_pages == 3 and lay.usable_blocks == 12
    assert (lay.id_to_page_num, lay.id_to_page_den) == (1, ids_per_page)
    assert list(lay.page_first_block) == [0, ids_per_page, 2 * ids_per_page]
    assert lay.max_block_id == lay.num_pages * ids_per_page - (L * K - 1) * bpp
    assert lay.range_sizes() == [lay.num_pages * L * K * P]
    views = lay.views([torch.empty(lay.range_sizes()[0], dtype=torch.uint8)], "flashinfer", torch.float16,
                      (8, 1, 1024))
    assert views[0].shape[0] == lay.max_block_id
    with pytest.raises(KVCachedConfigError, match="slots"):
        lay.byte_location(bpp, 0, 0)  # slot bpp of page 0 aliases layer 0's V: never an id


def test_hnd_puts_heads_before_tokens():
    g = Geometry("interleaved", "flash_attn", 2, torch.float32, (4, 2, 8), GRANULE, 3, "HND")
    try:
        v = g.views[1]
        assert v.shape == (2, g.layout.max_block_id, 2, 4, 8)
        v[1, 2, 1, 3, 5] = 1.5  # V, block 2, head 1, token 3, dim 5
        ri, off = g.layout.byte_location(2, 1, 1)
        off += ((1 * 4 + 3) * 8 + 5) * 4
        assert g.raw[ri][off:off + 4].view(np.float32)[0] == 1.5
    finally:
        g.close()


def test_zero_page_is_passed_through():
    lay = make_layout("per_layer", 2, 2, 16 << 10, GRANULE, 8, GRANULE)
    backend = HostBackend(granularity=GRANULE, capacity_bytes=CAPACITY)
    ranges = [backend.reserve(s) for s in lay.range_sizes()]
    table = lay.page_table(backend, ranges, zero_page=True)
    try:
        views = lay.views([r.tensor() for r in ranges], "flash_attn", torch.float16, (16, 4, 128))
        assert table.map([0])
        views[0][1, 0] = 3.0
        assert float(views[1][0, 7].abs().sum()) == 0.0  # page 1 unmapped: reads the zero page
        assert float(views[0][1, 0].sum()) == 3.0 * 16 * 4 * 128
    finally:
        table.close()


# -- choosing a layout ---------------------------------------------------------------------------
def test_choose_layout():
    assert choose_layout("auto", "cuda")[0] == "interleaved"
    assert choose_layout("auto", "cuda", integrated_memory=True)[0] == "per_layer"
    assert choose_layout("auto", "host")[0] == "interleaved"
    for name in LAYOUT_NAMES:
        assert choose_layout(name, "host")[0] == name
        chosen, reason = choose_layout(name, "cuda", needs_joint_kv=True)
        assert chosen == "interleaved" and "adjacent" in reason
    with pytest.raises(KVCachedConfigError, match="'paged'"):
        choose_layout("paged", "cuda")
    with pytest.raises(KVCachedConfigError, match="'rocm'"):
        choose_layout("auto", "rocm")


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(page_bytes=GRANULE + 4096), "multiple of the backend granularity"),
    (dict(block_bytes=2 * GRANULE), "larger than a page"),
    (dict(num_blocks=0), "num_blocks=0"),
    (dict(num_blocks=-3), "num_blocks=-3"),
    (dict(num_layers=0), "num_layers=0"),
    (dict(num_kv_buffers=0), "num_kv_buffers=0"),
    (dict(block_bytes=0), "block_bytes=0"),
    (dict(name="paged"), "'paged' is unknown"),
    (dict(name="auto"), "choose_layout"),
    (dict(num_layers=2.5), "num_layers=2.5 must be a positive int"),
    (dict(num_layers=True), "num_layers=True must be a positive int"),
    (dict(block_bytes=16384.0), "block_bytes=16384.0"),
    (dict(num_blocks=np.float64(8)), r"num_blocks=np.float64\(8.0\) must be a positive int"),
    (dict(num_blocks=10**12), r"num_blocks=1000000000000 .*59604.6 TiB.*ask for at most 16777216 blocks"),
    (dict(num_blocks=10**15, block_bytes=GRANULE), r"the most is 128 TiB"),
    (dict(name="interleaved", num_blocks=1 << 31), "ask for at most"),
    (dict(name="page_grouped", block_bytes=24 << 10), "per_layer or interleaved"),
    (dict(name="page_grouped", block_bytes=1, num_blocks=1 << 30, num_layers=80), "int32"),
])
def test_bad_layout_arguments(kwargs, match):
    args = dict(name="per_layer", num_layers=2, num_kv_buffers=2, block_bytes=16 << 10, page_bytes=GRANULE,
                num_blocks=8, granularity=GRANULE)
    args.update(kwargs)
    with pytest.raises(KVCachedConfigError, match=match):
        make_layout(**args)


@pytest.mark.parametrize("call, match", [
    (dict(shape_kind="paged"), "shape_kind='paged' is unknown"),
    (dict(kv_layout="NDH"), "kv_layout='NDH'"),
    (dict(block_shape=(16, 4, 64)), "must equal block_bytes"),
    (dict(dtype=torch.float32), "must equal block_bytes"),
    (dict(block_shape=(16, 512)), r"\(block_size, heads, head_dim\)"),
    (dict(block_shape=(16, 4, 128.5)), r"block_shape\[2\]=128.5 must be a positive int"),
    (dict(block_shape=(16, True, 128)), r"block_shape\[1\]=True"),
    (dict(block_shape=(16, 0, 128)), r"block_shape\[1\]=0"),
    (dict(shape_kind="mla"), "num_kv_buffers=1"),
    (dict(tensors=2), "range tensors"),
    (dict(tensors="int8"), "uint8"),
])
def test_bad_views(call, match):
    lay = make_layout("per_layer", 2, 2, 16 << 10, GRANULE, 8, GRANULE)
    tensors = [torch.empty(s, dtype=torch.uint8) for s in lay.range_sizes()]
    if call.get("tensors") == 2:
        tensors = tensors[:1]
    elif call.get("tensors") == "int8":
        tensors = [t.view(torch.int8) for t in tensors]
    args = dict(shape_kind="flash_attn", dtype=torch.float16, block_shape=(16, 4, 128), kv_layout="NHD")
    args.update({k: v for k, v in call.items() if k != "tensors"})
    with pytest.raises(KVCachedConfigError, match=match):
        lay.views(tensors, args["shape_kind"], args["dtype"], args["block_shape"], args["kv_layout"])


def test_mla_rejects_hnd_and_two_buffer_shapes():
    lay = make_layout("interleaved", 2, 1, 16 << 10, GRANULE, 8, GRANULE)
    tensors = [torch.empty(s, dtype=torch.uint8) for s in lay.range_sizes()]
    with pytest.raises(KVCachedConfigError, match="HND"):
        lay.views(tensors, "mla", torch.float16, (16, 512), "HND")
    with pytest.raises(KVCachedConfigError, match="num_kv_buffers=2"):
        lay.views(tensors, "flash_attn", torch.float16, (16, 4, 128))
    assert lay.views(tensors, "mla", torch.float16, (16, 512))[1].shape == (lay.max_block_id, 16, 512)
