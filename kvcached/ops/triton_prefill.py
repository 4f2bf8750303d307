"""The Triton paged prefill kernel: causal attention of a packed varlen batch through block tables.

One launch per layer for any mix of requests: whole prompts, chunked prefills (queries that start
mid-sequence) and decode rows. Programs run over (q-tile, KV head); a q-tile is BLOCK_Q consecutive
queries of one request times the GQA group's heads, the BLOCK_M rows of both tensor-core dots, so
the group shares every K/V load. The grid comes from the shapes alone; each program finds its
request by a binary search over query_start_loc on the device. See Note [Prefill kernel shape].

Imported only for CUDA tensors (the CPU torch wheel has no triton), or explicitly under
``TRITON_INTERPRET=1`` to run the kernel on the CPU in tests.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton  # type: ignore[import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-not-found, unused-ignore]

from ._args import CacheGeometry
from .triton_decode import LOG2_E, aligned, cache_pointer, device_of, element_type


@triton.jit
def _attend_chunk(acc, m_i, l_i, q, q_pos, k_ptr, v_ptr, table, start, kv_lo, kv_hi, window, scale_log2,
                  sk_block, sk_token, sv_block, sv_token, k_cols, v_cols, dim_ok,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, MASKED: tl.constexpr,
                  USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One step of the online softmax over tokens [start, start + BLOCK_N). MASKED chunks may hold
    tokens outside [kv_lo, kv_hi) (never loaded) and positions some rows must not see."""
    tokens = start + tl.arange(0, BLOCK_N)
    if MASKED:
        valid = (tokens >= kv_lo) & (tokens < kv_hi)
        # Masked lanes load nothing: no table entry, no slot outside the request's needed range.
        block = tl.load(table + tokens // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        load_ok = valid[:, None] & dim_ok[None, :]
    else:
        block = tl.load(table + tokens // BLOCK_SIZE).to(tl.int64)
        load_ok = dim_ok[None, :]
    slot = (tokens % BLOCK_SIZE)[:, None]
    k_ptrs = k_ptr + block[:, None] * sk_block + slot * sk_token + k_cols[None, :]
    v_ptrs = v_ptr + block[:, None] * sv_block + slot * sv_token + v_cols[None, :]
    if EVEN_D and not MASKED:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=load_ok, other=0.0)
        v = tl.load(v_ptrs, mask=load_ok, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        see = valid[None, :] & (tokens[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            see = see & (tokens[None, :] > q_pos[:, None] - window)
        s = tl.where(see, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen nothing yet keeps m = -inf; subtract 0 then (-inf - -inf is NaN).
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = m_new
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["table_ptr", "seq_lens_ptr", "starts_ptr", "num_seqs", "first_token", "window",
                               "s_table"])   # Note [One compile per model]
def _prefill_kernel(q_ptr, k_addr, v_addr, table_ptr, seq_lens_ptr, starts_ptr, out_ptr, num_seqs, first_token,
                    scale_log2, window,
                    sq_token, sq_head, sq_dim,
                    sk_block, sk_token, sk_head, sk_dim,
                    sv_block, sv_token, sv_head, sv_dim,
                    s_table, so_token, so_head, so_dim,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
                    D_PAD: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                    USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, CACHE_DTYPE: tl.constexpr,
                    ALIGNED: tl.constexpr):
    # See Note [Cache base address] in triton_decode, and Note [Prefill kernel shape] (Alignment).
    k_ptr = cache_pointer(k_addr, CACHE_DTYPE, ALIGNED)
    v_ptr = cache_pointer(v_addr, CACHE_DTYPE, ALIGNED)
    # The last tiles of a request attend to the most tokens: start them first (a shorter tail).
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)

    # Request r owns tiles [starts[r] // BLOCK_Q + r, starts[r + 1] // BLOCK_Q + r + 1): find the
    # last r whose first tile is <= this one. See Note [Prefill kernel shape].
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        if (tl.load(starts_ptr + mid).to(tl.int32) - first_token) // BLOCK_Q + mid <= tile:
            left = mid + 1
        else:
            right = mid
    seq = left - 1
    q_begin = tl.load(starts_ptr + seq).to(tl.int32) - first_token
    q_len = tl.load(starts_ptr + seq + 1).to(tl.int32) - first_token - q_begin
    first = (tile - q_begin // BLOCK_Q - seq) * BLOCK_Q      # the tile's first query, within the request
    if first >= q_len:
        return
    context = tl.load(seq_lens_ptr + seq).to(tl.int32) - q_len

    # Row m is query first + m // GROUP of head kv_head * GROUP + m % GROUP.
    rows = tl.arange(0, BLOCK_M)
    query = first + rows // GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (query < q_len)
    heads = kv_head * GROUP + rows % GROUP
    q_pos = context + query
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < HEAD_DIM
    token = (q_begin + query).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * sq_token + heads[:, None] * sq_head + dims[None, :] * sq_dim,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # Tokens [kv_lo, kv_hi) are what some row sees; [mid_lo, mid_hi) whole chunks every row sees.
    p_first = context + first
    p_last = context + tl.minimum(first + BLOCK_Q, q_len) - 1
    kv_hi = p_last + 1
    mid_hi = (p_first + 1) // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = table_ptr + seq * s_table
    k_cols = kv_head * sk_head + dims * sk_dim
    v_cols = kv_head * sv_head + dims * sv_dim
    if USE_WINDOW:
        kv_lo = tl.maximum(p_first - window + 1, 0)
        full_lo = tl.maximum(p_last - window + 1, 0)
        mid_lo = tl.minimum((full_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N, mid_hi)
        for start in range(kv_lo // BLOCK_N * BLOCK_N, mid_lo, BLOCK_N):
            acc, m_i, l_i = _attend_chunk(acc, m_i, l_i, q, q_pos, k_ptr, v_ptr, table, start, kv_lo, kv_hi,
                                          window, scale_log2, sk_block, sk_token, sv_block, sv_token, k_cols,
                                          v_cols, dim_ok, BLOCK_SIZE, BLOCK_N, EVEN_D, True, USE_WINDOW,
                                          DOT_PRECISION)
    else:
        kv_lo = 0
        mid_lo = 0
    for start in range(mid_lo, mid_hi, BLOCK_N):
        acc, m_i, l_i = _attend_chunk(acc, m_i, l_i, q, q_pos, k_ptr, v_ptr, table, start, kv_lo, kv_hi,
                                      window, scale_log2, sk_block, sk_token, sv_block, sv_token, k_cols,
                                      v_cols, dim_ok, BLOCK_SIZE, BLOCK_N, EVEN_D, False, USE_WINDOW,
                                      DOT_PRECISION)
    for start in range(mid_hi, kv_hi, BLOCK_N):
        acc, m_i, l_i = _attend_chunk(acc, m_i, l_i, q, q_pos, k_ptr, v_ptr, table, start, kv_lo, kv_hi,
                                      window, scale_log2, sk_block, sk_token, sv_block, sv_token, k_cols,
                                      v_cols, dim_ok, BLOCK_SIZE, BLOCK_N, EVEN_D, True, USE_WINDOW,
                                      DOT_PRECISION)

    # Every stored row saw at least its own position, so l > 0 there; padding rows are not stored.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token[:, None] * so_token + heads[:, None] * so_head + dims[None, :] * so_dim,
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


class Tiles(NamedTuple):
    """A launch configuration: rows per q-tile, tokens per KV step, warps, pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def default_tiles(head_dim: int, element_size: int, group: int) -> Tiles:
    """Tile sizes by dtype and head dim. See Note [Prefill kernel shape]."""
    d_pad = max(16, triton.next_power_of_2(head_dim))
    if element_size >= 4:           # fp32: FMA dots (input_precision="ieee"), small tiles
        tiles = Tiles(16, 32, 4, 2) if d_pad <= 64 else Tiles(16, 16, 4, 2)
    elif d_pad <= 64:
        tiles = Tiles(128, 64, 8, 3)
    elif d_pad <= 128:
        tiles = Tiles(128, 32, 4, 3)
    else:
        tiles = Tiles(64, 32, 8, 2)
    return tiles._replace(block_m=max(tiles.block_m, triton.next_power_of_2(group)))


def paged_prefill_triton(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                         scale: float, sliding_window: int | None, geometry: CacheGeometry, *,
                         tiles: Tiles | None = None, out: torch.Tensor | None = None,
                         first_token: int = 0) -> torch.Tensor:
    """Launch the prefill kernel; arguments already checked by paged_attention (query_start_loc's
    contents are the caller's contract). ``tiles`` None picks them from the shapes (tests force
    small ones); ``out`` (the query's shape and dtype) is written instead of a new tensor;
    ``first_token``: query_start_loc starts there instead of at 0 (the requests after a batch's
    decode rows, Note [Decode rows of a mixed step]). Reads no tensor's contents on the host."""
    tokens, heads, head_dim = query.shape
    batch = seq_lens.shape[0]
    group = heads // geometry.num_kv_heads
    tiles = tiles or default_tiles(head_dim, k_cache.element_size(), group)
    if tiles.block_m < group:
        raise ValueError(f"block_m={tiles.block_m} holds fewer rows than the GQA group of {group}")
    block_q = tiles.block_m // group
    d_pad = max(16, triton.next_power_of_2(head_dim))
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if tokens == 0:
        return out
    stages = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages} if query.is_cuda else {}
    with device_of(query):
        _prefill_kernel[(tokens // block_q + batch, geometry.num_kv_heads)](
            query, k_cache.data_ptr(), v_cache.data_ptr(), block_tables, seq_lens, query_start_loc, out, batch,
            first_token,
            scale * LOG2_E, sliding_window or 0,
            *query.stride(), *geometry.k_strides, *geometry.v_strides, block_tables.stride(0), *out.stride(),
            GROUP=group, BLOCK_M=tiles.block_m, BLOCK_Q=block_q, HEAD_DIM=head_dim,
            D_PAD=d_pad, EVEN_D=d_pad == head_dim, BLOCK_SIZE=geometry.block_size,
            BLOCK_N=tiles.block_n, USE_WINDOW=sliding_window is not None,
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
            CACHE_DTYPE=element_type(k_cache),
            ALIGNED=aligned(k_cache, v_cache), **stages)
    return out


# Note [Prefill kernel shape]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Prefill attention is bound by the two dots (~4 * q_len * seq_len * D FLOP per head against one
# read of K/V per q-tile), so the kernel is a flash-attention forward: a q-tile stays in registers
# while BLOCK_N-token chunks of K and V stream through shared memory (num_stages deep, the loads
# of later chunks in flight while one computes), online softmax in fp32 with exp2.
#
# Rows. A program owns one q-tile of one KV head: BLOCK_Q = BLOCK_M // GROUP consecutive queries
# of one request, times the GROUP query heads that read that KV head, packed as BLOCK_M rows
# (row m = query m // GROUP, head m % GROUP). Every K/V chunk is loaded once for the whole group,
# and the dots are BLOCK_M rows tall whatever the group; a group that does not divide BLOCK_M
# leaves the last rows idle. Decode rows (q_len 1) get a tile of their own, mostly idle rows:
# cheap next to a prompt's tiles, and it keeps a mixed step in one launch.
#
# Grid. Request r's tiles are numbered from starts[r] // BLOCK_Q + r: it has
# floor(end / BLOCK_Q) - floor(start / BLOCK_Q) + 1 >= ceil(q_len / BLOCK_Q) of them, and the
# last request's end is T // BLOCK_Q + B, so (T // BLOCK_Q + B, KVH) programs cover every batch
# of T tokens in B requests, known from the shapes alone (no host read of query_start_loc: no
# stream stall, and the launch can be captured in a CUDA graph). A program finds its request by
# a binary search over query_start_loc (log2 B loads, cached); a program past its request's
# queries returns at once. Programs run last tile first: late tiles see the most tokens.
#
# KV loop. A tile reads tokens [kv_lo, kv_hi): from the window start of its first query (0
# without a window) to its last query's position. Chunks are BLOCK_N-aligned; only the chunks
# that hold a boundary (the window's start, the causal diagonal) are masked, and the chunks every
# row sees in full, [mid_lo, mid_hi), run without any mask or bounds check. A masked lane loads
# nothing, neither the block-table entry nor the slot, so nothing outside the request's needed
# blocks (Note [Block table contract]) is ever read, and NaN there cannot leak. Each token looks
# its block up (token // BLOCK_SIZE, widened to int64 before scaling by the block stride, as in
# the decode kernel), so any block size works and a chunk may span blocks.
#
# Alignment. The caches arrive as int64 addresses (Note [Cache base address]), so Triton cannot
# see that they are 16-byte aligned as it would for a pointer argument; without that, the K/V
# loads are not vectorised, not turned into asynchronous copies and not pipelined at all (the
# compiled code for sm_90 showed no cp.async, 255 registers and spills). ALIGNED, checked on the
# host from the addresses, restores the fact with tl.multiple_of: cp.async, 3 stages, ~184
# registers at bf16 D 128. The strides get Triton's usual specialisation (multiples of 16).
#
# Tiles (all dims multiples of 16 for tl.dot), checked by compiling for sm_90 with this Triton
# (3.6) and reading shared memory and registers from the cubin:
#   fp16/bf16, D 128:    BLOCK_M 128, BLOCK_N 32, 4 warps, 3 stages, chosen from 36 tile
#                        sets (bf16, 32 heads over 8 KV heads): 16 prompts of 512 tokens and 8
#                        of 2048 take 0.82 x and 0.91 x the time of the row below's 128 x 64, 8
#                        warps, and 0.93-0.94 x that of SDPA's flash backend on dense copies
#                        (benchmarks/README.md, bench_attention; the sweep in
#                        benchmarks/HISTORY.md). Fewer warps and smaller K/V steps let more
#                        programs share a multiprocessor, which short prompts' few KV steps need.
#   fp16/bf16, D <= 64:  BLOCK_M 128, BLOCK_N 64, 8 warps, 3 stages: 132 registers, wgmma, no
#                        spills (Triton's flash-attention tutorial's Hopper setting; not timed)
#   fp16/bf16, D 256:    BLOCK_M 64, BLOCK_N 32, 8 warps, 2 stages: 96 KiB, 172 registers
#   fp32 (D <= 64 / more): BLOCK_M 16, BLOCK_N 32 / 16, 4 warps, 2 stages: <= 50 KiB, <= 142
#                        registers. fp32 dots are "ieee" FMA loops (no tensor cores); larger
#                        tiles spilled hundreds of bytes a thread.
# A GQA group larger than BLOCK_M widens it to the group. Shared memory stays within the 227 KiB
# a block may use on an H100/H200 (and the 163 KiB of an A100) in every row.
# benchmarks/bench_attention.py measures the bf16 D 128 row against SDPA's flash backend.
