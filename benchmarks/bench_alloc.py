"""Allocator microbenchmarks: prints a table.

    python benchmarks/bench_alloc.py [--device host|cpu|cuda] [--segments 1 64] [--quick] [--json PATH]

Cases (each per device and per "segments per page": 1 = one compound mapping per page id, as the
interleaved / page_grouped layouts; 2*L = 64 = per_layer with L = 32):
  alloc(k)+free, k = 1, 4, 16, 64, 256, pool on (min 5, max 10) and pool off (min = max = 0:
  every cycle maps and unmaps); available_blocks(); free of 1024 ids; 1/4/8 threads alloc(16)+free
  aggregate ops/s; p50/p99 alloc latency over a ramp of 1000 requests of 16 blocks with the pool
  and its background thread on, and the share of allocs that waited on the driver.
Page tables are built directly (64 blocks per page id: 32 KiB blocks in 2 MiB mappings per layer
buffer, or 2 MiB blocks in one 128 MiB compound mapping).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcached.core import BlockAllocator, PageAllocator  # noqa: E402
from kvcached.core import PageTable  # noqa: E402
from kvcached.core import CudaBackend, HostBackend  # noqa: E402

MIB = 1 << 20
BLOCKS_PER_PAGE = 64
KS = (1, 4, 16, 64, 256)


class Setup:
    """A backend, a page table of `num_pages` ids with `segments` mappings each, and allocators."""

    def __init__(self, device: str = "host", segments: int = 1, num_pages: int = 320,
                 min_reserved: int = 5, max_reserved: int = 10):
        if device == "cuda":
            self.backend = CudaBackend(0)
        else:
            self.backend = HostBackend(2 * MIB, capacity_bytes=1 << 45)   # sparse memfd: never touched
        g = self.backend.granularity
        map_bytes = 2 * MIB if segments > 1 else 2 * MIB * 64
        map_bytes = max(g, map_bytes // g * g)
        self.ranges = [self.backend.reserve(num_pages * map_bytes) for _ in range(segments)]
        self.table = PageTable(self.backend, [(r, 0) for r in self.ranges], map_bytes, num_pages)
        self.pages = PageAllocator(self.table, min_reserved=min_reserved, max_reserved=max_reserved, idle_trim_s=0)
        self.blocks = BlockAllocator.dense(self.pages, map_bytes // BLOCKS_PER_PAGE)
        self.device, self.segments = device, segments

    def close(self):
        self.pages.stop()
        self.blocks.clear()
        self.pages.close()
        self.table.close()


def warm_pool(s: Setup):
    """Fill the pool to max_reserved (as the background thread would, and a free leaves it)."""
    n = s.pages.max_reserved * BLOCKS_PER_PAGE
    if n:
        s.blocks.free(s.blocks.alloc(n))


def time_per_call(fn, min_time: float = 0.2, repeats: int = 3) -> float:
    """Best of `repeats` runs of ~min_time seconds; seconds per call of fn()."""
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        if dt >= min_time / 4:
            break
        n *= 4
    best = dt / n
    for _ in range(repeats - 1):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def cycle(allocator, k: int):
    """One alloc(k)+free of `allocator` (a BlockAllocator, a KVCacheManager), as a callable."""
    alloc, free = allocator.alloc, allocator.free

    def run():
        free(alloc(k))
    return run


def free_1024(s: Setup, rounds: int = 200) -> float:
    total = 0.0
    for _ in range(rounds):
        ids = s.blocks.alloc(1024)
        t0 = time.perf_counter()
        s.blocks.free(ids)
        total += time.perf_counter() - t0
    return total / rounds


def threads_ops(allocator, num_threads: int, k: int = 16, seconds: float = 0.5) -> float:
    """Aggregate alloc(k)+free cycles per second over num_threads threads sharing `allocator`
    (anything with alloc and free: a BlockAllocator, a KVCacheManager)."""
    counts = [0] * num_threads
    stop = threading.Event()
    start = threading.Barrier(num_threads + 1)

    def worker(i):
        alloc, free = allocator.alloc, allocator.free
        start.wait()
        n = 0
        while not stop.is_set():
            for _ in range(100):
                free(alloc(k))
            n += 100
        counts[i] = n

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(num_threads)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def ramp(s: Setup, requests: int = 1000, k: int = 16, gap_s: float = 50e-6) -> tuple[float, float, float]:
    """p50, p99 (us) of alloc(k) over `requests` growing requests arriving every `gap_s` (a sleep
    that stands for the engine's step; 0 = back to back), background thread on; and the share of
    allocs that waited on the driver (mapped themselves, or waited for the background refill)."""
    s.pages.start()
    time.sleep(0.05)
    lat, slow, live = [], 0, []

    def waits():
        st = s.pages.stats()
        return st["num_slow_path"] + st.get("num_pool_waits", 0)

    for _ in range(requests):
        before = waits()
        t0 = time.perf_counter()
        got = s.blocks.alloc(k)
        lat.append(time.perf_counter() - t0)
        slow += waits() > before
        if got is None:
            break
        live.append(got)
        if gap_s:
            time.sleep(gap_s)
    s.pages.stop()
    for ids in live:
        s.blocks.free(ids)
    lat.sort()
    return statistics.median(lat) * 1e6, lat[int(len(lat) * 0.99) - 1] * 1e6, slow / len(lat)


def run(device: str, segments: int, quick: bool) -> list[tuple[str, str]]:
    rows = []
    mt = 0.05 if quick else 0.2
    s = Setup(device, segments)
    warm_pool(s)
    for k in KS:
        rows.append((f"alloc({k})+free, pool on", f"{time_per_call(cycle(s.blocks, k), mt) * 1e6:8.2f} us"))
    rows.append(("available_blocks()", f"{time_per_call(s.blocks.available_blocks, mt) * 1e6:8.3f} us"))
    for n in (1, 4, 8):
        rows.append((f"{n} threads alloc(16)+free", f"{threads_ops(s.blocks, n, seconds=0.2 if quick else 0.5) / 1e3:8.0f} K ops/s"))
    s.close()
    s = Setup(device, segments, min_reserved=0, max_reserved=32)   # pages stay mapped: bookkeeping only
    rows.append(("free(1024 ids), 16 pages into the pool", f"{free_1024(s, 20 if quick else 200) * 1e6:8.2f} us"))
    s.close()
    s = Setup(device, segments, min_reserved=0, max_reserved=0)
    for k in KS:
        rows.append((f"alloc({k})+free, pool off", f"{time_per_call(cycle(s.blocks, k), mt, repeats=2) * 1e6:8.2f} us"))
    s.close()
    for gap in (50e-6, 0.0):
        s = Setup(device, segments, num_pages=400)
        p50, p99, share = ramp(s, 300 if quick else 1000, gap_s=gap)
        label = f"every {gap * 1e6:.0f} us" if gap else "back to back"
        rows.append((f"ramp alloc(16), {label}: p50 / p99", f"{p50:6.1f} / {p99:6.1f} us"))
        rows.append((f"ramp, {label}: waited on the driver", f"{share * 100:6.1f} %"))
        s.close()
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("host", "cpu", "cuda"), default="host", help="cpu = host")
    parser.add_argument("--segments", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--quick", action="store_true", help="shorter timings (smoke run)")
    parser.add_argument("--json", metavar="PATH", help="also write the table as JSON")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        args.device = "host"
    results = {seg: dict(run(args.device, seg, args.quick)) for seg in args.segments}
    names = list(next(iter(results.values())))
    print(f"kvcached allocator benchmark, device={args.device}, {BLOCKS_PER_PAGE} blocks per page id")
    header = f"{'case':42s}" + "".join(f"{f'segments={seg}':>22s}" for seg in args.segments)
    print(header)
    print("-" * len(header))
    for name in names:
        print(f"{name:42s}" + "".join(f"{results[seg][name]:>22s}" for seg in args.segments))
    if args.json:
        import json

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(
            {"device": args.device, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "segments": {str(seg): results[seg] for seg in args.segments}}, indent=2) + "\n")


if __name__ == "__main__":
    main()
