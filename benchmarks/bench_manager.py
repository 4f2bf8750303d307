"""Manager-level benchmark: the goals of benchmarks/README.md measured through the public API.

    python benchmarks/bench_manager.py [--device cpu|cuda] [--model 32L|16L]
                                       [--layouts per_layer interleaved page_grouped]
                                       [--json PATH] [--quick]

Every figure goes through what serving code calls: ``init_kvcached``, ``alloc_kv_cache`` and a
``KVCacheManager`` (its ``alloc`` / ``free`` / ``available_size``), once per layout
(``KVCACHED_LAYOUT``), for one model (MODELS), 2 MiB pages and block_size 16:
  32L (default)  32 layers, 8 KV heads x 128 dim, bf16: 32 KiB per block and buffer, 64 blocks
                 per page id, 59904 blocks (~117 GiB of KV virtual)
  16L            16 layers, 8 KV heads x 64 dim, fp16: 16 KiB per block and buffer, 128 blocks
                 per page id, 65536 blocks (32 GiB of KV virtual)
Rows (one table, one column per layout):

  create KV tensors          alloc_kv_cache after init_kvcached (reserve + torch views), ms
  alloc(k)+free, pool on     k = 1, 16, 256; default pool (min 5, max 10 pages), pool warm
  available_size()           µs per call
  N threads alloc(16)+free   aggregate cycles per second, N = 1, 8
  ramp                       1000 requests of alloc(16) while the cache grows, pool on, one every
                             50 µs (an engine step) and back to back: p50 / p99 µs, and the share
                             of allocs that waited on the driver (mapped, or waited for the
                             background refill: num_slow_path + num_pool_waits moved)
  refill after a slow alloc  an alloc that needs more pages than the pool holds takes the pool and
                             maps the rest; µs until the background thread has the pool back at
                             min_reserved (p50 / p99 of 50): the slow path wakes it at once
  alloc(k)+free, pool 0      KVCACHED_MIN/MAX_RESERVED_PAGES=0: every cycle maps and unmaps
  map / unmap one page id    PageTable.map([p]) of the manager's table: with the default handle
                             cache (8 handles) and with a cache holding one page id's handles
  driver floor               the same mappings as bare Backend.map / unmap calls, no page table,
                             timed in Python (driver_floor says why that is close enough)

On --device cpu the host backend stands in for the GPU (memfd "pages", never touched, so the
sizes are those of the GPU run). The tracker is on, as by default. A benchmark, never a test.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_alloc import cycle, threads_ops, time_per_call  # noqa: E402

from kvcached.core import MAX_HANDLE_CACHE_SIZE, PageTable  # noqa: E402

LAYOUTS = ("per_layer", "interleaved", "page_grouped")
BLOCK_SIZE = 16
HOST_CAPACITY = 1 << 45                 # host backend: slots only, never touched
KS = (1, 16, 256)


class Model(NamedTuple):
    """One model's KV geometry (block_size BLOCK_SIZE, 2 MiB pages)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str                          # a torch dtype name
    num_blocks: int


MODELS = {
    "32L": Model(32, 8, 128, "bfloat16", 59904),   # 117 GiB of KV: 59904 x 32 layers x 2 x 32 KiB
    "16L": Model(16, 8, 64, "float16", 65536),     # 32 GiB: 65536 x 16 layers x 2 x 16 KiB, 128 blocks per page
}
DEFAULT_MODEL = MODELS["32L"]


# -- one manager per configuration ------------------------------------------------------------


def use_settings(layout: str, pool: tuple[int, int] | None, **extra: str) -> None:
    """Set KVCACHED_LAYOUT, the pool bounds (None: the defaults) and any `extra` variables, then
    reload kvcached's settings."""
    from kvcached import config

    os.environ["KVCACHED_LAYOUT"] = layout
    os.environ.update(extra)
    for key in ("KVCACHED_MIN_RESERVED_PAGES", "KVCACHED_MAX_RESERVED_PAGES"):
        os.environ.pop(key, None)
    if pool is not None:
        os.environ["KVCACHED_MIN_RESERVED_PAGES"], os.environ["KVCACHED_MAX_RESERVED_PAGES"] = map(str, pool)
    config.reload_settings()


