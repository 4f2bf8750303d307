"""What the VMM layer costs: backend ops per call, page-table map/unmap per layout, KV tensor creation.

    python benchmarks/bench_vmm.py [--device cpu|cuda] [--json PATH] [--quick]

Prints three tables and, with --json, writes them for benchmarks/README.md:
  1. per-call µs (median, p90) of each backend op on one granule: reserve 1 GiB / 1 TiB, create,
     map, set access, unmap, release, handle-cache acquire / recycle;
  2. map and unmap of one page id for layout-like page tables at L = 32 and 80 layers:
     per_layer = 2·L segments of one page each (separate ranges), compound (interleaved /
     page_grouped) = one segment of page × 2·L; with the handle cache warm (capacity >= 2·L) and
     cold (capacity 0: every map creates, every unmap releases);
  3. creation of the KV tensors of a 32-layer model, ~117 GiB virtual: reserve the ranges and
     export them to torch (per_layer = 64 ranges, compound = 1 range + 32 per-layer views),
     no zero page, in ms.

Every figure is one Python call into kvcached.core, Python-side validation included (for page
tables that is the numpy check of the ids, a few µs; the allocators call the nogil path directly).
On the host backend (device cpu) the sizes of table 1 and 2 are the same as on the GPU: its
"physical" pages are memfd slots, created and mapped without touching memory. A benchmark, never a
test: nothing here asserts a time.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcached import core  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
TiB = 1 << 40
now_ns = time.perf_counter_ns


# -- measurement helpers -------------------------------------------------------------------------


def summary(samples_ns: list[int]) -> dict:
    us = sorted(s / 1e3 for s in samples_ns)
    p90 = us[min(len(us) - 1, int(round(0.9 * (len(us) - 1))))]
    return {"median_us": round(statistics.median(us), 3), "p90_us": round(p90, 3), "n": len(us)}


class Timer:
    """Collects per-call durations of several ops measured in one loop."""

    def __init__(self, *names: str):
        self.samples = {name: [] for name in names}

    def time(self, name: str, fn, *args):
        t0 = now_ns()
        out = fn(*args)
        self.samples[name].append(now_ns() - t0)
        return out


def quiet():
    """No garbage collection in a timed loop."""
    gc.collect()
    gc.disable()


def loud():
    gc.enable()


# -- 1. backend ops on one granule -------------------------------------------------------------------


def bench_backend_ops(b, n: int, reserve_n: int) -> list[dict]:
    g = b.granularity
    rows = []
    quiet()
    try:
        for label, size in (("reserve 1 GiB", GiB), ("reserve 1 TiB", TiB)):
            t = Timer(label, "free range")
            for _ in range(reserve_n):
                r = t.time(label, b.reserve, size)
                t.time("free range", r.free)
            rows.append({"op": label, **summary(t.samples[label])})
            if size == GiB:
                rows.append({"op": "free range (1 GiB)", **summary(t.samples["free range"])})

        r = b.reserve(g)
        b.set_handle_cache_capacity(0)
        t = Timer("create", "map (map only)", "set access rw", "set access ro", "unmap",
                  "map + set access", "release")
        for _ in range(n):
            h = t.time("create", b.create, g)
            t.time("map (map only)", b.map_only, r.address, g, h)
            t.time("set access rw", b.set_access, r.address, g, True)
            t.time("unmap", b.unmap, r.address, g)
            t.time("map + set access", b.map, r.address, g, h, True)
            t.time("set access ro", b.set_access, r.address, g, False)
            b.unmap(r.address, g)
            t.time("release", b.release, h, g)
        for name, samples in t.samples.items():
            rows.append({"op": name, **summary(samples)})

        b.set_handle_cache_capacity(8)
        h = b.acquire(g)
        b.recycle(h, g)
        t = Timer("cache acquire (hit)", "cache recycle")
        for _ in range(n):
            h = t.time("cache acquire (hit)", b.acquire, g)
            t.time("cache recycle", b.recycle, h, g)
        for name, samples in t.samples.items():
            rows.append({"op": name, **summary(samples)})
        b.release_cached()
        r.free()
    finally:
        loud()
        b.set_handle_cache_capacity(core.DEFAULT_HANDLE_CACHE_SIZE)
    return rows


# -- 2. page-table map / unmap per layout -----------------------------------------------------------


def make_table(b, layout: str, layers: int, page: int, num_pages: int):
    buffers = 2 * layers
    if layout == "per_layer":
        ranges = [b.reserve(page * num_pages) for _ in range(buffers)]
        return core.PageTable(b, [(r, 0) for r in ranges], page, num_pages), ranges
    r = b.reserve(page * buffers * num_pages)
    return core.PageTable(b, [(r, 0)], page * buffers, num_pages), [r]


def bench_page_tables(b, page: int, layers_list, n_for) -> list[dict]:
    rows = []
    for layers in layers_list:
        for layout in ("per_layer", "compound"):
            pt, ranges = make_table(b, layout, layers, page, num_pages=4)
            n = n_for(layout, layers)
            for cache in ("warm", "cold"):
                b.release_cached()
                b.set_handle_cache_capacity(min(core.MAX_HANDLE_CACHE_SIZE, 2 * layers) if cache == "warm" else 0)
                assert pt.map([0]) and pt.map([3])          # neighbours mapped, as in a live cache
                pt.unmap([0])                              # warm: the handles of one page id cached
                t = Timer("map", "unmap")
                creates0 = b.stats()["num_creates"]
                quiet()
                try:
                    for i in range(n):
                        ok = t.time("map", pt.map, [1])
                        if not ok:
                            raise SystemExit(f"out of memory mapping {layout} L={layers}")
                        t.time("unmap", pt.unmap, [1])
                finally:
                    loud()
                creates = b.stats()["num_creates"] - creates0
                pt.unmap(pt.mapped_page_ids())         # the next cache setting starts from nothing mapped
                b.release_cached()
                rows.append({
                    "layout": layout,
                    "layers": layers,
                    "mappings_per_page_id": pt.num_segments,
                    "map_bytes": pt.map_bytes,
                    "page_id_bytes": pt.page_bytes,
                    "cache": cache,
                    "map": summary(t.samples["map"]),
                    "unmap": summary(t.samples["unmap"]),
                    "creates_per_map": round(creates / n, 2),
                })
            pt.close()
            del pt, ranges
            gc.collect()
    b.set_handle_cache_capacity(core.DEFAULT_HANDLE_CACHE_SIZE)
    return rows


# -- 3. KV tensor creation ------------------------------------------------------------------------------


def create_kv_tensors(b, layout: str, layers: int, total_bytes: int, page: int):
    import torch

    buffers = 2 * layers
    if layout == "per_layer":
        per_buffer = total_bytes // buffers // page * page
        ranges = [b.reserve(per_buffer) for _ in range(buffers)]
        tensors = [r.tensor() for r in ranges]
        return ranges, tensors
    num_pages = total_bytes // (page * buffers)
    r = b.reserve(num_pages * page * buffers)
    whole = r.tensor()
    # one view per layer, [page][layer][K/V][bytes]: what page_grouped hands an engine
    grid = whole.view(num_pages, layers, 2, page)
    tensors = [grid[:, layer] for layer in range(layers)]
    assert tensors[0].data_ptr() == r.address and torch.is_tensor(tensors[-1])
    return [r], tensors


def bench_kv_tensors(b, layers: int, total_bytes: int, page: int, runs: int) -> list[dict]:
    rows = []
    for layout in ("per_layer", "compound"):
        samples = []
        ranges = tensors = None
        for run in range(runs + 1):
            gc.collect()
            t0 = now_ns()
            ranges, tensors = create_kv_tensors(b, layout, layers, total_bytes, page)
            elapsed = now_ns() - t0
            if run:                                           # the first run warms torch up
                samples.append(elapsed)
            virtual = sum(r.size_bytes for r in ranges)
            num_ranges = len(ranges)
            del ranges, tensors
            gc.collect()
        rows.append({
            "layout": layout,
            "layers": layers,
            "ranges": num_ranges,
            "virtual_gib": round(virtual / GiB, 2),
            "create_ms_median": round(statistics.median(samples) / 1e6, 3),
            "create_ms_min": round(min(samples) / 1e6, 3),
            "runs": runs,
        })
    return rows


# -- printing ------------------------------------------------------------------------------------------


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    print(f"\n{title}")
    print("  ".join(str(h).ljust(w) if i == 0 else str(h).rjust(w) for i, (h, w) in enumerate(zip(header, widths))))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(row, widths))))


def meta_for(b, device: str) -> dict:
    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "backend": b.kind,
        "granularity": b.granularity,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
    }
    try:
        import torch

        meta["torch"] = torch.__version__
        if device == "cuda":
            meta["gpu"] = torch.cuda.get_device_name(0)
            meta["cuda_runtime"] = torch.version.cuda
    except Exception as exc:  # torch is only needed for table 3
        meta["torch"] = f"unavailable ({exc})"
    try:
        from importlib.metadata import version

        meta["cuda_bindings"] = version("cuda-bindings")
    except Exception:
        pass
    return meta


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_device = "cuda" if core.cuda_unavailable_reason() is None else "cpu"
    parser.add_argument("--device", choices=("cpu", "cuda"), default=default_device,
                        help=f"backend to measure (default here: {default_device})")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    args = parser.parse_args(argv)

    if args.device == "cuda":
        reason = core.cuda_unavailable_reason()
        if reason is not None:
            parser.error(f"--device cuda: {reason}")
        try:
            import torch

            torch.cuda.init()                # share the primary context before timing anything
        except Exception:
            pass
        b = core.CudaBackend(0)
    else:
        b = core.HostBackend(granularity=2 * MiB)   # capacity: the machine's memory (slots only)
    page = b.granularity
    scale = 0.2 if args.quick else 1.0
    n_ops = max(50, int(1000 * scale))
    n_reserve = max(20, int(300 * scale))

    def n_for(layout: str, layers: int) -> int:
        base = 300 if layout == "compound" else (200 if layers <= 32 else 100)
        return max(20, int(base * scale))

    meta = meta_for(b, args.device)
    print(f"kvcached bench_vmm: {args.device} ({b.kind} backend, granularity {b.granularity // 1024} KiB)"
          f"{', ' + meta['gpu'] if 'gpu' in meta else ''}; {meta['date']}")
    if b.kind == "host":
        print("  host backend: 'physical' pages are slots of one memfd; create/map touch no memory, "
              "so these are syscall costs, not GPU driver costs.")

    ops = bench_backend_ops(b, n_ops, n_reserve)
    print_table(f"1. backend ops, one {page // MiB} MiB granule (µs per call, Python call included)",
                ["op", "median µs", "p90 µs", "n"],
                [[r["op"], f"{r['median_us']:.2f}", f"{r['p90_us']:.2f}", r["n"]] for r in ops])

    tables = bench_page_tables(b, page, (32, 80), n_for)
    print_table("2. map / unmap of one page id (µs per call; warm = handle cache holds the page's handles, "
                "cold = capacity 0)",
                ["layout", "L", "mappings", "map MiB", "cache", "map med", "map p90", "unmap med", "unmap p90", "n"],
                [[r["layout"], r["layers"], r["mappings_per_page_id"], r["map_bytes"] // MiB, r["cache"],
                  f"{r['map']['median_us']:.1f}", f"{r['map']['p90_us']:.1f}",
                  f"{r['unmap']['median_us']:.1f}", f"{r['unmap']['p90_us']:.1f}", r["map"]["n"]] for r in tables])
    saving = []
    for layers in (32, 80):
        for layout in ("per_layer", "compound"):
            warm = next(r for r in tables if (r["layout"], r["layers"], r["cache"]) == (layout, layers, "warm"))
            cold = next(r for r in tables if (r["layout"], r["layers"], r["cache"]) == (layout, layers, "cold"))
            saving.append({"layout": layout, "layers": layers,
                           "remap_warm_us": warm["map"]["median_us"], "remap_cold_us": cold["map"]["median_us"],
                           "saved_us": round(cold["map"]["median_us"] - warm["map"]["median_us"], 1)})
    print_table("   re-map with the handle cache warm vs cold (median µs; saved = create calls skipped)",
                ["layout", "L", "warm", "cold", "saved"],
                [[s["layout"], s["layers"], f"{s['remap_warm_us']:.1f}", f"{s['remap_cold_us']:.1f}",
                  f"{s['saved_us']:.1f}"] for s in saving])

    kv = []
    try:
        import torch  # noqa: F401

        kv = bench_kv_tensors(b, layers=32, total_bytes=117 * GiB, page=page, runs=3 if args.quick else 5)
        print_table("3. create the KV tensors of 32 layers, ~117 GiB virtual, no zero page (reserve + export)",
                    ["layout", "ranges", "virtual GiB", "median ms", "min ms", "runs"],
                    [[r["layout"], r["ranges"], r["virtual_gib"], f"{r['create_ms_median']:.2f}",
                      f"{r['create_ms_min']:.2f}", r["runs"]] for r in kv])
    except ImportError:
        print("\n3. skipped: torch is not installed")

    if args.json:
        out = {"meta": meta, "backend_ops": ops, "page_table": tables, "remap_saving": saving, "kv_tensors": kv}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
