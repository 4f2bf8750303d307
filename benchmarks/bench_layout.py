"""Decode attention over kvcached memory in each layout against a plain torch.empty cache.

    python benchmarks/bench_layout.py [--device cuda|cpu] [--quick] [--out PATH]
                                      [--layers 32 80] [--seqs 100 500] [--tokens 1024] [--commit SHA]

For each model depth (layers) and batch (sequences x tokens), and each cache (per_layer,
interleaved, page_grouped over VMM-mapped memory; plain = one torch.empty tensor per layer, as an
engine allocates), it prints:
  - create ms: alloc_kv_cache (reserve the ranges, build the views), or the torch.empty calls;
  - map: KVCacheManager.alloc of every block with no pool (maps every page id), per page id;
    unmap: the free of them all (unmaps every page id);
  - step ms: one decode step = kvcached.ops.paged_decode over every layer (Triton kernel on CUDA,
    torch on CPU), blocks placed at random in the tables; on CUDA timed as a CUDA graph replay
    (kernel time) and eagerly (Python and launch overhead included);
  - read GB/s: bytes of K and V read per step / step time (graph), and that as a share of the
    device copy bandwidth (bytes read + written by a large device-to-device copy / its time);
  - vs plain: step time relative to the plain cache of the same shape.
Model: 8 KV heads x 128, 32 query heads (GQA 4), bf16, block_size 16 (--device cpu --quick: 2 KV
heads x 64, fp32, tiny sizes, for CI). Configurations that do not fit in free device memory are
listed as skipped. A benchmark, never a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402  (after the path insert)

from kvcached import (  # noqa: E402
    KVCacheManager,
    alloc_kv_cache,
    config,
    init_kvcached,
    shutdown_kvcached,
)
from kvcached.ops import paged_decode  # noqa: E402

LAYOUTS = ("per_layer", "interleaved", "page_grouped")
GB = 1e9
BLOCK_SIZE = 16


class Model:
    """The attention shape of the benchmark model."""

    def __init__(self, device: str):
        if device == "cuda":
            self.kv_heads, self.head_dim, self.heads, self.dtype = 8, 128, 32, torch.bfloat16
        else:
            self.kv_heads, self.head_dim, self.heads, self.dtype = 2, 64, 8, torch.float32
        self.cell_bytes = self.kv_heads * self.head_dim * self.dtype.itemsize

    def kv_bytes(self, layers: int, seqs: int, tokens: int) -> int:
        """Bytes of K and V one decode step reads."""
        return layers * seqs * tokens * 2 * self.cell_bytes


# -- timing ------------------------------------------------------------------------------------------

def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_calls(fn, device: str, reps: int) -> float:
    """Median seconds of one call of fn over `reps` calls (CUDA events on the GPU)."""
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: str, quick: bool) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    nbytes = (64 << 20) if device == "cpu" else (1 << 30) if quick else (4 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    return 2 * nbytes / time_calls(lambda: dst.copy_(src), device, 5 if quick else 20)


# -- one cache ---------------------------------------------------------------------------------------

class Cache:
    """One model's KV: kvcached in a layout (alloc_kv_cache + a manager holding every block) or plain."""

    def __init__(self, kind: str, device: str, model: Model, layers: int, num_blocks: int):
        self.kind, self.device = kind, device
        shape = (2, num_blocks, BLOCK_SIZE, model.kv_heads, model.head_dim)
        dev = "cuda:0" if device == "cuda" else "cpu"
        self.manager = None
        self.map_s = self.unmap_s = None
        self.num_pages = None
        if kind == "plain":
            t0 = time.perf_counter()
            self.kv = [torch.empty(shape, dtype=model.dtype, device=dev) for _ in range(layers)]
            sync(device)
            self.create_ms = (time.perf_counter() - t0) * 1e3
            self.block_ids = list(range(num_blocks))
            return
        shutdown_kvcached()
        os.environ.update(KVCACHED_LAYOUT=kind, KVCACHED_ZERO_PAGE="0", KVCACHED_MIN_RESERVED_PAGES="0",
                          KVCACHED_MAX_RESERVED_PAGES="0", KVCACHED_TRACKER="0", KVCACHED_IDLE_TRIM_S="0")
        config.reload_settings()
        init_kvcached(device=dev)
        t0 = time.perf_counter()
        self.kv = alloc_kv_cache(shape, BLOCK_SIZE, model.dtype, dev, layers)
        self.create_ms = (time.perf_counter() - t0) * 1e3
        self.manager = KVCacheManager(num_blocks, BLOCK_SIZE, model.cell_bytes, layers)
        self.num_pages = self.manager.num_pages
        t0 = time.perf_counter()
        self.block_ids = self.manager.alloc(num_blocks)
        self.map_s = time.perf_counter() - t0
        if self.block_ids is None:
            raise RuntimeError(f"{kind}: could not allocate {num_blocks} blocks")

    def close(self) -> None:
        if self.manager is not None:
            t0 = time.perf_counter()
            self.manager.free(self.block_ids)
            self.unmap_s = time.perf_counter() - t0
            self.manager.close()
        self.kv = None
        if self.kind != "plain":
            shutdown_kvcached()
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()