class Instance:
    """init_kvcached + alloc_kv_cache + KVCacheManager for one layout and pool setting."""

    def __init__(self, device: str, layout: str, pool: tuple[int, int] | None = None,
                 num_blocks: int | None = None, model: Model = DEFAULT_MODEL):
        import torch

        from kvcached import (
            KVCacheManager,
            alloc_kv_cache,
            init_kvcached,
            shutdown_kvcached,
        )

        self._shutdown = shutdown_kvcached
        shutdown_kvcached()
        use_settings(layout, pool, KVCACHED_PAGE_SIZE_MB="2")
        gc.collect()
        dev = "cpu" if device == "cpu" else "cuda:0"
        init_kvcached(device=dev, host_capacity_bytes=HOST_CAPACITY if device == "cpu" else None)
        num_blocks = model.num_blocks if num_blocks is None else num_blocks
        dtype = getattr(torch, model.dtype)
        t0 = time.perf_counter()            # what the goal times: reserve the ranges + torch views
        self.kv = alloc_kv_cache((2, num_blocks, BLOCK_SIZE, model.kv_heads, model.head_dim), BLOCK_SIZE, dtype,
                                 dev, model.layers)
        self.create_ms = (time.perf_counter() - t0) * 1e3
        cell = model.kv_heads * model.head_dim * dtype.itemsize
        self.m = KVCacheManager(num_blocks, BLOCK_SIZE, cell, model.layers)
        self.pages = self.m._pages
        self.table = self.m._group.page_table
        self.backend = self.table.backend
        self.layout = self.m.layout
        self.blocks_per_page = max(c for _, c in self.m.get_page_occupancy(range(1)).values())

    def warm_pool(self):
        """Fill the pool to its maximum, as a finished burst leaves it."""
        n = self.pages.max_reserved * self.blocks_per_page
        if n:
            ids = self.m.alloc(n)
            if ids is not None:
                self.m.free(ids)

    def waits(self) -> int:
        st = self.pages.stats()
        return st["num_slow_path"] + st.get("num_pool_waits", 0)

    def close(self):
        self.m.close()
        del self.kv
        self._shutdown()
        gc.collect()


# -- measurements -----------------------------------------------------------------------------------


def ramp(inst: Instance, requests: int, k: int = 16, gap_s: float = 50e-6) -> dict:
    """p50 / p99 / max of alloc(k) over `requests` growing requests, one every gap_s (0: back to
    back), the manager's background thread on, the pool at its resting size when it starts."""
    m = inst.m
    time.sleep(0.05)
    lat, waited, live = [], 0, []
    gc.disable()
    try:
        for _ in range(requests):
            before = inst.waits()
            t0 = time.perf_counter()
            got = m.alloc(k)
            lat.append(time.perf_counter() - t0)
            waited += inst.waits() > before
            if got is None:
                break
            live.append(got)
            if gap_s:
                time.sleep(gap_s)       # a sleep, not a spin: the background thread needs a core too
    finally:
        gc.enable()
    for ids in live:
        m.free(ids)
    lat.sort()
    return {"p50_us": statistics.median(lat) * 1e6, "p99_us": lat[max(0, int(len(lat) * 0.99) - 1)] * 1e6,
            "max_us": lat[-1] * 1e6, "waited_share": waited / len(lat), "requests": len(lat)}


def refill_gap(inst: Instance, repeats: int) -> dict:
    """p50 / p99 µs from a slow-path alloc (more pages than the pool holds) returning until the
    pool is back at min_reserved, the background thread on (Note [Background thread])."""
    pages, m = inst.pages, inst.m
    target = pages.min_reserved
    n = (pages.max_reserved + 1) * inst.blocks_per_page
    gaps = []

    def settled(timeout_s: float = 5.0) -> bool:
        end = time.perf_counter() + timeout_s
        while time.perf_counter() < end:
            st = pages.stats()
            if st["reserved"] >= target and st["transit"] == 0:
                return True
        return False

    for _ in range(repeats):
        if not settled():
            break
        ids = m.alloc(n)
        t0 = time.perf_counter()
        if ids is None:
            break
        while pages.stats()["reserved"] < target and time.perf_counter() - t0 < 5.0:
            pass
        gaps.append(time.perf_counter() - t0)
        m.free(ids)
    gaps.sort()
    if not gaps:
        return {"p50_us": float("nan"), "p99_us": float("nan"), "repeats": 0}
    return {"p50_us": statistics.median(gaps) * 1e6, "p99_us": gaps[max(0, int(len(gaps) * 0.99) - 1)] * 1e6,
            "repeats": len(gaps)}


