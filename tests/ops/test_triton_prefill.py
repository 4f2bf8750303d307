"""The Triton paged prefill kernel (kvcached.ops.triton_prefill) and paged_attention on CUDA.

Ragged batches mix whole prompts, chunked prefills (queries starting mid-sequence) and decode
rows; each is written through write_kv into blocks placed at random in caches poisoned with NaN,
and compared with SDPA (float64) per request on dense copies (test_attention.Batch). Padding entries of
the block tables are ids far past the cache (a read of one faults or reads NaN), and the columns
before a sliding window too. The kernel runs on the CPU under TRITON_INTERPRET=1 where triton is
usable (a child process, as in test_attention), and on CUDA (marker gpu): every kvcached layout,
padded lanes, no device-to-host sync in a step, and a CUDA graph replayed on another batch.
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_attention import (
    GARBAGE,
    LAYOUTS,
    Batch,
    _triton_interpreter_usable,
    assert_close,
    cache_shape,
    make_plain_batch,
    plain_caches,
    read_columns,
)

from kvcached import KVCacheManager, alloc_kv_cache, init_kvcached
from kvcached.checks import KV_LAYOUTS
from kvcached.ops import paged_attention, write_kv
from kvcached.ops._args import cache_geometry

# (block_size, head_dim, kv_heads, group, window): GQA groups 1-8 and an odd 3, head dims from 16
# to 256 with non-powers of 2, block sizes 16-128 and an odd 24, windows shorter and longer than
# a block.
PREFILL_SPECS = [(16, 64, 2, 4, None), (24, 80, 1, 8, 17), (32, 256, 2, 1, None), (128, 48, 2, 2, 40),
                 (16, 128, 1, 3, 5), (32, 16, 4, 1, 1), (24, 96, 2, 2, None), (16, 32, 1, 8, 70)]


def ragged_lengths(rng: random.Random, block_size: int, requests: int, longest: int) -> tuple[list, list]:
    """seq_lens and q_lens of a mixed batch: whole prompts, chunks and decode rows, in any order."""
    seq_lens, q_lens = [], []
    for kind in rng.sample(["prompt", "chunk", "decode"] * 2, requests):
        seq_len = rng.randint(1, longest)
        q_len = {"prompt": seq_len, "decode": 1}.get(kind) or rng.randint(1, seq_len)
        seq_lens.append(seq_len)
        q_lens.append(q_len)
    if all(n == 1 for n in q_lens):           # a mixed batch has at least one row with several queries
        q_lens[0] = seq_lens[0] = max(2, seq_lens[0])
    return seq_lens, q_lens


def _prefill_cases() -> list[dict]:
    cases = []
    for i, (bs, d, kvh, group, window) in enumerate(PREFILL_SPECS):
        rng = random.Random(i)
        for kv_layout in KV_LAYOUTS:
            seq_lens, q_lens = ragged_lengths(rng, bs, 3 + i % 3, min(3 * bs + 5, 150))
            cases.append(dict(block_size=bs, head_dim=d, kv_heads=kvh, heads=kvh * group, seq_lens=seq_lens,
                              q_lens=q_lens, window=window, kv_layout=kv_layout, seed=i))
    return cases


PREFILL_CASES = _prefill_cases()


def poison_before_the_window(case: dict, batch: Batch) -> None:
    """Columns wholly before what a request reads point far past the cache: an engine may have
    released those blocks."""
    for r in range(len(case["seq_lens"])):
        batch.block_tables[r, :read_columns(case, r).start] = GARBAGE


def run_prefill_case(case: dict, device: str, dtype: torch.dtype, tiles=None, *, int64: bool = False,
                     strided_query: bool = False) -> None:
    """The kernel itself (tiles forced or default) against SDPA per request; ``int64`` index
    tensors instead of int32, ``strided_query`` a transposed view as HF hands it over."""
    from kvcached.ops.triton_prefill import paged_prefill_triton

    k_cache, v_cache, batch = make_plain_batch(case, dtype=dtype, device=device)
    poison_before_the_window(case, batch)
    geometry = cache_geometry(k_cache, v_cache, case["kv_layout"])
    index = [batch.block_tables, batch.seq_lens, batch.query_start_loc]
    if int64:
        index = [t.long() for t in index]
    query = batch.query.transpose(0, 1).contiguous().transpose(0, 1) if strided_query else batch.query
    out = paged_prefill_triton(query, k_cache, v_cache, *index, batch.scale, case["window"], geometry, tiles=tiles)
    assert out.shape == batch.query.shape
    assert_close(out, batch.expected(case["window"]), 1e-5 if dtype == torch.float32 else 2e-2)


def small_tiles():
    """Tiles of 16 rows and 16 tokens: several q-tiles per request, and every loop of the kernel
    (window head, unmasked middle, diagonal tail) runs even on short sequences."""
    from kvcached.ops.triton_prefill import Tiles

    return Tiles(block_m=16, block_n=16, num_warps=4, num_stages=2)


# -- under the interpreter -------------------------------------------------------------------------

@pytest.mark.skipif(_triton_interpreter_usable() is not None, reason=str(_triton_interpreter_usable()))
def test_prefill_kernel_under_the_interpreter():
    """Every case with the default tiles or small ones (most with both, some with int64 index
    tensors or a strided query), fp32, on the CPU by Triton's interpreter in a child process
    (TRITON_INTERPRET is read when the kernels are defined)."""
    script = textwrap.dedent("""
        import sys, torch
        sys.path[:0] = {paths!r}
        import test_triton_prefill as t
        for i, case in enumerate(t.PREFILL_CASES):
            t.run_prefill_case(case, "cpu", torch.float32, t.small_tiles() if i % 2 else None)
            if case["heads"] // case["kv_heads"] <= 4 and case["head_dim"] <= 128:
                t.run_prefill_case(case, "cpu", torch.float32, t.small_tiles() if i % 2 == 0 else None,
                                   int64=i % 3 == 0, strided_query=i % 3 == 1)
        print("interpreted ok")
    """).format(paths=[str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])])
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "interpreted ok" in done.stdout, done.stderr[-4000:]


def _sm90_compiler() -> str | None:
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.backends.nvidia") is None:
        return "triton with its NVIDIA backend is not installed"
    return None


@pytest.mark.skipif(_sm90_compiler() is not None, reason=str(_sm90_compiler()))
@pytest.mark.parametrize("dtype, head_dim, group, window", [("bf16", 128, 4, True), ("fp16", 80, 3, False),
                                                             ("bf16", 256, 8, False), ("fp32", 256, 2, True)])
def test_prefill_kernel_compiles_for_sm90_pipelined(dtype, head_dim, group, window):
    """No GPU needed: the kernel compiles for an H100/H200 with the default tiles (the
    interpreter does not run Triton's compiler), its K/V loads are asynchronous copies (the
    pipeline; See Note [Prefill kernel shape], Alignment), and it fits in shared memory."""
    import triton

    from kvcached.ops.triton_prefill import _prefill_kernel, default_tiles

    tiles = default_tiles(head_dim, 4 if dtype == "fp32" else 2, group)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    constants = dict(GROUP=group, BLOCK_M=tiles.block_m, BLOCK_Q=tiles.block_m // group, HEAD_DIM=head_dim,
                     D_PAD=d_pad, EVEN_D=d_pad == head_dim, BLOCK_SIZE=16, BLOCK_N=tiles.block_n, USE_WINDOW=window,
                     DOT_PRECISION="ieee" if dtype == "fp32" else "tf32")
    kernel = compile_for_sm90(_prefill_kernel, dtype, constants, tiles.num_warps, tiles.num_stages)
    assert "cp.async" in kernel.asm["ptx"], "K/V loads are not asynchronous copies: the loop is not pipelined"
    assert kernel.metadata.shared <= 227 * 1024


@pytest.mark.skipif(_sm90_compiler() is not None, reason=str(_sm90_compiler()))
@pytest.mark.parametrize("stages", [3, 2])
@pytest.mark.parametrize("aligned", [True, False])
def test_decode_kernel_compiles_for_sm90_pipelined_when_aligned(aligned, stages):
    """The decode kernel too, at either pipeline depth (Note [Pipeline stages]): with ALIGNED its
    loads are asynchronous copies; without, they are not (which is why the launcher passes it).
    See Note [Cache base address]."""
    from kvcached.ops.triton_decode import _decode_kernel

    constants = dict(KV_HEADS=8, GROUP=4, Q_ROWS=16, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_N=64, NUM_SPLITS=1,
                     USE_WINDOW=False, DOT_PRECISION="tf32")
    kernel = compile_for_sm90(_decode_kernel, "bf16", constants, 4, stages, aligned=aligned)
    assert ("cp.async" in kernel.asm["ptx"]) == aligned


def compile_for_sm90(kernel, dtype: str, constants: dict, num_warps: int, num_stages: int, aligned: bool = True):
    """Compile ``kernel`` for sm_90 as a launch would: unit dim strides, every other integer and
    pointer argument 16-divisible (Triton's specialisation) but the float scale and those the
    kernel marks do_not_specialize (Note [One compile per model])."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constants = dict(constants, ALIGNED=aligned, sq_dim=1, sk_dim=1, sv_dim=1, so_dim=1,
                     CACHE_DTYPE={"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}[dtype])
    pointers = {"q_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "table_ptr": "*i32", "seq_lens_ptr": "*i32",
                "starts_ptr": "*i32", "m_part_ptr": "*fp32", "l_part_ptr": "*fp32", "o_part_ptr": "*fp32"}
    scalars = {"k_addr": "i64", "v_addr": "i64", "scale_log2": "fp32"}
    unspecialised = {"scale_log2"} | {param.name for param in kernel.params if param.do_not_specialize}
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        signature[name] = pointers.get(name) or scalars.get(name, "i32")
        if name not in unspecialised:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


# -- the geometry memo (any device) ----------------------------------------------------------------

def test_geometry_is_checked_once_per_shape_and_bad_input_still_raises():
    k_cache, v_cache = plain_caches(4, 16, 2, 64, "NHD")
    first = cache_geometry(k_cache, v_cache, "NHD")
    other_k, other_v = plain_caches(4, 16, 2, 64, "NHD")
    assert cache_geometry(other_k, other_v, "NHD") is first          # same shapes: the memo's entry
    assert cache_geometry(k_cache, v_cache, "HND") is not first
    assert cache_geometry(k_cache, v_cache, "HND").block_size == 2   # HND reads dim 2 as block_size
    with pytest.raises(ValueError, match="must match"):
        cache_geometry(k_cache, v_cache.half(), "NHD")
    with pytest.raises(ValueError, match="must match"):
        cache_geometry(k_cache, v_cache[:, :8], "NHD")
    with pytest.raises(ValueError, match="kv_layout='nhd'"):
        cache_geometry(k_cache, v_cache, "nhd")
    with pytest.raises(TypeError, match="floating dtype"):
        cache_geometry(k_cache.int(), v_cache.int(), "NHD")
    strided = k_cache.transpose(1, 2).contiguous().transpose(1, 2)
    assert cache_geometry(strided, strided, "NHD").k_strides == (2048, 64, 1024, 1)   # its own entry


# -- on CUDA ---------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not usable here")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype, small", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)],
                         ids=["fp32", "bf16", "bf16-small-tiles"])
@pytest.mark.parametrize("case", PREFILL_CASES,
                         ids=lambda c: f"bs{c['block_size']}-d{c['head_dim']}-g{c['heads'] // c['kv_heads']}-"
                                       f"w{c['window']}-{c['kv_layout']}")
def test_prefill_kernel_on_cuda(case, dtype, small):
    run_prefill_case(case, "cuda", dtype, small_tiles() if small else None, int64=small, strided_query=small)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
@pytest.mark.parametrize("window", [None, 300])
def test_paged_attention_mixed_batch_on_cuda(kv_layout, window):
    """The dispatch: a mixed batch of Llama-3-8B heads (a 512-token chunk, a whole prompt, decode
    rows) through paged_attention on CUDA, bf16, against SDPA per request."""
    rng = random.Random(7)
    seq_lens = [700, 513, *(rng.randint(1, 600) for _ in range(20))]
    q_lens = [512, 513, *([1] * 20)]
    case = dict(block_size=16, head_dim=128, kv_heads=8, heads=32, seq_lens=seq_lens, q_lens=q_lens,
                window=window, kv_layout=kv_layout, seed=3)
    k_cache, v_cache, batch = make_plain_batch(case, dtype=torch.bfloat16, device="cuda")
    poison_before_the_window(case, batch)
    out = paged_attention(batch.query, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                          batch.scale, sliding_window=window, kv_layout=kv_layout)
    assert_close(out, batch.expected(window), 2e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("num_decodes", [0, 7, 20])
def test_decode_rows_first_through_the_decode_kernel_on_cuda(kv_layout, window, num_decodes):
    """A continuous-batching step's order (decode rows, then a chunk and a prompt) with the decode
    rows, or a prefix of them, named by num_decodes: those go through the decode kernel, the rest
    through the prefill kernel with its starts offset, into one output; against SDPA."""
    rng = random.Random(11)
    seq_lens = [*(rng.randint(1, 600) for _ in range(20)), 700, 513]
    q_lens = [*([1] * 20), 512, 513]
    case = dict(block_size=16, head_dim=128, kv_heads=8, heads=32, seq_lens=seq_lens, q_lens=q_lens,
                window=window, kv_layout=kv_layout, seed=5)
    k_cache, v_cache, batch = make_plain_batch(case, dtype=torch.bfloat16, device="cuda")
    poison_before_the_window(case, batch)
    out = paged_attention(batch.query, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                          batch.scale, sliding_window=window, kv_layout=kv_layout, num_decodes=num_decodes)
    assert_close(out, batch.expected(window), 2e-2)


def compiled_variants() -> dict[str, int]:
    """How many compiled variants each kvcached kernel holds (Triton's per-device caches)."""
    from kvcached.ops import triton_decode, triton_prefill, triton_write

    kernels = {"decode": triton_decode._decode_kernel, "combine": triton_decode._combine_kernel,
               "prefill": triton_prefill._prefill_kernel, "write": triton_write._write_kernel}
    return {name: sum(len(caches[0]) for caches in kernel.device_caches.values()) for name, kernel in kernels.items()}


@pytest.mark.gpu
@gpu
def test_one_compile_whatever_the_metadata_alignment_on_cuda():
    """A serving loop packs a step's metadata into one int64 tensor and a mixed step slices it
    past its decode rows, so the pointers' 16-byte alignment changes from step to step; no kernel
    compiles again for that (Note [One compile per model]). Before, the end-to-end run stalled
    1.2-1.4 s on each new alignment class of the prefill kernel."""
    rng = random.Random(13)
    seq_lens = [*(rng.randint(1, 600) for _ in range(21)), 700, 513]
    q_lens = [*([1] * 21), 512, 513]
    case = dict(block_size=16, head_dim=128, kv_heads=8, heads=32, seq_lens=seq_lens, q_lens=q_lens,
                window=None, kv_layout="NHD", seed=9)
    k_cache, v_cache, batch = make_plain_batch(case, dtype=torch.bfloat16, device="cuda")
    key = torch.randn(4, 8, 128, dtype=torch.bfloat16, device="cuda")
    expected, before = {}, None
    for offset in range(4):
        for num_decodes in (20, 21):                    # the prefill kernel's slices at odd and even rows
            fields = [batch.block_tables.flatten(), batch.seq_lens, batch.query_start_loc]
            flat = torch.cat([torch.zeros(offset, dtype=torch.int64, device="cuda"),
                              *(field.to(torch.int64) for field in fields)])
            tables, lens, starts = flat[offset:].split([field.numel() for field in fields])
            out = paged_attention(batch.query, k_cache, v_cache, tables.view(batch.block_tables.shape), lens, starts,
                                  batch.scale, num_decodes=num_decodes)
            slots = torch.full((5,), -1, dtype=torch.int64, device="cuda")[offset % 2:][:4]     # writes nothing
            write_kv(key, key, k_cache, v_cache, slots)
            assert torch.equal(out, expected.setdefault(num_decodes, out))
            before = before or compiled_variants()
            assert compiled_variants() == before, f"a kernel compiled again at offset {offset}, {num_decodes} decodes"


@pytest.mark.gpu
@gpu
def test_the_decode_kernel_compiles_once_per_split_count_on_cuda():
    """The decode kernel's split count is a constexpr that follows the number of decode rows (a
    mixed step's are any number); it is a power of two, so 1 to 48 decode rows over a loop's table
    of 8,192 tokens give at most five split counts and compile at most one variant of the combine
    per count, and of the decode kernel one per count and pipeline depth (Note [One compile per
    model], Note [Pipeline stages]). Before, those rows gave ten split counts."""
    from kvcached.ops import triton_decode

    rows_max, width = 48, 512
    case = dict(block_size=16, head_dim=128, kv_heads=8, heads=32, seq_lens=[300] * rows_max,
                q_lens=[1] * rows_max, window=None, kv_layout="NHD", seed=3)
    k_cache, v_cache, batch = make_plain_batch(case, dtype=torch.bfloat16, device="cuda")
    tables = torch.nn.functional.pad(batch.block_tables, (0, width - batch.block_tables.shape[1]))
    splits = {triton_decode._num_splits(rows, 8, width * 16, torch.device("cuda")) for rows in range(1, rows_max + 1)}
    assert all(s & (s - 1) == 0 for s in splits) and len(splits) <= 5, splits
    before = compiled_variants()
    for rows in range(1, rows_max + 1):
        paged_attention(batch.query[:rows], k_cache, v_cache, tables[:rows], batch.seq_lens[:rows],
                        batch.query_start_loc[:rows + 1], batch.scale, num_decodes=rows)
    after = compiled_variants()
    depths = len(triton_decode.PIPELINE_STAGES)
    assert after["decode"] - before["decode"] <= depths * len(splits)
    assert after["combine"] - before["combine"] <= len(splits)


def with_padding_request(batch: Batch, null_block: int) -> dict:
    """The batch's arguments with one more request, as a CUDA-graph padded step has: one query
    over one token of a block that holds nothing of it (the null block), table padded past it."""
    device = batch.query.device
    row = torch.full((1, batch.block_tables.shape[1]), GARBAGE, dtype=batch.block_tables.dtype, device=device)
    row[0, 0] = null_block
    total = batch.query.shape[0]
    return dict(query=torch.cat([batch.query, torch.randn_like(batch.query[:1])]),
                block_tables=torch.cat([batch.block_tables, row]),
                seq_lens=torch.cat([batch.seq_lens, batch.seq_lens.new_ones(1)]),
                query_start_loc=torch.cat([batch.query_start_loc, batch.query_start_loc.new_tensor([total + 1])]))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefill_every_layout_through_kvcached_on_cuda(kv_env, layout, kv_layout):
    """VMM-mapped tensors, zero page off, no pool: the kernel touches only mapped pages (an access
    to an unmapped one is an illegal-address error). Blocks allocated but outside the tables hold
    NaN; a padding request reads a null block (allocated, never written: NaN) and only its own
    row may show it."""
    from kvcached.core import cuda_unavailable_reason

    if cuda_unavailable_reason() is not None:
        pytest.skip(cuda_unavailable_reason())
    kv_env(LAYOUT=layout, ZERO_PAGE=0, MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=0)
    init_kvcached(device="cuda:0")
    block_size, kv_heads, head_dim, heads, num_layers, num_blocks = 16, 8, 128, 32, 3, 4096
    shape = (2, num_blocks, *cache_shape(1, block_size, kv_heads, head_dim, kv_layout)[1:])
    kv = alloc_kv_cache(shape, block_size, torch.bfloat16, "cuda:0", num_layers, kv_layout=kv_layout)
    manager = KVCacheManager(num_blocks, block_size, kv_heads * head_dim * 2, num_layers)
    seq_lens, q_lens = [600, 1, 300, 47, 129], [100, 1, 300, 1, 64]
    ids = manager.alloc(sum(-(-n // block_size) for n in seq_lens) + 8)
    null_block = manager.alloc(1)[0]
    for layer in range(num_layers):
        for buffer in (0, 1):
            kv[layer][buffer][ids + [null_block]] = float("nan")
    for layer in range(num_layers):
        window = None if layer == 0 else 50 * layer
        case = dict(block_size=block_size, seq_lens=seq_lens, q_lens=q_lens, window=window)
        batch = Batch(kv[layer][0], kv[layer][1], kv_layout, ids, seq_lens, q_lens, heads, seed=layer)
        poison_before_the_window(case, batch)
        args = with_padding_request(batch, null_block)
        out = paged_attention(args["query"], kv[layer][0], kv[layer][1], args["block_tables"], args["seq_lens"],
                              args["query_start_loc"], batch.scale, sliding_window=window, kv_layout=kv_layout)
        torch.cuda.synchronize()
        assert_close(out[:-1], batch.expected(window), 2e-2)
    manager.free(ids + [null_block])


def mixed_lengths(seed: int, decode_rows: int = 64, chunk: int = 512) -> tuple[list, list]:
    """A serving step's seq_lens and q_lens: decode rows over ~512 tokens and one prompt chunk."""
    rng = random.Random(seed)
    return [rng.randint(400, 600) for _ in range(decode_rows)] + [chunk + 200], [1] * decode_rows + [chunk]


def mixed_step(seed: int) -> tuple:
    """Plain bf16 caches holding a mixed step's batch, Llama-3-8B heads, block size 16."""
    seq_lens, q_lens = mixed_lengths(seed)
    case = dict(block_size=16, head_dim=128, kv_heads=8, heads=32, seq_lens=seq_lens, q_lens=q_lens, window=None,
                kv_layout="NHD", seed=seed)
    return make_plain_batch(case, dtype=torch.bfloat16, device="cuda")


@pytest.mark.gpu
@gpu
def test_mixed_step_does_not_sync_on_cuda():
    """write_kv and paged_attention of a mixed step read nothing back to the host: under
    torch's sync debug mode "error" any device-to-host sync would raise. (The first call, which
    compiles the kernels, runs before.)"""
    k_cache, v_cache, batch = mixed_step(seed=1)
    tokens = batch.query.shape[0]
    key = torch.randn(tokens, 8, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.full((tokens,), -1, dtype=torch.int64, device="cuda")    # a no-op write of the same shape
    args = (batch.query, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.scale)
    write_kv(key, key, k_cache, v_cache, slots)
    expected = paged_attention(*args)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        write_kv(key, key, k_cache, v_cache, slots)
        out = paged_attention(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    assert_close(out, batch.expected(None), 2e-2)


@pytest.mark.gpu
@gpu
def test_mixed_step_replays_in_a_cuda_graph():
    """A step captured once replays on another batch of the same shapes (other query starts,
    lengths, tables and queries copied into the captured tensors): the grid depends on shapes
    only and nothing is read on the host. Replay equals eager, and the reference."""
    first_lens, first_q = mixed_lengths(seed=2)
    seq_lens = [n + 37 for n in first_lens[:-1]] + [first_lens[-1] - 100]
    q_lens = [1] * 30 + [2] + [1] * 33 + [first_q[-1] - 1]
    assert sum(q_lens) == sum(first_q) and len(q_lens) == len(first_q)
    # Both batches in one pair of caches, on blocks of their own.
    need = [sum(-(-n // 16) for n in lens) for lens in (first_lens, seq_lens)]
    k_cache, v_cache = plain_caches(sum(need) + 4, 16, 8, 128, "NHD", torch.bfloat16, "cuda")
    first = Batch(k_cache, v_cache, "NHD", list(range(need[0])), first_lens, first_q, 32, seed=2)
    second = Batch(k_cache, v_cache, "NHD", list(range(need[0], sum(need))), seq_lens, q_lens, 32, seed=3)
    width = max(first.block_tables.shape[1], second.block_tables.shape[1])
    tables = torch.full((len(q_lens), width), GARBAGE, dtype=torch.int32, device="cuda")
    tables[:, :first.block_tables.shape[1]] = first.block_tables
    static = dict(query=first.query.clone(), block_tables=tables, seq_lens=first.seq_lens.clone(),
                  query_start_loc=first.query_start_loc.clone())

    def step() -> torch.Tensor:
        return paged_attention(static["query"], k_cache, v_cache, static["block_tables"], static["seq_lens"],
                               static["query_start_loc"], first.scale)

    eager_first = step()                                    # also compiles the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_first)
    static["query"].copy_(second.query)
    static["block_tables"].fill_(GARBAGE)
    static["block_tables"][:, :second.block_tables.shape[1]] = second.block_tables
    static["seq_lens"].copy_(second.seq_lens)
    static["query_start_loc"].copy_(second.query_start_loc)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, step())
    assert_close(out, second.expected(None), 2e-2)
