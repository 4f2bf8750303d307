"""Tensor-parallel benchmark: what mirroring page maps to the other ranks costs the scheduling rank,
over each transport (shared memory between the ranks of a host, gloo messages).

    python benchmarks/bench_tp.py [--device cpu|cuda] [--tp 1 2 [4]] [--transports shm gloo]
                                  [--layouts per_layer interleaved] [--json PATH] [--quick]

For each TP size and transport one process per rank (on cuda rank r uses cuda:r) builds the
bench_manager model with the KV heads split over the ranks (32 layers, 8 KV heads x 128 dim in
total, bf16, block_size 16, 2 MiB pages, 64 page ids), once per layout; TP=1 runs once (no
transport). Rank 0 measures, the others serve. Rows (one column per TP size, transport and layout):

  map one page id            PageTable.map([p]) of the group's table, then unmap (median µs);
  unmap one page id          at TP > 1 each includes the round trip to every peer, which maps
                             in parallel (the request goes out before the local map)
  round trip, empty request  TP > 1: one request to every peer that does nothing there (the
  (p50, p99)                 start-up check of the page size), µs: the messaging alone
  alloc(bpp)+free, pool off  KVCACHED_MIN/MAX_RESERVED_PAGES=0: every cycle maps and unmaps one
                             page id through the manager (median µs)
  alloc(16)+free, pool on    default pool, warm: no mapping, so no message (µs per cycle, best
                             of 3 runs of ~0.2 s)
  messages per pool cycle    rounds rank 0's calling thread sent per alloc(16)+free (should be 0)

Goals (host backend): round trip p50 <= 10 µs and p99 <= 50 µs; map at TP=2 <= 3x TP=1;
alloc(16)+free, pool on, at TP=2 <= 2 µs with no message. On the GPU (2xH200): map at TP=2 <=
1.5x TP=1. On --device cpu the host backend stands in for the GPU. A benchmark, never a test.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_alloc import cycle, time_per_call

NUM_LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
PAGE_BYTES = 2 << 20
NUM_PAGES = 64
HOST_CAPACITY = 1 << 45                 # host backend: slots only, never touched
ROWS = ("map_us", "unmap_us", "round_trip_us", "round_trip_p99_us", "alloc_free_pool_off_us",
        "alloc16_free_pool_on_us", "messages_per_pool_cycle")
LABELS = {"map_us": "map one page id (µs)", "unmap_us": "unmap one page id (µs)",
          "round_trip_us": "round trip, empty request (µs)",
          "round_trip_p99_us": "round trip, empty request, p99 (µs)",
          "alloc_free_pool_off_us": "alloc(bpp)+free, pool off (µs)",
          "alloc16_free_pool_on_us": "alloc(16)+free, pool on (µs)",
          "messages_per_pool_cycle": "messages per pool cycle"}


# -- one rank ---------------------------------------------------------------------------------------

def _instance(rank: int, world: int, device: str, layout: str, pool: tuple[int, int] | None):
    """init_kvcached + alloc_kv_cache for this rank's shard (heads split over the ranks)."""
    import torch
    from bench_manager import use_settings

    from kvcached import alloc_kv_cache, init_kvcached

    use_settings(layout, pool, KVCACHED_TRACKER="0", KVCACHED_IDLE_TRIM_S="0")
    dev = "cpu" if device == "cpu" else f"cuda:{rank}"
    heads = max(1, HEADS // world)
    blocks_per_page = PAGE_BYTES // (BLOCK_SIZE * heads * HEAD_DIM * 2)
    num_blocks = NUM_PAGES * blocks_per_page
    init_kvcached(tp_rank=rank, world_size=world, device=dev, page_size_bytes=PAGE_BYTES,
                  host_capacity_bytes=HOST_CAPACITY if device == "cpu" else None)
    kv = alloc_kv_cache((2, num_blocks, BLOCK_SIZE, heads, HEAD_DIM), BLOCK_SIZE, torch.bfloat16, dev, NUM_LAYERS)
    return kv, num_blocks, heads * HEAD_DIM * 2, blocks_per_page


def _times(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _median_us(fn, repeats: int) -> float:
    return statistics.median(_times(fn, repeats)) * 1e6


def _p99_us(times: list[float]) -> float:
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6


def _measure_layout(rank: int, world: int, device: str, layout: str, repeats: int) -> dict:
    import threading

    from kvcached import KVCacheManager, shutdown_kvcached
    from kvcached import runtime as kv_runtime
    from kvcached.runtime import wait_for_scheduler

    out: dict = {}
    # 1. the page table alone, and the manager with no pool: every cycle maps and unmaps
    kv, num_blocks, cell, bpp = _instance(rank, world, device, layout, (0, 0))
    if rank == 0:
        table = kv_runtime.runtime().groups[0].page_table
        table.map([0])
        table.unmap([0])                  # handles now in the cache: no create/release below
        maps, unmaps = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            table.map([1])
            t1 = time.perf_counter()
            table.unmap([1])
            t2 = time.perf_counter()
            maps.append(t1 - t0)
            unmaps.append(t2 - t1)
        out["map_us"] = statistics.median(maps) * 1e6
        out["unmap_us"] = statistics.median(unmaps) * 1e6
        leader = kv_runtime.runtime().tp
        if leader is not None:
            trips = _times(lambda: leader.hello(PAGE_BYTES), max(repeats, 1000))
            out["round_trip_us"] = statistics.median(trips) * 1e6
            out["round_trip_p99_us"] = _p99_us(trips)
            out["transport"] = leader.channel.kind
        m = KVCacheManager(num_blocks, BLOCK_SIZE, cell, NUM_LAYERS, world_size=world)
        out["alloc_free_pool_off_us"] = _median_us(cycle(m, bpp), repeats)
        m.close()
    else:
        wait_for_scheduler()
    del kv
    shutdown_kvcached()
    # 2. the default pool, warm
    kv, num_blocks, cell, bpp = _instance(rank, world, device, layout, None)
    if rank == 0:
        m = KVCacheManager(num_blocks, BLOCK_SIZE, cell, NUM_LAYERS, world_size=world)
        ids = m.alloc(m._pages.max_reserved * bpp)
        m.free(ids)
        leader = kv_runtime.runtime().tp
        me = threading.get_ident()
        sent = leader.rounds_by_thread[me] if leader is not None else 0
        run = cycle(m, 16)
        out["alloc16_free_pool_on_us"] = time_per_call(run) * 1e6
        cycles = 2000
        for _ in range(cycles):
            run()
        out["messages_per_pool_cycle"] = ((leader.rounds_by_thread[me] - sent) / cycles) if leader is not None else 0
        m.close()
    else:
        wait_for_scheduler()
    del kv
    shutdown_kvcached()
    return out


def run_rank(args) -> None:
    import torch.distributed as dist

    rank, world = args.rank, args.world
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=world)
    results = {layout: _measure_layout(rank, world, args.device, layout, args.repeats) for layout in args.layouts}
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    if world > 1:
        dist.destroy_process_group()


# -- the driver -------------------------------------------------------------------------------------

def run_tp(tp: int, transport: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1",
               "KVCACHED_TP_TRANSPORT": transport}
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(tp), "--store",
                                   os.path.join(tmp, "store"), "--out", out, "--device", args.device,
                                   "--repeats", str(args.repeats), "--layouts", *args.layouts], env=env)
                 for r in range(tp)]
        for proc in procs:
            if proc.wait() != 0:
                for other in procs:
                    other.kill()
                raise SystemExit(f"a rank of the TP={tp} run failed (exit {proc.returncode})")
        return json.loads(Path(out).read_text())


