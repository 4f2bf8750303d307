"""Layouts: where each KV block lies in virtual memory, what one page id maps, and the torch views.

A KV group has ``L`` layers, ``K`` buffers per layer (``num_kv_buffers``: 2 = K and V, 1 = MLA's
latent buffer), blocks of ``B = block_bytes`` bytes per buffer and layer, and pages of
``P = page_bytes`` bytes per buffer (KVCACHED_PAGE_SIZE_MB, a multiple of the backend granularity).
A *page id* is the unit the page table maps; mapping it must back every layer and buffer.

Layout table: block ``b`` of layer ``l``, buffer ``k`` lies at

=============  ======================  ======================================================
layout         range (index)           byte offset in that range
=============  ======================  ======================================================
per_layer      one per layer: ``l``    ``k * num_pages * P + b * B``
interleaved    one range: ``0``        ``b * (L*K*B) + (l*K + k) * B``
page_grouped   one range: ``0``        ``p * (L*K*P) + (l*K + k) * P + s * B``,
                                       where ``b = p * ids_per_page + s`` and ``s < P // B``
=============  ======================  ======================================================

What a page id ``p`` maps (``PageTable`` segments, ``map_bytes`` each, at ``offset + p*map_bytes``):

- per_layer: ``L*K`` segments of ``P`` bytes, segment ``l*K + k`` at offset ``k * num_pages * P``
  of range ``l`` (so a page id costs ``L*K`` mappings). A layer's K and V share one range, K in
  the first half, V in the second: the FlashAttention tensor ``(2, N, ...)`` of one layer must be
  one torch storage, which two separate reservations could never be. See Note [Per-layer ranges].
- interleaved and page_grouped: one compound segment of ``L*K*P`` bytes at ``p * L*K*P``.

Block ids. per_layer and interleaved use *dense* ids, row ``b`` of every layer's tensor. Page
``p`` holds exactly the blocks lying wholly inside it, ``[ceil(p*P/B), floor((p+1)*P/B))``
(interleaved scales both sides by ``L*K``, which changes nothing); when ``B`` does not divide
``P`` a block straddling two pages is never handed out, and a page may hold fewer blocks than its
neighbours (or none at all when ``P/B < 2``). page_grouped uses *sparse* ids,
``page * ids_per_page + slot`` with ``ids_per_page = L*K*(P//B)``; see Note [Page-grouped ids].
The block allocator only needs ``page_first_block``, ``page_num_blocks`` and the block-to-page
map ``page = block_id * id_to_page_num // id_to_page_den``.

Tensor extents. Every view's block dimension has ``N = max_block_id`` rows (one past the largest
id a page can hand out), which is ``>= num_blocks``: ``num_pages`` is the fewest pages that hold
``num_blocks`` usable blocks, and the last page's blocks are all usable. Rows that no page hands
out (straddling blocks; page_grouped's alias rows) must not be written.

Zero page. With ``zero_page=True`` the page table shows one shared read-only page of zeros at
every page id that is not mapped, so a kernel that reads past the allocated blocks (a padded CUDA
graph batch, a stale block table) reads zeros instead of faulting; writes there still fault. The
price is one extra mapping per segment of every unmapped page id, made at start-up (``L*K*num_pages``
mappings for per_layer, ``num_pages`` for the compound layouts), and map/unmap become remaps, so
it is off by default and layouts only pass the flag through (``KVLayout.page_table``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from .checks import as_int, check_kv_layout
from .errors import KVCachedConfigError

if TYPE_CHECKING:
    from .core import Backend, PageTable, VirtualRange

_Range = TypeVar("_Range")  # a VirtualRange; check_invariants passes range indices

LAYOUT_NAMES = ("per_layer", "interleaved", "page_grouped")
SHAPE_KINDS = ("flash_attn", "flashinfer", "mla")
BACKEND_KINDS = ("cuda", "host")

_MAX_BLOCK_ID = 1 << 31  # block ids cross into the allocator as int32
MAX_VIRTUAL_BYTES = 1 << 47     # 128 TiB: a process's address space on x86-64 (4-level paging)
MAX_PAGE_SLICES = 1 << 24       # page-sized slices of all buffers: bounds the bookkeeping arrays


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class KVLayout:
    """The geometry of one KV group in one layout: ranges, page-id segments, block-id intervals.

    Pure arithmetic (no memory is touched): build it, reserve ``range_sizes()`` on a backend, then
    ``page_table(backend, ranges)`` and ``views(...)``. Use :func:`make_layout` to construct one.

    Attributes (all read-only after construction):
        num_pages: page ids of the group, ``[0, num_pages)``.
        map_bytes: bytes of one mapping (segment) of a page id.
        page_first_block: int64[num_pages], the first block id of each page.
        page_num_blocks: int32[num_pages], how many ids from there the page holds (may be 0).
        id_to_page_num, id_to_page_den: ``page = block_id * num // den`` for every usable id.
        max_block_id: one past the largest usable id; the row count ``N`` of every view.
        usable_blocks: ``page_num_blocks.sum()``, at least ``num_blocks``.

    Raises (constructor): KVCachedConfigError naming the bad value and what would work.
    """

    name = ""
    num_pages: int                      # set by _plan, with the attributes below
    map_bytes: int
    page_first_block: np.ndarray
    page_num_blocks: np.ndarray
    id_to_page_num: int
    id_to_page_den: int
    max_block_id: int
    usable_blocks: int

    def __init__(self, num_layers: int, num_kv_buffers: int, block_bytes: int, page_bytes: int,
                 num_blocks: int, granularity: int):
        self.num_layers = as_int(num_layers, "num_layers", minimum=1, hint="a KV group has at least one layer")
        self.num_kv_buffers = as_int(num_kv_buffers, "num_kv_buffers", minimum=1,
                                     hint="use 2 for K and V, 1 for MLA's latent buffer")
        self.block_bytes = as_int(block_bytes, "block_bytes", minimum=1,
                                  hint="it is block_size * cell_size, the bytes of one block of one buffer")
        self.granularity = as_int(granularity, "granularity", minimum=1, hint="take it from the backend")
        self.page_bytes = as_int(page_bytes, "page_bytes", minimum=1, hint="set KVCACHED_PAGE_SIZE_MB >= 1")
        self.num_blocks = as_int(num_blocks, "num_blocks", minimum=1, hint="ask for at least one block")
        if self.page_bytes % self.granularity:
            raise KVCachedConfigError(
                f"page_bytes={self.page_bytes} is not a multiple of the backend granularity "
                f"({self.granularity} bytes); use {_round_up(self.page_bytes, self.granularity)}.")
        if self.block_bytes > self.page_bytes:
            raise KVCachedConfigError(
                f"block_bytes={self.block_bytes} is larger than a page ({self.page_bytes} bytes); raise "
                f"KVCACHED_PAGE_SIZE_MB to at least {math.ceil(self.block_bytes / (1 << 20))} "
                f"or use a smaller block_size.")
        self._check_size()
        self._plan()
        if self.max_block_id >= _MAX_BLOCK_ID:
            raise KVCachedConfigError(
                f"the {self.name} layout needs block ids up to {self.max_block_id}, past the int32 limit "
                f"{_MAX_BLOCK_ID - 1}; ask for fewer blocks"
                + (" or use per_layer/interleaved (dense ids)." if self.name == "page_grouped" else "."))
        self.page_first_block.setflags(write=False)
        self.page_num_blocks.setflags(write=False)

    @property
    def buffers_per_page(self) -> int:
        """L*K: how many per-buffer pages one page id backs."""
        return self.num_layers * self.num_kv_buffers

    def __repr__(self):
        return (f"{type(self).__name__}(layers={self.num_layers}, buffers={self.num_kv_buffers}, "
                f"block_bytes={self.block_bytes}, page_bytes={self.page_bytes}, num_pages={self.num_pages}, "
                f"usable_blocks={self.usable_blocks}, max_block_id={self.max_block_id})")

    # -- to be provided by each layout -----------------------------------------------------------
    def _plan(self) -> None:
        raise NotImplementedError

    def range_sizes(self) -> list[int]:
        """Bytes of each virtual range to reserve, in order (multiples of the granularity)."""
        raise NotImplementedError

    def segments(self, ranges: Sequence[_Range]) -> list[tuple[_Range, int]]:
        """PageTable segments ``[(VirtualRange, offset_bytes)]`` over ranges reserved in the
        order and sizes of ``range_sizes()``."""
        raise NotImplementedError

    def byte_location(self, block_id: int, layer: int, buffer: int) -> tuple[int, int]:
        """(range_index, byte_offset) of the first byte of one block of one layer and buffer."""
        raise NotImplementedError

    def _layer_strides(self, layer: int) -> tuple[int, int, int, int]:
        """(range_index, base_bytes, block_stride_bytes, buffer_stride_bytes) of one layer's rows:
        row b of buffer k starts at base + b*block_stride + k*buffer_stride."""
        raise NotImplementedError

    # -- shared --------------------------------------------------------------------------------
    def _check_size(self) -> None:
        """Refuse, before any array is sized by it, a group that could never be reserved or
        whose page bookkeeping would not fit in memory (one page-sized slice of each buffer is a
        mapping for per_layer; page ids are never more). Checked on the smallest figure the
        group needs, num_blocks * block_bytes per buffer (straddling blocks only add to it)."""
        needed = self.num_blocks * self.block_bytes * self.buffers_per_page
        most = min(MAX_VIRTUAL_BYTES // (self.block_bytes * self.buffers_per_page),
                   MAX_PAGE_SLICES * self.page_bytes // (self.block_bytes * self.buffers_per_page),
                   _MAX_BLOCK_ID - 1)
        if self.num_blocks > most:
            raise KVCachedConfigError(
                f"num_blocks={self.num_blocks} of {self.block_bytes} bytes x {self.num_layers} layers x "
                f"{self.num_kv_buffers} buffers needs {needed} bytes ({needed / (1 << 40):.1f} TiB) of virtual memory "
                f"in {-(-needed // self.page_bytes)} pages of {self.page_bytes} bytes; the most is "
                f"{MAX_VIRTUAL_BYTES >> 40} TiB (a process's address space), {MAX_PAGE_SLICES} pages and block ids "
                f"below {_MAX_BLOCK_ID}: ask for at most {most} blocks, or use larger pages.")

    def _check_location_args(self, block_id: int, layer: int, buffer: int) -> None:
        if not 0 <= block_id < self.max_block_id:
            raise KVCachedConfigError(f"block_id={block_id} is outside [0, {self.max_block_id})")
        if not 0 <= layer < self.num_layers:
            raise KVCachedConfigError(f"layer={layer} is outside [0, {self.num_layers})")
        if not 0 <= buffer < self.num_kv_buffers:
            raise KVCachedConfigError(f"buffer={buffer} is outside [0, {self.num_kv_buffers})")

    def page_of(self, block_id: int) -> int:
        """The page id holding a usable block id (O(1))."""
        return block_id * self.id_to_page_num // self.id_to_page_den

    def block_ids(self) -> np.ndarray:
        """Every usable block id, ascending (int64; O(usable_blocks))."""
        counts = self.page_num_blocks.astype(np.int64)
        starts = np.repeat(self.page_first_block, counts)
        within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        return starts + within

    def page_table(self, backend: Backend, ranges: Sequence[VirtualRange],
                   zero_page: bool = False) -> PageTable:
        """A ``PageTable`` over ``ranges`` (reserved as ``range_sizes()`` says). ``zero_page`` is
        passed through; see the module docstring for its trade-off."""
        from .core import PageTable
        return PageTable(backend, self.segments(ranges), self.map_bytes, self.num_pages, zero_page)

    def views(self, range_tensors: Sequence, shape_kind: str, dtype, block_shape: Sequence[int],
              kv_layout: str = "NHD") -> list:
        """One zero-copy torch tensor per layer over the raw ranges, in an engine's shape.

        range_tensors: ``VirtualRange.tensor()`` of each range, 1-D uint8, in ``range_sizes()`` order.
        shape_kind: "flash_attn" -> ``(2, N, *blk)`` (``kv[l][0]`` is K, ``kv[l][1]`` V);
            "flashinfer" -> ``(N, 2, *blk)``; "mla" -> ``(N, *block_shape)`` (one buffer).
        block_shape: one block of one buffer in NHD order, ``(block_size, heads, head_dim)`` for
            flash_attn/flashinfer, ``(block_size, dim)`` for mla; its element count times
            ``dtype``'s size must equal ``block_bytes``.
        kv_layout: "NHD" keeps ``blk = block_shape``; "HND" stores and shows heads before tokens,
            ``blk = (heads, block_size, head_dim)`` (flash_attn/flashinfer only).
        N is ``max_block_id``. Row b of a layer is the block the layout table puts at
        ``byte_location(b, layer, k)``; writes land exactly there.

        Raises KVCachedConfigError for an unknown shape_kind or kv_layout, a buffer count the
        shape cannot hold, a block_shape/dtype that does not fill block_bytes, or range tensors
        that do not match ``range_sizes()``. O(L).
        """
        import torch

        if shape_kind not in SHAPE_KINDS:
            raise KVCachedConfigError(f"shape_kind={shape_kind!r} is unknown; use one of {', '.join(SHAPE_KINDS)}")
        check_kv_layout(kv_layout, has_heads=shape_kind != "mla")
        wanted_buffers = 1 if shape_kind == "mla" else 2
        if self.num_kv_buffers != wanted_buffers:
            raise KVCachedConfigError(
                f"shape_kind={shape_kind!r} needs num_kv_buffers={wanted_buffers}, this layout has "
                f"{self.num_kv_buffers}; use {'mla' if self.num_kv_buffers == 1 else 'flash_attn or flashinfer'}")
        block_shape = tuple(as_int(d, f"block_shape[{i}]", minimum=1) for i, d in enumerate(block_shape))
        if shape_kind == "mla":
            if not block_shape or min(block_shape) <= 0:
                raise KVCachedConfigError(f"block_shape={block_shape} must be positive sizes, e.g. (block_size, dim)")
            inner = block_shape
        else:
            if len(block_shape) != 3 or min(block_shape) <= 0:
                raise KVCachedConfigError(
                    f"block_shape={block_shape} must be (block_size, heads, head_dim) for {shape_kind}")
            block_size, heads, head_dim = block_shape
            inner = block_shape if kv_layout == "NHD" else (heads, block_size, head_dim)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if math.prod(inner) * itemsize != self.block_bytes:
            raise KVCachedConfigError(
                f"block_shape={block_shape} of {dtype} is {math.prod(inner) * itemsize} bytes, but block_bytes="
                f"{self.block_bytes}; the shape's product times {itemsize} must equal block_bytes")
        sizes = self.range_sizes()
        if len(range_tensors) != len(sizes):
            raise KVCachedConfigError(f"got {len(range_tensors)} range tensors, the {self.name} layout has {len(sizes)}")
        typed = []
        for i, (t, size) in enumerate(zip(range_tensors, sizes)):
            if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() < size or not t.is_contiguous():
                raise KVCachedConfigError(
                    f"range tensor {i} must be a contiguous 1-D uint8 tensor of at least {size} bytes "
                    f"(got {t.dtype}, shape {tuple(t.shape)}); pass VirtualRange.tensor()")
            typed.append(t[: t.numel() - t.numel() % itemsize].view(dtype))

        inner_strides = [1] * len(inner)
        for d in range(len(inner) - 2, -1, -1):
            inner_strides[d] = inner_strides[d + 1] * inner[d + 1]
        rows = self.max_block_id
        out = []
        for layer in range(self.num_layers):
            range_index, base, block_stride, buffer_stride = self._layer_strides(layer)
            assert base % itemsize == 0 and block_stride % itemsize == 0 and buffer_stride % itemsize == 0
            base, block_stride, buffer_stride = base // itemsize, block_stride // itemsize, buffer_stride // itemsize
            if shape_kind == "flash_attn":
                shape, strides = (2, rows, *inner), (buffer_stride, block_stride, *inner_strides)
            elif shape_kind == "flashinfer":
                shape, strides = (rows, 2, *inner), (block_stride, buffer_stride, *inner_strides)
            else:
                shape, strides = (rows, *inner), (block_stride, *inner_strides)
            out.append(torch.as_strided(typed[range_index], shape, strides, base))
        return out

    def check_invariants(self) -> None:
        """Raise AssertionError unless the intervals and the layout table agree (O(num_pages * L*K);
        for tests and KVCACHED_DEBUG_CHECKS)."""
        first, count = self.page_first_block, self.page_num_blocks
        assert first.shape == count.shape == (self.num_pages,)
        assert first.dtype == np.int64 and count.dtype == np.int32
        assert (count >= 0).all() and int(count.sum()) == self.usable_blocks >= self.num_blocks
        ends = first + count
        assert (first[1:] >= ends[:-1]).all(), "page intervals overlap or are out of order"
        assert first[0] >= 0 and ends[-1] == self.max_block_id
        sizes = self.range_sizes()
        assert all(s % self.granularity == 0 for s in sizes)
        # segments() only indexes its argument, so range indices stand in for the ranges.
        segments = self.segments(list(range(len(sizes))))
        for page in range(self.num_pages):
            if count[page] == 0:
                continue
            for block_id in (int(first[page]), int(ends[page]) - 1):
                assert self.page_of(block_id) == page, (block_id, page)
                for layer in (0, self.num_layers - 1):
                    for buffer in (0, self.num_kv_buffers - 1):
                        range_index, offset = self.byte_location(block_id, layer, buffer)
                        assert offset + self.block_bytes <= sizes[range_index]
                        assert any(seg_range == range_index
                                   and seg + page * self.map_bytes <= offset
                                   and offset + self.block_bytes <= seg + (page + 1) * self.map_bytes
                                   for seg_range, seg in segments), (block_id, layer, buffer, page)


def _dense_pages(page_bytes: int, block_bytes: int, num_blocks: int) -> tuple[int, np.ndarray, np.ndarray]:
    """Fewest pages holding num_blocks whole blocks, with each page's [first, first + count)."""

    def intervals(num_pages: int) -> tuple[np.ndarray, np.ndarray]:
        p = np.arange(num_pages, dtype=np.int64)
        first = -((-p * page_bytes) // block_bytes)          # ceil(p*P/B)
        end = ((p + 1) * page_bytes) // block_bytes          # floor((p+1)*P/B)
        return first, end - first

    num_pages = -(-num_blocks * block_bytes // page_bytes)   # enough without straddle losses
    while int(intervals(num_pages)[1].sum()) < num_blocks:
        num_pages *= 2
    first, count = intervals(num_pages)
    num_pages = int(np.searchsorted(np.cumsum(count), num_blocks)) + 1
    return num_pages, first[:num_pages].copy(), count[:num_pages].astype(np.int32)


class PerLayerLayout(KVLayout):
    """One range per layer, ``[buffer][page][blocks]``: a layer's blocks are adjacent, as in a plain
    engine cache; a page id costs L*K mappings of P bytes."""

    name = "per_layer"

    def _plan(self):
        self.num_pages, self.page_first_block, self.page_num_blocks = _dense_pages(
            self.page_bytes, self.block_bytes, self.num_blocks)
        self.map_bytes = self.page_bytes
        self.id_to_page_num, self.id_to_page_den = self.block_bytes, self.page_bytes
        self.max_block_id = int(self.page_first_block[-1] + self.page_num_blocks[-1])
        self.usable_blocks = int(self.page_num_blocks.sum())
        self._buffer_bytes = self.num_pages * self.page_bytes

    def range_sizes(self):
        return [_round_up(self.num_kv_buffers * self._buffer_bytes, self.granularity)] * self.num_layers

    def segments(self, ranges):
        return [(ranges[layer], buffer * self._buffer_bytes)
                for layer in range(self.num_layers) for buffer in range(self.num_kv_buffers)]

    def byte_location(self, block_id, layer, buffer):
        self._check_location_args(block_id, layer, buffer)
        return layer, buffer * self._buffer_bytes + block_id * self.block_bytes

    def _layer_strides(self, layer):
        return layer, 0, self.block_bytes, self._buffer_bytes


class _CompoundLayout(KVLayout):
    """A layout of one range in which a page id is one compound mapping of L*K*P bytes."""

    def range_sizes(self):
        return [_round_up(self.num_pages * self.map_bytes, self.granularity)]

    def segments(self, ranges):
        return [(ranges[0], 0)]


class InterleavedLayout(_CompoundLayout):
    """One range, block-major ``[block][layer][buffer]``: a block's buffers of every layer are
    adjacent; a page id is one compound mapping of L*K*P bytes."""

    name = "interleaved"

    def _plan(self):
        # Scaling P and B by L*K leaves every ratio, hence every interval, unchanged.
        self.num_pages, self.page_first_block, self.page_num_blocks = _dense_pages(
            self.page_bytes, self.block_bytes, self.num_blocks)
        self.map_bytes = self.buffers_per_page * self.page_bytes
        self.id_to_page_num, self.id_to_page_den = self.block_bytes, self.page_bytes
        self.max_block_id = int(self.page_first_block[-1] + self.page_num_blocks[-1])
        self.usable_blocks = int(self.page_num_blocks.sum())

    def byte_location(self, block_id, layer, buffer):
        self._check_location_args(block_id, layer, buffer)
        stride = self.buffers_per_page * self.block_bytes
        return 0, block_id * stride + (layer * self.num_kv_buffers + buffer) * self.block_bytes

    def _layer_strides(self, layer):
        return (0, layer * self.num_kv_buffers * self.block_bytes,
                self.buffers_per_page * self.block_bytes, self.block_bytes)


class PageGroupedLayout(_CompoundLayout):
    """One range, page-major ``[page][layer][buffer][slot]``: one compound mapping per page id, like
    interleaved, while a layer's blocks inside a page are adjacent, like per_layer. Sparse ids;
    opt-in only. See Note [Page-grouped ids]."""

    name = "page_grouped"

    def _plan(self):
        if self.page_bytes % self.block_bytes:
            raise KVCachedConfigError(
                f"page_grouped needs block_bytes to divide page_bytes, but {self.page_bytes} % "
                f"{self.block_bytes} = {self.page_bytes % self.block_bytes}; pick a block_size whose "
                f"block_bytes divides the page, or use the per_layer or interleaved layout.")
        self.blocks_per_page = self.page_bytes // self.block_bytes
        self.ids_per_page = self.buffers_per_page * self.blocks_per_page
        self.num_pages = -(-self.num_blocks // self.blocks_per_page)
        self.map_bytes = self.buffers_per_page * self.page_bytes
        self.page_first_block = np.arange(self.num_pages, dtype=np.int64) * self.ids_per_page
        self.page_num_blocks = np.full(self.num_pages, self.blocks_per_page, dtype=np.int32)
        self.id_to_page_num, self.id_to_page_den = 1, self.ids_per_page
        self.max_block_id = (self.num_pages - 1) * self.ids_per_page + self.blocks_per_page
        self.usable_blocks = self.num_pages * self.blocks_per_page

    def byte_location(self, block_id, layer, buffer):
        self._check_location_args(block_id, layer, buffer)
        page, slot = divmod(block_id, self.ids_per_page)
        if slot >= self.blocks_per_page:
            raise KVCachedConfigError(
                f"block_id={block_id} is slot {slot} of page {page}; page_grouped ids use slots "
                f"[0, {self.blocks_per_page}) only")
        return 0, (page * self.map_bytes + (layer * self.num_kv_buffers + buffer) * self.page_bytes
                   + slot * self.block_bytes)

    def _layer_strides(self, layer):
        # Row id = page*ids_per_page + slot sits at id*B + (l*K + k)*P: ids_per_page*B = L*K*P.
        return 0, layer * self.num_kv_buffers * self.page_bytes, self.block_bytes, self.page_bytes


_LAYOUTS = {cls.name: cls for cls in (PerLayerLayout, InterleavedLayout, PageGroupedLayout)}


def make_layout(name: str, num_layers: int, num_kv_buffers: int, block_bytes: int, page_bytes: int,
                num_blocks: int, granularity: int) -> KVLayout:
    """The layout ``name`` ("per_layer", "interleaved" or "page_grouped"; resolve "auto" with
    :func:`choose_layout` first) for one KV group. O(num_pages).

    Raises KVCachedConfigError for an unknown name or any invalid size (the message says what works).
    """
    cls = _LAYOUTS.get(name)
    if cls is None:
        raise KVCachedConfigError(
            f"layout={name!r} is unknown; use one of {', '.join(LAYOUT_NAMES)} (or 'auto' via choose_layout)")
    return cls(num_layers, num_kv_buffers, block_bytes, page_bytes, num_blocks, granularity)


def choose_layout(requested: str, backend_kind: str, needs_joint_kv: bool = False, *,
                  integrated_memory: bool = False) -> tuple[str, str]:
    """Resolve a layout setting to a layout name, with the reason in words (for the log).

    requested: "auto" or a name of LAYOUT_NAMES (KVCACHED_LAYOUT).
    backend_kind: "cuda" or "host" (``Backend.kind``).
    needs_joint_kv: the group holds hybrid linear-attention / mamba state, which needs a block's
        buffers adjacent in one buffer: forces interleaved, overriding an explicit setting.
    integrated_memory: the GPU shares memory with the CPU (GB10, Jetson:
        ``torch.cuda.get_device_properties(d).is_integrated``).
    See Note [Default layout]. Raises KVCachedConfigError for an unknown value.
    """
    if requested not in ("auto",) + LAYOUT_NAMES:
        raise KVCachedConfigError(
            f"KVCACHED_LAYOUT={requested!r} is unknown; use auto, {', '.join(LAYOUT_NAMES)}")
    if backend_kind not in BACKEND_KINDS:
        raise KVCachedConfigError(f"backend_kind={backend_kind!r} is unknown; use cuda or host")
    if needs_joint_kv:
        if requested in ("auto", "interleaved"):
            return "interleaved", ("hybrid linear/mamba group: a block's K and V (or recurrent state) must be "
                                   "adjacent in one buffer, which interleaved gives ([block][layer][buffer])")
        return "interleaved", (f"KVCACHED_LAYOUT={requested} overridden: a hybrid linear/mamba group needs a "
                               f"block's buffers adjacent in one buffer, which only interleaved gives")
    if requested != "auto":
        return requested, f"KVCACHED_LAYOUT={requested}"
    if backend_kind == "cuda" and integrated_memory:
        return "per_layer", ("auto on an integrated-memory GPU: the interleaved block stride was measured to slow "
                             "FlashAttention's split-KV kernel by 56% on a GB10; per_layer keeps blocks adjacent")
    if backend_kind == "cuda":
        return "interleaved", ("auto on a discrete-memory GPU: one mapping per page id (per_layer's 2*L take ~70x "
                               "as long) and the block stride costs nothing there (every layout reads K/V at the "
                               "copy rate)")
    return "interleaved", ("auto on the host backend: one mapping per page id instead of 2*L (which take ~80x as "
                           "long, each mmap a VMA against vm.max_map_count), and the stride was not measured to cost")


# Note [Per-layer ranges]
# The plain per_layer design is one range per (layer, K/V) buffer. We reserve one range per
# *layer* and put buffer k at offset k * num_pages * P inside it: torch.as_strided views one
# storage, and the FlashAttention tensor (2, N, ...) of a layer spans K and V, so K and V must lie
# in one reservation at a fixed distance. The page table still sees 2*L segments (one per layer
# and buffer), so the mapping count, and everything measured about it (docs/design.md, Layouts),
# is that of the plain design. The reference project (non-contiguous mode) does the same.
#
# Note [Page-grouped ids]
# page_grouped stores page p as [layer][buffer][slot] with bpp = P // B slots per buffer. To give
# every layer one uniform-stride tensor (what attention kernels take), block ids are sparse:
# id = p * ids_per_page + slot with ids_per_page = L*K*bpp, so that row `id` of layer l, buffer k
# sits at id*B + (l*K + k)*P — a single stride B per row and a fixed base per (layer, buffer).
# How this differs from the plain contract (KVCacheManager's docstring: ids [0, num_blocks)):
#   - ids are not [0, num_blocks): page p hands out [p*ids_per_page, p*ids_per_page + bpp) only;
#     max_block_id = (num_pages - 1) * ids_per_page + bpp, about L*K times num_blocks;
#   - every view's block dimension is max_block_id rows, i.e. num_pages * ids_per_page minus the
#     tail (L*K - 1) * bpp, not num_blocks; a block table must hold ids up to max_block_id - 1;
#   - rows whose slot is >= bpp alias other layers' blocks: never write them (only the allocator's
#     ids are safe), and a kernel must not treat the id space as dense (e.g. size a buffer by N).
# So it is opt-in (KVCACHED_LAYOUT=page_grouped), never chosen by auto.
#
# Note [Default layout]
# What separates the layouts is (a) how many mappings a page id costs and (b) whether the block
# stride inside a layer (one block in per_layer, L*K blocks in interleaved) slows attention.
# (a) is measured everywhere: on CUDA the cost is per mapping, not per byte, so per_layer maps a
# page id ~70x slower than one compound mapping at 32 layers (benchmarks/README.md, bench_vmm); the
# reference project's per_layer allocator was 10-100x slower with no reserve pool. On the host
# backend a mapping costs a few us and one VMA, and vm.max_map_count (65530) caps scattered
# mappings, so 2*L mappings per page id are the ones to avoid there too. (b) was measured on a
# discrete GPU: every layout reads K/V at the copy rate, within 1 % of a plain cache
# (benchmarks/README.md, bench_layout), while the reference project published 56% (kernel) and 31%
# (end to end) slowdowns for interleaved on a GB10, an integrated-memory part. On the host backend
# (32 layers, K+V, 32 KiB blocks, 256 KiB pages, 64 page ids) per_layer mapped a page id ~80x
# slower than interleaved and unmapped it ~60x slower; reading 400 random blocks of every layer
# block by block (memcpy per block, as a paged kernel reads them) ran as fast for interleaved as
# for per_layer, and ~15 % slower for page_grouped: no stride cost (benchmarks/HISTORY.md).
# (torch's generic index_select over the block dimension did hit a slow path on the interleaved
# view, a sixth of the per-block rate: code that gathers blocks with torch ops on the host should
# gather per block or ask for per_layer.) Hence: interleaved on discrete GPUs and on the host
# backend, per_layer where memory is integrated (the stride cost was shown). page_grouped would
# give both, but its sparse ids break the plain contract, so it is never the default. Figures for
# other platforms go into benchmarks/ and, if they show a stride cost, into this choice.
