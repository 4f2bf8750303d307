"""Paged attention on CUDA: the Triton prefill kernel against SDPA's flash backend and against the
per-request torch path it replaces.

    python benchmarks/bench_attention.py [--quick] [--json PATH] [--reps 50] [--commit SHA]
                                         [--batch 8] [--prompt 2048] [--decode-rows 64] [--chunk 512]

Model: Llama-3-8B attention, 32 query heads, 8 KV heads x 128, bf16, block_size 16, one layer's
caches as plain CUDA tensors with every request's blocks at random places.
  (a) prefill: --batch prompts of --prompt tokens each, their K/V already in the cache.
      paged = kvcached.ops.paged_attention (one launch of the prefill kernel, through the block
      tables); sdpa = torch.nn.functional.scaled_dot_product_attention, causal, restricted to
      the flash backend, on the same data in dense [batch, heads, tokens, dim] tensors (K/V
      repeated over the GQA group beforehand, outside the timing). ratio = paged / sdpa: the
      goal is <= 1.3. TFLOP/s counts 4 * D FLOP per (query, visible key, head).
  (b) mixed step: --decode-rows decode rows of ~512 cached tokens each plus one --chunk-token
      chunk of a prompt whose first --chunk tokens are cached. paged = paged_attention (one
      launch); per-request torch = the path every non-decode batch took before the kernel
      (query_start_loc read on the host, then per request a gather and SDPA).
Times are medians over --reps calls after warm-up, by CUDA events around each call (eager: the
launch's Python overhead included). "max |diff|" compares the two outputs of each row, a sanity
check. A benchmark, never a test: nothing here asserts a time. Needs CUDA and triton.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402  (after the path insert)
import torch.nn.functional as F  # noqa: E402

from kvcached.ops import paged_attention  # noqa: E402

from bench_layout import commit_of  # noqa: E402

BLOCK_SIZE, KV_HEADS, HEADS, HEAD_DIM, DTYPE = 16, 8, 32, 128, torch.bfloat16


def time_calls(fn, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of one call of fn over `reps` calls, CUDA events, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class PagedBatch:
    """One layer's K/V caches holding requests of the given lengths on blocks at random, their
    block tables, and queries for the last q_len positions of each."""

    def __init__(self, seq_lens: list[int], q_lens: list[int], seed: int):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        per_request = [-(-n // BLOCK_SIZE) for n in seq_lens]
        num_blocks = sum(per_request)
        shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.k_cache = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
        self.v_cache = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
        order = torch.randperm(num_blocks, generator=gen, device="cuda").int()
        self.block_tables = torch.zeros((len(seq_lens), max(per_request)), dtype=torch.int32, device="cuda")
        offset = 0
        for r, n in enumerate(per_request):
            self.block_tables[r, :n] = order[offset:offset + n]
            offset += n
        self.seq_lens_list, self.q_lens_list = seq_lens, q_lens
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32, device="cuda")
        self.query = torch.randn((starts[-1], HEADS, HEAD_DIM), generator=gen, device="cuda", dtype=DTYPE)
        self.scale = HEAD_DIM ** -0.5

    def paged(self) -> torch.Tensor:
        return paged_attention(self.query, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                               self.query_start_loc, self.scale)

    def per_request_torch(self) -> torch.Tensor:
        """The torch path (what paged_attention ran on CUDA for every non-decode batch before)."""
        from kvcached.ops._args import cache_geometry
        from kvcached.ops.attention import _prefill

        geometry = cache_geometry(self.k_cache, self.v_cache, "NHD")
        return _prefill(self.query, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                        self.query_start_loc.tolist(), self.scale, None, geometry, "NHD")

    def dense(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request r's K and V as [seq_len, KVH, D]."""
        n = self.seq_lens_list[r]
        ids = self.block_tables[r, :-(-n // BLOCK_SIZE)].long()
        return self.k_cache[ids].flatten(0, 1)[:n], self.v_cache[ids].flatten(0, 1)[:n]


def flops(seq_lens: list[int], q_lens: list[int]) -> float:
    """4 * D per (query, visible key, head) of causal attention."""
    pairs = sum(q * (n - q) + q * (q + 1) // 2 for n, q in zip(seq_lens, q_lens))
    return 4.0 * HEAD_DIM * HEADS * pairs


def bench_prefill(batch_size: int, prompt: int, reps: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch = PagedBatch([prompt] * batch_size, [prompt] * batch_size, seed=1)
    group = HEADS // KV_HEADS
    keys, values = zip(*(batch.dense(r) for r in range(batch_size)))
    # Dense [B, H, L, D] as SDPA takes them; K/V repeated over the group (flash reads them per head anyway).
    k = torch.stack(keys).transpose(1, 2).repeat_interleave(group, dim=1).contiguous()
    v = torch.stack(values).transpose(1, 2).repeat_interleave(group, dim=1).contiguous()
    q = batch.query.view(batch_size, prompt, HEADS, HEAD_DIM).transpose(1, 2)

    def sdpa() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=batch.scale)

    paged_ms, sdpa_ms = time_calls(batch.paged, reps), time_calls(sdpa, reps)
    diff = (batch.paged().float() - sdpa().transpose(1, 2).reshape_as(batch.query).float()).abs().max().item()
    work = flops(batch.seq_lens_list, batch.q_lens_list)
    return dict(case="prefill", batch=batch_size, prompt=prompt, paged_ms=round(paged_ms, 4),
                sdpa_flash_ms=round(sdpa_ms, 4), ratio=round(paged_ms / sdpa_ms, 3),
                paged_tflops=round(work / paged_ms / 1e9, 1), sdpa_tflops=round(work / sdpa_ms / 1e9, 1),
                max_abs_diff=float(f"{diff:.3g}"))


def bench_mixed(decode_rows: int, chunk: int, reps: int) -> dict:
    gen = torch.Generator().manual_seed(2)
    contexts = torch.randint(384, 641, (decode_rows,), generator=gen).tolist()
    batch = PagedBatch([*contexts, 2 * chunk], [1] * decode_rows + [chunk], seed=2)
    paged_ms = time_calls(batch.paged, reps)
    torch_ms = time_calls(batch.per_request_torch, max(3, reps // 5))
    diff = (batch.paged().float() - batch.per_request_torch().float()).abs().max().item()
    return dict(case="mixed step", decode_rows=decode_rows, chunk=chunk, paged_ms=round(paged_ms, 4),
                per_request_torch_ms=round(torch_ms, 4), speedup=round(torch_ms / paged_ms, 1),
                max_abs_diff=float(f"{diff:.3g}"))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions (smoke run)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--reps", type=int, help="timed calls per case (default 50; quick 5)")
    parser.add_argument("--batch", type=int, default=8, help="(a) prompts per batch")
    parser.add_argument("--prompt", type=int, default=2048, help="(a) tokens per prompt")
    parser.add_argument("--decode-rows", type=int, default=64, help="(b) decode rows of the mixed step")
    parser.add_argument("--chunk", type=int, default=512, help="(b) tokens of the mixed step's prompt chunk")
    parser.add_argument("--commit", help="the commit measured (default: git rev-parse)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention measures the Triton kernels on CUDA: torch sees no CUDA device here "
              "(the CPU runs the torch path, which this benchmark does not time)", file=sys.stderr)
        return 2
    try:
        import triton
    except ImportError:
        print("bench_attention needs triton (pip install triton): without it paged_attention runs the torch "
              "path", file=sys.stderr)
        return 2
    reps = args.reps or (5 if args.quick else 50)
    meta = dict(date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), commit=commit_of(args.commit),
                command="python benchmarks/bench_attention.py " + " ".join(argv), gpu=torch.cuda.get_device_name(0),
                torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                host=platform.node(), reps=reps)
    print(f"kvcached bench_attention: {meta['gpu']}, {meta['date']}, commit {meta['commit']}")
    print(f"  {HEADS} query heads, {KV_HEADS} KV heads x {HEAD_DIM}, {DTYPE}, block_size {BLOCK_SIZE}, "
          f"medians of {reps}")
    prefill = bench_prefill(args.batch, args.prompt, reps)
    print(f"  (a) prefill {args.batch} x {args.prompt}: paged {prefill['paged_ms']:.3f} ms "
          f"({prefill['paged_tflops']} TFLOP/s), SDPA flash {prefill['sdpa_flash_ms']:.3f} ms "
          f"({prefill['sdpa_tflops']} TFLOP/s), ratio {prefill['ratio']:.2f}, max |diff| {prefill['max_abs_diff']}")
    mixed = bench_mixed(args.decode_rows, args.chunk, reps)
    print(f"  (b) mixed step {args.decode_rows} decode rows + a {args.chunk}-token chunk: paged "
          f"{mixed['paged_ms']:.3f} ms, per-request torch {mixed['per_request_torch_ms']:.3f} ms "
          f"({mixed['speedup']}x), max |diff| {mixed['max_abs_diff']}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=[prefill, mixed]), indent=1))
        print(f"  written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
