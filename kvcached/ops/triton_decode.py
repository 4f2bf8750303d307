"""The Triton paged decode kernel: one query token per sequence against its cached K/V.

One program per (sequence, KV head[, split]); the GQA group's queries are padded to at least 16
rows so that both products are ``tl.dot``; each loop step reads BLOCK_N tokens (4 blocks of 16
at block_size 16) through the block table, pipelined over 2 or 3 stages. See Note [Decode
kernel shape] and Note [Pipeline stages].

Imported only for CUDA tensors (the CPU torch wheel has no triton), or explicitly under
``TRITON_INTERPRET=1`` to run the kernel on the CPU in tests.
"""

from __future__ import annotations

import contextlib

import torch
import triton  # type: ignore[import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-not-found, unused-ignore]

from ._args import CacheGeometry
from .waves import fullest_last_wave, programs_per_sm

LOG2_E = 1.4426950408889634
MAX_SPLITS = 16
TOKENS_PER_SPLIT_MIN = 512      # a split reads at least this many tokens (else the combine costs more)
_TILE_BYTES = 16 << 10          # one K (or V) tile of BLOCK_N x D_PAD elements per pipeline stage
PIPELINE_STAGES = (3, 2)        # the decode kernel's choices, deeper first: Note [Pipeline stages]