def print_table(results: dict, layouts: list[str]) -> None:
    """`results`: {run name ("1", "2 shm", "2 gloo"): {layout: figures}}."""
    columns = [(run, layout) for run in results for layout in layouts]
    head = f"{'':38}" + "".join(f"{f'TP={run} {layout}':>24}" for run, layout in columns)
    print(head)
    for row in ROWS:
        cells = []
        for run, layout in columns:
            value = results[run][layout].get(row)
            cells.append(f"{value:>24.2f}" if value is not None else f"{'-':>24}")
        print(f"{LABELS[row]:38}" + "".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layouts", nargs="+", default=["per_layer", "interleaved"])
    parser.add_argument("--transports", nargs="+", choices=("shm", "gloo"), default=["shm", "gloo"],
                        help="the transports of the TP > 1 runs, side by side")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (CI smoke run)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 30 if args.quick else 500
    if args.rank is not None:
        run_rank(args)
        return
    results = {}
    for tp in args.tp:
        for transport in (["auto"] if tp == 1 else args.transports):
            results[str(tp) if tp == 1 else f"{tp} {transport}"] = run_tp(tp, transport, args)
    print_table(results, args.layouts)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "benchmark": "bench_tp", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "device": args.device, "machine": platform.node(), "python": platform.python_version(),
            "repeats": args.repeats, "results": results}, indent=1))


if __name__ == "__main__":
    main()