def decode_step(cache: Cache, query, tables, lens, scale):
    def step():
        return [paged_decode(query, layer[0], layer[1], tables, lens, scale) for layer in cache.kv]
    return step


def measure(kind: str, device: str, model: Model, layers: int, seqs: int, tokens: int, reps: int,
            seed: int) -> dict:
    blocks_per_seq = -(-tokens // BLOCK_SIZE)
    num_blocks = seqs * blocks_per_seq
    cache = Cache(kind, device, model, layers, num_blocks)
    try:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.tensor(cache.block_ids, dtype=torch.int32)
        tables = ids[torch.randperm(num_blocks, generator=gen)].view(seqs, blocks_per_seq).to(cache.kv[0].device)
        lens = torch.full((seqs,), tokens, dtype=torch.int32, device=tables.device)
        query = torch.randn(seqs, model.heads, model.head_dim, generator=gen).to(model.dtype).to(tables.device)
        step = decode_step(cache, query, tables, lens, model.head_dim ** -0.5)
        step()                                   # compile / warm up
        sync(device)
        eager_s = time_calls(step, device, reps)
        graph_s = None
        if device == "cuda":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            graph.replay()
            sync(device)
            graph_s = time_calls(graph.replay, device, reps)
            del graph
        row = dict(cache=kind, layers=layers, seqs=seqs, tokens=tokens,
                   kv_gb=float(f"{model.kv_bytes(layers, seqs, tokens) / GB:.3g}"),
                   create_ms=round(cache.create_ms, 2), step_ms_eager=round(eager_s * 1e3, 3),
                   step_ms=round((graph_s or eager_s) * 1e3, 3),
                   read_gbps=float(f"{model.kv_bytes(layers, seqs, tokens) / (graph_s or eager_s) / GB:.4g}"),
                   pages=cache.num_pages)
    finally:
        cache.close()
    if cache.map_s is not None:
        row.update(map_s=round(cache.map_s, 4), unmap_s=round(cache.unmap_s, 4),
                   map_us_per_page_id=round(cache.map_s / cache.num_pages * 1e6, 1),
                   unmap_us_per_page_id=round(cache.unmap_s / cache.num_pages * 1e6, 1))
    return row


# -- report ------------------------------------------------------------------------------------------

def commit_of(given: str | None) -> str:
    if given:
        return given
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def meta_for(device: str, commit: str, argv: list[str]) -> dict:
    meta = dict(date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), commit=commit,
                command="python benchmarks/bench_layout.py " + " ".join(argv), device=device,
                torch=torch.__version__, python=platform.python_version(), host=platform.node())
    if device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(0)
        try:
            import triton

            meta["triton"] = triton.__version__
        except ImportError:
            meta["triton"] = None
    return meta


