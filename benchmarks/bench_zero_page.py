"""What the zero page (KVCACHED_ZERO_PAGE=1) costs: KV creation time and the map/unmap cost per
page id, per layout, with and without it.

    python benchmarks/bench_zero_page.py [--device cuda|cpu] [--layers 32] [--gib 16] [--repeats 3]

Without the zero page an unallocated row of a KV tensor has no memory behind it: reading it
faults (a segfault on the host backend, an illegal address on CUDA). With it every unmapped page
id shows one shared read-only page of zeros, which costs one extra mapping per segment of every
unmapped page id at creation, and makes map and unmap remaps. Model: 8 KV heads x 128, bf16 (fp32
on cpu), block_size 16; `--gib` is the virtual size of the group (K and V of every layer).
  - create ms: alloc_kv_cache + KVCacheManager (every zero-page mapping is made here);
  - map us/page: alloc of every block with no pool, per page id (first time: creates handles);
  - remap us/page: free, trim, then alloc again (handles reused where the cache allows);
  - unmap us/page: free of every block then trim (pool 0), per page id.
Medians over `--repeats` runs. A benchmark, never a test: nothing asserts a time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402  (after the path insert)

from kvcached import KVCacheManager, alloc_kv_cache, config, init_kvcached, shutdown_kvcached  # noqa: E402

LAYOUTS = ("per_layer", "interleaved", "page_grouped")
BLOCK_SIZE, KV_HEADS, HEAD_DIM = 16, 8, 128


def one_run(device: str, layout: str, zero_page: bool, layers: int, gib: float, dtype) -> dict:
    os.environ.update({"KVCACHED_LAYOUT": layout, "KVCACHED_ZERO_PAGE": str(int(zero_page)),
                       "KVCACHED_MIN_RESERVED_PAGES": "0", "KVCACHED_MAX_RESERVED_PAGES": "0",
                       "KVCACHED_TRACKER": "0"})
    config.reload_settings()
    cell = KV_HEADS * HEAD_DIM * dtype.itemsize
    num_blocks = int(gib * (1 << 30) // (2 * layers * BLOCK_SIZE * cell))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    init_kvcached(device=device)
    t0 = time.perf_counter()
    kv = alloc_kv_cache((2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM), BLOCK_SIZE, dtype, device, layers)
    m = KVCacheManager(num_blocks, BLOCK_SIZE, cell, layers)
    create_ms = (time.perf_counter() - t0) * 1e3
    pages = m.num_pages
    times = {}
    for name in ("map", "remap"):
        t0 = time.perf_counter()
        ids = m.alloc(m.available_size())
        sync()
        times[name] = (time.perf_counter() - t0) * 1e6 / pages
        t0 = time.perf_counter()
        m.free(ids)
        m.trim()
        sync()
        times["unmap"] = (time.perf_counter() - t0) * 1e6 / pages
    if zero_page:                                   # the safe mode: an unallocated row reads zeros
        assert float(kv[0][0, 0].float().abs().sum()) == 0.0
    del kv
    shutdown_kvcached()
    return {"create_ms": create_ms, "pages": pages, **times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--gib", type=float, default=16.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    print(f"device {args.device}, {args.layers} layers, {args.gib} GiB virtual, medians of {args.repeats}")
    print(f"{'layout':<13} {'zero page':<9} {'page ids':>8} {'create ms':>10} {'map us/page':>12} "
          f"{'remap us/page':>14} {'unmap us/page':>14}")
    for layout in LAYOUTS:
        for zero_page in (False, True):
            runs = [one_run(args.device, layout, zero_page, args.layers, args.gib, dtype) for _ in range(args.repeats)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(f"{layout:<13} {'on' if zero_page else 'off':<9} {int(med['pages']):>8} {med['create_ms']:>10.1f} "
                  f"{med['map']:>12.1f} {med['remap']:>14.1f} {med['unmap']:>14.1f}", flush=True)


if __name__ == "__main__":
    main()