@triton.jit
def cache_pointer(addr, CACHE_DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """A cache's base address (int64) as a pointer to its elements, 16-byte aligned if ALIGNED.
    See Note [Cache base address]."""
    ptr = addr.to(tl.int64).to(tl.pointer_type(CACHE_DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit(do_not_specialize=["table_ptr", "seq_lens_ptr", "window", "s_table"])     # See Note [One compile per model]
def _decode_kernel(q_ptr, k_addr, v_addr, table_ptr, seq_lens_ptr, out_ptr, m_part_ptr, l_part_ptr, o_part_ptr,
                   scale_log2, window,
                   sq_seq, sq_head, sq_dim,
                   sk_block, sk_token, sk_head, sk_dim,
                   sv_block, sv_token, sv_head, sv_dim,
                   s_table, so_seq, so_head, so_dim,
                   KV_HEADS: tl.constexpr, GROUP: tl.constexpr, Q_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, CACHE_DTYPE: tl.constexpr,
                   ALIGNED: tl.constexpr):
    k_ptr = cache_pointer(k_addr, CACHE_DTYPE, ALIGNED)
    v_ptr = cache_pointer(v_addr, CACHE_DTYPE, ALIGNED)
    kv_head = tl.program_id(0) % KV_HEADS          # a sequence's heads run side by side: Note [Program order]
    seq = tl.program_id(0) // KV_HEADS
    split = tl.program_id(1)

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    first = 0
    if USE_WINDOW:
        first = tl.maximum(seq_len - window, 0)
    # This split's tokens: whole BLOCK_N chunks of [first rounded down, seq_len).
    chunk0 = (first // BLOCK_N) * BLOCK_N
    chunks = tl.cdiv(seq_len - chunk0, BLOCK_N)
    per_split = tl.cdiv(chunks, NUM_SPLITS)
    lo = chunk0 + split * per_split * BLOCK_N
    hi = tl.minimum(lo + per_split * BLOCK_N, seq_len)

    rows = tl.arange(0, Q_ROWS)
    dims = tl.arange(0, D_PAD)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q = tl.load(q_ptr + seq * sq_seq + heads[:, None] * sq_head + dims[None, :] * sq_dim,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    m_i = tl.full([Q_ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([Q_ROWS], tl.float32)
    acc = tl.zeros([Q_ROWS, D_PAD], tl.float32)
    table = table_ptr + seq * s_table
    for start in range(lo, hi, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        valid = (tokens < hi) & (tokens >= first)
        # Masked lanes load nothing: no block outside the table, no slot past seq_len is read.
        block = tl.load(table + tokens // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slot = tokens % BLOCK_SIZE
        load_ok = valid[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + block[:, None] * sk_block + slot[:, None] * sk_token + kv_head * sk_head
                    + dims[None, :] * sk_dim, mask=load_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + block[:, None] * sv_block + slot[:, None] * sv_token + kv_head * sv_head
                    + dims[None, :] * sv_dim, mask=load_ok, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    store_ok = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + seq * so_seq + heads[:, None] * so_head + dims[None, :] * so_dim,
                 out.to(out_ptr.dtype.element_ty), mask=store_ok)
    else:
        # Partials [seq, head, split(, dim)], contiguous; an empty split leaves m=-inf, l=0, acc=0.
        part = (seq * GROUP * KV_HEADS + heads) * NUM_SPLITS + split
        tl.store(m_part_ptr + part, m_i, mask=row_ok)
        tl.store(l_part_ptr + part, l_i, mask=row_ok)
        tl.store(o_part_ptr + part[:, None] * D_PAD + dims[None, :], acc, mask=store_ok)


@triton.jit
def _combine_kernel(m_part_ptr, l_part_ptr, o_part_ptr, out_ptr, so_seq, so_head, so_dim, num_heads,
                    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                    D_PAD: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, D_PAD)
    split_ok = splits < NUM_SPLITS
    part = (seq * num_heads + head) * NUM_SPLITS + splits
    m = tl.load(m_part_ptr + part, mask=split_ok, other=float("-inf"))
    l_part = tl.load(l_part_ptr + part, mask=split_ok, other=0.0)
    o = tl.load(o_part_ptr + part[:, None] * D_PAD + dims[None, :], mask=split_ok[:, None], other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)
    total = tl.sum(weight * l_part, 0)
    out = tl.sum(weight[:, None] * o, 0) / total
    tl.store(out_ptr + seq * so_seq + head * so_head + dims * so_dim, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def element_type(cache: torch.Tensor) -> object:
    """The triton element type of a cache, which reaches a kernel as a bare address
    (``cache.data_ptr()``). See Note [Cache base address]."""
    return _TL_DTYPES[cache.dtype]


def aligned(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether both caches start 16-byte aligned, as Triton would have seen on a pointer argument
    (a kernel told so with ``tl.multiple_of`` vectorises and pipelines its loads; an int64 address
    hides it). See Note [Cache base address]."""
    return k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0


def device_of(tensor: torch.Tensor):
    """The CUDA device context of a launch (none for CPU tensors under the interpreter)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


_sm_counts: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    """The device's multiprocessors (cached: the property query costs microseconds)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_counts[index]


def _num_splits(batch: int, kv_heads: int, max_tokens: int, device: torch.device) -> int:
    """Splits of each sequence so that about two programs per multiprocessor run, no more than the
    table's capacity allows at TOKENS_PER_SPLIT_MIN tokens a split, rounded down to a power of two
    (a compile per value: Note [One compile per model]). Host-side only (no sync)."""
    if device.type != "cuda":
        return 1
    programs = batch * kv_heads
    wanted = -(-2 * _sm_count(device) // programs)
    return 1 << (max(1, min(wanted, MAX_SPLITS, max_tokens // TOKENS_PER_SPLIT_MIN)).bit_length() - 1)


_programs_per_sm: dict[tuple, int] = {}   # (stages, device, strides, constexprs) -> programs a multiprocessor holds


def _pipeline_stages(grid: tuple[int, int], args: tuple, constexprs: dict, strides: tuple[int, ...],
                     device: torch.device) -> int:
    """The stage count of PIPELINE_STAGES that fills the last wave best. Each variant is compiled
    once per set of constexprs and ``strides`` (the specialised ones) to learn how many of its
    programs a multiprocessor holds. See Note [Pipeline stages]."""
    variant = (device, strides, *constexprs.values())        # constexprs are passed in one order
    per_sm = {}
    for stages in PIPELINE_STAGES:
        key = (stages, *variant)
        if key not in _programs_per_sm:
            kernel = _decode_kernel.warmup(*args, grid=grid, **constexprs, num_warps=4, num_stages=stages)
            _programs_per_sm[key] = programs_per_sm(kernel)
        per_sm[stages] = _programs_per_sm[key]
    return fullest_last_wave(grid[0] * grid[1], per_sm, _sm_count(device))


def paged_decode_triton(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                        sliding_window: int | None, geometry: CacheGeometry, *,
                        num_splits: int | None = None, num_stages: int | None = None,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the decode kernel; arguments already checked by paged_decode. ``num_splits`` and
    ``num_stages`` (the pipeline's depth, CUDA only) None pick them from the batch shape (tests
    force them); ``out`` (the query's shape and dtype) is written instead of a new tensor."""
    batch, heads, head_dim = query.shape
    group = heads // geometry.num_kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    block_n = max(16, min(64, _TILE_BYTES // (d_pad * k_cache.element_size())))
    splits = num_splits or _num_splits(batch, geometry.num_kv_heads, block_tables.shape[1] * geometry.block_size,
                                       query.device)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    if splits > 1:
        m_part = torch.empty((batch, heads, splits), dtype=torch.float32, device=query.device)
        l_part = torch.empty_like(m_part)
        o_part = torch.empty((batch, heads, splits, d_pad), dtype=torch.float32, device=query.device)
    else:
        m_part = l_part = o_part = out
    grid = (batch * geometry.num_kv_heads, splits)
    data_strides = (*query.stride(), *geometry.k_strides, *geometry.v_strides)
    args = (query, k_cache.data_ptr(), v_cache.data_ptr(), block_tables, seq_lens, out, m_part, l_part, o_part,
            scale * LOG2_E, sliding_window or 0, *data_strides, block_tables.stride(0), *out.stride())
    constexprs = dict(KV_HEADS=geometry.num_kv_heads, GROUP=group, Q_ROWS=max(16, triton.next_power_of_2(group)),
                      HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=geometry.block_size, BLOCK_N=block_n,
                      NUM_SPLITS=splits, USE_WINDOW=sliding_window is not None,
                      DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
                      CACHE_DTYPE=element_type(k_cache), ALIGNED=aligned(k_cache, v_cache))
    with device_of(query):
        if query.is_cuda:
            stages = num_stages or _pipeline_stages(grid, args, constexprs, (*data_strides, *out.stride()),
                                                    query.device)
            _decode_kernel[grid](*args, **constexprs, num_warps=4, num_stages=stages)
        else:
            _decode_kernel[grid](*args, **constexprs)
        if splits > 1:
            _combine_kernel[(batch, heads)](
                m_part, l_part, o_part, out, *out.stride(), heads,
                NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), HEAD_DIM=head_dim, D_PAD=d_pad)
    return out


# Note [Decode kernel shape]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Decode attention reads every cached K/V byte once and does ~2 FLOP per byte: it is bound by
# memory bandwidth, and the kernel's only job is to keep enough loads in flight. With this shape
# it reads K/V at the copy rate (benchmarks/README.md, bench_layout): one program per (sequence,
# KV head), so each K/V byte is read by exactly one program and the GQA group's queries share
# it; the group padded to 16 rows so that q.K^T and p.V are tensor-core dots (a group of 1-8
# rows would otherwise be a reduction over registers); BLOCK_N = 64 tokens per step
# (4 blocks of 16) and 3 pipeline stages, so ~2 steps of loads are in flight while one computes
# (or 2 stages where that fills the last wave better: Note [Pipeline stages]).
# Every token looks its block up in the table (BLOCK_N loads of the table's int32 or int64, served
# by L1), which makes any block size work and lets a chunk span several blocks; the block id is
# widened to int64 before it is scaled by the block stride (a 78 GiB cache has element offsets
# past 2^31).
# Tiles are capped at 16 KiB per stage (BLOCK_N 32 at head_dim 256 or float32) to stay within
# shared memory with 3 stages. With few (sequence, head) pairs the GPU would idle, so each
# sequence is split into up to MAX_SPLITS ranges whose partial softmax states (m, l, acc) a
# second small kernel combines; the split count is taken from the shapes on the host, never from
# seq_lens (reading them would stall the stream). Splitting pays only below ~2 programs per
# multiprocessor: with 8 KV heads x 128 and 1024 tokens, at 16 sequences 3-4 splits read K/V
# 1.4 x as fast as one; at 64 and 500 sequences splitting was 6-17 % slower
# (benchmarks/HISTORY.md).
#
# Note [Pipeline stages]
# ~~~~~~~~~~~~~~~~~~~~~~~
# The kernel's programs all stream about the same bytes, so a launch runs in waves of as many
# programs as the multiprocessors hold at once, and a last wave that is partly empty leaves HBM
# idle. How many a multiprocessor holds follows the pipeline's depth: with Llama-3-8B shapes in
# bf16, compiled for sm_90, 3 stages take 136 registers a thread, 3 programs per multiprocessor,
# and 2 stages 126, 4 programs; shared memory (39 KiB a program) is not what binds. Neither depth
# wins everywhere: the deeper one keeps more loads in flight per program, the shallower one more
# programs. Which last wave is fuller decides, within a few percent, at every batch measured
# (16-320 sequences of 528 and 1024 tokens, equal and ragged lengths; benchmarks/HISTORY.md):
# 64 x 528 tokens, 512 programs, 4 a multiprocessor fill 0.97 of a wave against 3 filling 1.29
# waves, and 2 stages take 0.82 x the time of 3; 88 x 528 (704 programs: 1.33 waves against
# 1.78) 2 stages take 1.11 x. So each launch picks the depth whose last wave is fullest, from the
# programs per multiprocessor of each variant as compiled (its registers, shared memory and
# threads), learned once per variant; a variant is compiled for each depth the first time its
# shapes are met. The two depths compute the same sums in the same
# order: the outputs are bit for bit equal.
#
# Note [Program order]
# ~~~~~~~~~~~~~~~~~~~~
# The grid is one axis of (sequence, KV head) pairs with the head varying fastest, so the
# programs that run at the same time are the KV heads of a few sequences: together they read
# whole token rows of the same blocks (NHD: a token's heads are adjacent) instead of one head's
# slice of many sequences' blocks. A same-run A/B (Llama-3-8B shapes, bf16, outputs bit for bit
# equal) gave 1.3-2.7 % less time at 64-500 sequences of 528-1056 tokens and no change on the
# split path (benchmarks/HISTORY.md). Both are folded into the first axis rather than the
# sequences put on the second, which stops at 65,535: any batch launches.
#
# Note [One compile per model]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Triton compiles a kernel once per value class of each integer argument (1, a multiple of 16,
# anything else) unless told not to. The arguments that change from step to step in a serving
# loop (the number of requests, the block tables' row stride, the window, which layers of one
# model differ in) are marked do_not_specialize: otherwise a batch that first reaches 16
# requests, or a table that first grows to 16 columns, stalls its step for a compile. So are the
# pointers to the step's metadata (block tables, sequence lengths, query starts, slot mapping),
# whose 16-byte alignment Triton specialises on too: a loop packs them into one int64 tensor and
# a mixed step slices them past its decode rows, so their alignment follows the parity of the
# step's token and decode counts. The end-to-end run (256 x (512 + 256)) met two such new
# classes of the prefill kernel after its warm-up, and a step stalled for over a second per new
# class (benchmarks/HISTORY.md). Those loads are scalar or gathered anyway. The strides of the
# caches and tokens stay specialised: they are fixed per model and their divisibility is what lets
# the loads vectorise. The decode kernel's split count is a constexpr (it sizes the combine's
# arange), and it follows the number of decode rows: the decode rows of an eager mixed step
# could ask for any value from 1 to MAX_SPLITS, each a compile the first time a process met it. It is
# rounded down to a power of two, so there are five (1, 2, 4, 8, 16); with Llama-3-8B shapes on
# an H200 (132 multiprocessors, 8 KV heads, a table of 8,192 tokens) the decode graphs' batches
# 1, 4, 8, 16 and 40 give all five at capture.
#
# Note [Cache base address]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# Triton's launcher checks every tensor argument with cuPointerGetAttribute and refuses one whose
# address the driver does not know ("Pointer argument cannot be accessed from Triton"). A kvcached
# cache's base address is the start of a virtual reservation, and the page there is mapped only
# while it holds live blocks (right after creation, after a trim, or when the first blocks handed
# out sit on a later page, it is not). The kernels therefore take the caches' base addresses as
# int64 and cast them to pointers inside: only the blocks named by the tables are dereferenced,
# and those are mapped by contract. An integer hides the address's alignment, which Triton reads
# off a pointer argument: the kernels take ALIGNED (both caches 16-byte aligned, checked on the
# host) and restore it with tl.multiple_of, without which the loads are neither vectorised nor
# pipelined (compiled for sm_90: no cp.async, 255 registers and spills).