def print_table(rows: list[dict], copy_gbps: float) -> None:
    head = ["layers", "seqs", "cache", "KV GB", "create ms", "map µs/page id", "unmap µs/page id", "step ms",
            "eager ms", "read GB/s", "% of copy", "vs plain"]
    lines = [head]
    for r in rows:
        if "skipped" in r:
            lines.append([str(r["layers"]), str(r["seqs"]), r["cache"], f"{r['kv_gb']}", "skipped: " + r["skipped"]]
                         + [""] * (len(head) - 5))
            continue
        lines.append([str(r["layers"]), str(r["seqs"]), r["cache"], f"{r['kv_gb']}", f"{r['create_ms']}",
                      str(r.get("map_us_per_page_id", "-")), str(r.get("unmap_us_per_page_id", "-")),
                      f"{r['step_ms']}", f"{r['step_ms_eager']}", f"{r['read_gbps']}",
                      f"{r['pct_of_copy']}%", f"{r['vs_plain_pct']:+.1f}%" if r.get("vs_plain_pct") is not None else "-"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for i, line in enumerate(lines):
        print("  " + "  ".join(cell.rjust(w) for cell, w in zip(line, widths)))
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))
    print(f"  copy bandwidth (read + write): {copy_gbps:.0f} GB/s")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=("cpu", "cuda"), default=default_device)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions (smoke run)")
    parser.add_argument("--out", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--layers", type=int, nargs="+", help="model depths (default 32 80; quick 2)")
    parser.add_argument("--seqs", type=int, nargs="+", help="sequences per batch (default 100 500; quick 4)")
    parser.add_argument("--tokens", type=int, help="tokens per sequence (default 1024; quick 64)")
    parser.add_argument("--caches", nargs="+", choices=(*LAYOUTS, "plain"), default=[*LAYOUTS, "plain"])
    parser.add_argument("--reps", type=int, help="timed steps per case (default 20; quick 3)")
    parser.add_argument("--commit", help="the commit measured (default: git rev-parse)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    small = args.quick and args.device == "cpu"
    layers_list = args.layers or ([2] if small else [32, 80])
    seqs_list = args.seqs or ([4] if small else [100, 500])
    tokens = args.tokens or (64 if small else 1024)
    reps = args.reps or (3 if args.quick else 20)
    model = Model(args.device)
    meta = meta_for(args.device, commit_of(args.commit), argv)
    print(f"kvcached bench_layout: {meta.get('gpu', args.device)}, {meta['date']}, commit {meta['commit']}")
    print(f"  model: {model.kv_heads} KV heads x {model.head_dim}, {model.heads} query heads, {model.dtype}, "
          f"block_size {BLOCK_SIZE}; {tokens} tokens per sequence, blocks at random")
    copy_gbps = copy_bandwidth(args.device, args.quick) / GB
    rows = []
    for layers in layers_list:
        for seqs in seqs_list:
            need = model.kv_bytes(layers, seqs, tokens)
            free = torch.cuda.mem_get_info()[0] if args.device == "cuda" else None
            plain_ms = None
            for kind in args.caches:
                if free is not None and need > free - (2 << 30):
                    rows.append(dict(cache=kind, layers=layers, seqs=seqs, tokens=tokens, kv_gb=float(f"{need / GB:.3g}"),
                                     skipped=f"needs {need / GB:.0f} GB, {free / GB:.0f} GB free"))
                    continue
                row = measure(kind, args.device, model, layers, seqs, tokens, reps, seed=layers * 1000 + seqs)
                row["pct_of_copy"] = float(f"{100 * row['read_gbps'] / copy_gbps:.3g}")
                rows.append(row)
                if kind == "plain":
                    plain_ms = row["step_ms"]
            for row in rows:
                if row["layers"] == layers and row["seqs"] == seqs and "skipped" not in row and plain_ms:
                    row["vs_plain_pct"] = round(100 * (row["step_ms"] / plain_ms - 1), 2)
    print_table(rows, copy_gbps)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(meta=meta, copy_gbps=round(copy_gbps, 1), rows=rows), indent=1))
        print(f"  written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