def driver_floor(pt: PageTable, page_id: int, repeats: int) -> dict[str, list[float]]:
    """What mapping `page_id` of `pt` costs in backend calls alone, without the page table: one
    handle per segment made once (Backend.create), then `repeats` passes of Backend.map (map and
    set access) over every segment and Backend.unmap over them again, each pass timed. Python
    times the calls: each costs 1.4-30 µs in the driver, Python's ~0.1 µs per call is within the
    noise. Returns {"map_us", "unmap_us"}: µs per pass. The page id must be unmapped and the
    zero page off (the table's state is not touched)."""
    if pt.is_mapped(page_id) or pt.zero_page:
        raise ValueError(f"driver_floor needs an unmapped page id ({page_id} is mapped) and no zero page")
    backend, size = pt.backend, pt.map_bytes
    addresses = pt.segment_addresses(page_id)
    handles: list[int] = []
    maps, unmaps = [], []
    try:
        for _ in addresses:
            handles.append(backend.create(size))
        for _ in range(repeats):
            t0 = time.perf_counter()
            for address, handle in zip(addresses, handles):
                backend.map(address, size, handle)
            t1 = time.perf_counter()
            for address in addresses:
                backend.unmap(address, size)
            maps.append((t1 - t0) * 1e6)
            unmaps.append((time.perf_counter() - t1) * 1e6)
    finally:
        for handle in handles:
            backend.release(handle, size)
    return {"map_us": maps, "unmap_us": unmaps}


def map_one_page(inst: Instance, n: int) -> dict:
    """Median µs of PageTable.map([p]) / unmap([p]) on the manager's table, p unmapped, with the
    default handle cache and with one holding a page id's handles; then the driver floor."""
    pt, b = inst.table, inst.backend
    inst.pages.stop()
    p = pt.num_pages - 1
    out = {"mappings_per_page_id": pt.num_segments}
    default_cap = b.cache_capacity
    warm_cap = min(MAX_HANDLE_CACHE_SIZE, max(default_cap, pt.num_segments))
    for label, cap in (("default_cache", default_cap), ("warm_cache", warm_cap)):
        b.set_handle_cache_capacity(cap)
        pt.map([p])
        pt.unmap([p])
        maps, unmaps = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            pt.map([p])
            t1 = time.perf_counter()
            pt.unmap([p])
            maps.append(t1 - t0)
            unmaps.append(time.perf_counter() - t1)
        out[label] = {"map_us": statistics.median(maps) * 1e6, "unmap_us": statistics.median(unmaps) * 1e6}
    floor = driver_floor(pt, p, n)
    out["driver_floor"] = {key: statistics.median(vals) for key, vals in floor.items()}
    b.set_handle_cache_capacity(default_cap)
    b.release_cached()
    return out


def run_layout(device: str, layout: str, quick: bool, model: Model = DEFAULT_MODEL) -> dict:
    mt = 0.05 if quick else 0.2
    res = {"layout": layout}
    inst = Instance(device, layout, model=model)
    res["create_ms"] = inst.create_ms
    res["blocks_per_page"] = inst.blocks_per_page
    inst.warm_pool()
    for k in KS:
        res[f"pool_on_{k}_us"] = time_per_call(cycle(inst.m, k), mt) * 1e6
    res["available_size_us"] = time_per_call(inst.m.available_size, mt) * 1e6
    for n in (1, 8):
        res[f"threads_{n}_ops"] = threads_ops(inst.m, n, seconds=0.15 if quick else 0.5)
    inst.close()
    for gap, key in ((50e-6, "ramp_50us"), (0.0, "ramp_b2b")):
        inst = Instance(device, layout, model=model)
        res[key] = ramp(inst, 300 if quick else 1000, gap_s=gap)
        inst.close()
    inst = Instance(device, layout, model=model)
    res["refill_gap"] = refill_gap(inst, 10 if quick else 50)
    inst.close()
    inst = Instance(device, layout, pool=(0, 0), model=model)
    for k in KS:
        res[f"pool_0_{k}_us"] = time_per_call(cycle(inst.m, k), mt / 2, repeats=2) * 1e6
    res["map_page"] = map_one_page(inst, 10 if quick else (40 if layout == "per_layer" else 200))
    inst.close()
    return res


# -- the table --------------------------------------------------------------------------------------


def rows_of(res: dict) -> list[tuple[str, str]]:
    mp = res["map_page"]
    rows = [("create KV tensors (ms)", f"{res['create_ms']:.2f}")]
    rows += [(f"alloc({k})+free, pool on (us)", f"{res[f'pool_on_{k}_us']:.2f}") for k in KS]
    rows += [(f"alloc({k})+free, pool 0 (us)", f"{res[f'pool_0_{k}_us']:.1f}") for k in KS]
    rows.append(("available_size() (us)", f"{res['available_size_us']:.3f}"))
    rows += [(f"{n} threads alloc(16)+free (K ops/s)", f"{res[f'threads_{n}_ops'] / 1e3:.0f}") for n in (1, 8)]
    for key, label in (("ramp_50us", "every 50 us"), ("ramp_b2b", "back to back")):
        r = res[key]
        rows.append((f"ramp {label}: p50 / p99 (us)", f"{r['p50_us']:.1f} / {r['p99_us']:.1f}"))
        rows.append((f"ramp {label}: waited on driver", f"{r['waited_share'] * 100:.1f} %"))
    if "refill_gap" in res:
        r = res["refill_gap"]
        rows.append(("refill after a slow alloc: p50 / p99 (us)", f"{r['p50_us']:.1f} / {r['p99_us']:.1f}"))
    rows.append(("map one page id, default cache (us)", f"{mp['default_cache']['map_us']:.1f}"))
    rows.append(("map one page id, warm cache (us)", f"{mp['warm_cache']['map_us']:.1f}"))
    rows.append(("unmap one page id, warm cache (us)", f"{mp['warm_cache']['unmap_us']:.1f}"))
    rows.append(("driver floor: map, backend calls (us)", f"{mp['driver_floor']['map_us']:.1f}"))
    rows.append(("driver floor: unmap, backend calls (us)", f"{mp['driver_floor']['unmap_us']:.1f}"))
    rows.append(("mappings per page id", str(mp["mappings_per_page_id"])))
    return rows


def meta(device: str, name: str, model: Model) -> dict:
    info = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "device": device,
            "python": platform.python_version(), "host": platform.node(), "cpus": os.cpu_count(),
            "model": {"name": name, **model._asdict(), "block_size": BLOCK_SIZE, "page_mib": 2}}
    try:
        import torch

        info["torch"] = torch.__version__
        if device == "cuda":
            info["gpu"] = torch.cuda.get_device_name(0)
    except Exception:
        pass
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", choices=MODELS, default="32L",
                        help="32L: 32 layers, 8x128 bf16, 64 blocks per page id (default); "
                             "16L: 16 layers, 8x64 fp16, 128 blocks per page id")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--quick", action="store_true", help="shorter timings (smoke run)")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        from kvcached.core import cuda_unavailable_reason

        reason = cuda_unavailable_reason()
        if reason is not None:
            parser.error(f"--device cuda: {reason}")
    os.environ.setdefault("KVCACHED_IDLE_TRIM_S", "0")      # no idle trim in the middle of a case
    if args.device == "cuda":
        import torch

        torch.cuda.init()                   # context and torch's CUDA state before any timing
        torch.empty(1, device="cuda")
    model = MODELS[args.model]
    results = {layout: run_layout(args.device, layout, args.quick, model) for layout in args.layouts}
    info = meta(args.device, args.model, model)
    bpp = results[args.layouts[0]]["blocks_per_page"]
    print(f"kvcached manager benchmark, device={args.device}{', ' + info['gpu'] if 'gpu' in info else ''}; "
          f"model {args.model}: {model.layers} layers, {model.kv_heads}x{model.head_dim} {model.dtype}, "
          f"{model.num_blocks} blocks of {BLOCK_SIZE} ({bpp} per page id), 2 MiB pages; {info['date']}")
    table = {layout: dict(rows_of(res)) for layout, res in results.items()}
    names = list(next(iter(table.values())))
    width = max(len(n) for n in names) + 2
    header = f"{'case':{width}s}" + "".join(f"{layout:>16s}" for layout in args.layouts)
    print(header)
    print("-" * len(header))
    for name in names:
        print(f"{name:{width}s}" + "".join(f"{table[layout][name]:>16s}" for layout in args.layouts))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": info, "results": results}, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
