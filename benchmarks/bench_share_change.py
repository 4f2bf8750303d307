"""How long a share change takes under a fair global budget: two instances, real processes.

    python benchmarks/bench_share_change.py                 # host backend, 20 rounds
    python benchmarks/bench_share_change.py --device cuda   # the same over device memory

Instance A maps the whole budget. At t0 instance B reports demand for half of it
(``KVCacheManager.report_demand``) and from then on tries to allocate it every 0.5 ms. A polls
``over_limit_blocks()`` every 0.5 ms and, once it is capped, frees what it holds beyond the cap
(what an engine's preemption does). Per round: from t0 to A seeing its cap, to A having freed, and
to B holding its half; in milliseconds and in share intervals (a manager publishes its demand and
reads its cap every SHARE_INTERVAL_S). Then B frees and withdraws its demand, and A fills the
budget again for the next round.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

POLL_S = 0.0005
PAGES = 8                       # the budget, in page ids; B asks for half
BLOCK_SIZE, CELL_BYTES, LAYERS = 16, 64, 2
PAGE_BYTES = {"cpu": 64 << 10, "cuda": 2 << 20}     # one KV buffer's page on each backend
TIMEOUT_S = 30.0


def num_blocks(device: str) -> int:
    """Blocks of a cache twice the budget: PAGES page ids are half its pages on either backend."""
    return 2 * PAGES * PAGE_BYTES[device.split(":")[0]] // (BLOCK_SIZE * CELL_BYTES)


def _manager(device: str, budget: str, name: str, group: int):
    os.environ.update({"KVCACHED_GLOBAL_BUDGET": budget, "KVCACHED_MIN_RESERVED_PAGES": "0",
                       "KVCACHED_MAX_RESERVED_PAGES": "0", "KVCACHED_TRACKER": "0"})
    from kvcached import KVCacheManager, config, init_kvcached

    config.reload_settings()
    init_kvcached(device=device, page_size_bytes=PAGE_BYTES[device.split(":")[0]])
    return KVCacheManager(num_blocks(device), BLOCK_SIZE, CELL_BYTES, LAYERS, group_id=group, pool_name=name)


def _until(condition, what: str) -> float:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {TIMEOUT_S} s")
        time.sleep(POLL_S)
    return time.monotonic()


def holder(device: str, budget: str, rounds: int, ready, go, done, times) -> None:
    """Instance A: fill the budget, then per round wait for the cap and free the excess."""
    from kvcached.shm.budget import set_budget

    manager = _manager(device, budget, "a", 0)
    set_budget(budget, PAGES * manager.page_bytes, policy="fair")
    per_page = num_blocks(device) // manager.num_pages
    for _ in range(rounds):
        held: list[int] = []

        def fill() -> bool:
            ids = manager.alloc(per_page)
            held.extend(ids or [])
            return len(held) >= PAGES * per_page
        _until(fill, "A filling the budget")
        ready.set()
        go.wait(TIMEOUT_S)
        capped = _until(lambda: manager.over_limit_blocks() > 0, "A's cap")
        excess = manager.over_limit_blocks()
        manager.free(held[len(held) - excess:])
        del held[len(held) - excess:]
        times.put(("cap", capped))
        times.put(("freed", time.monotonic()))
        done.wait(TIMEOUT_S)
        go.clear()
        manager.free(held)
        done.clear()
    manager.close()


def newcomer(device: str, budget: str, rounds: int, ready, go, done, times) -> None:
    """Instance B: per round report demand for half the budget and allocate it once it can."""
    manager = _manager(device, budget, "b", 1)
    want = PAGES // 2 * (num_blocks(device) // manager.num_pages)
    for _ in range(rounds):
        ready.wait(TIMEOUT_S)
        ready.clear()
        got: list[list[int]] = []
        start = time.monotonic()
        manager.report_demand(want)
        go.set()
        times.put(("start", start))
        times.put(("mapped", _until(lambda: got.append(manager.alloc(want)) or got[-1] is not None, "B's alloc")))
        manager.free(got[-1])
        manager.report_demand(0)
        _until(lambda: manager.share()["demand_bytes"] == 0, "B's demand withdrawn")
        done.set()
    manager.close()


def measure(device: str, rounds: int) -> dict:
    from kvcached.kv_cache_manager import SHARE_INTERVAL_S
    from kvcached.shm.budget import delete_budget, set_budget

    name = f"bench-share-change-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    ready, go, done = ctx.Event(), ctx.Event(), ctx.Event()
    times = ctx.Queue()
    set_budget(name, 1 << 50, policy="fair")        # A sets it to PAGES of its pages
    procs = [ctx.Process(target=role, args=(device, name, rounds, ready, go, done, times))
             for role in (holder, newcomer)]
    try:
        for p in procs:
            p.start()
        events: dict[str, list[float]] = {"start": [], "cap": [], "freed": [], "mapped": []}
        for _ in range(4 * rounds):
            kind, t = times.get(timeout=TIMEOUT_S * 2)
            events[kind].append(t)
        for p in procs:
            p.join(TIMEOUT_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        delete_budget(name, force=True)
    result = {"device": device, "rounds": rounds, "share_interval_ms": SHARE_INTERVAL_S * 1e3}
    for kind in ("cap", "freed", "mapped"):
        ms = sorted((t - s) * 1e3 for t, s in zip(events[kind], events["start"]))
        result[kind] = {"p50_ms": statistics.median(ms), "p99_ms": ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))],
                        "max_ms": ms[-1]}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu (host backend, default) or cuda")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args()
    result = measure("cuda:0" if args.device == "cuda" else args.device, args.rounds)
    interval = result["share_interval_ms"]
    print(f"share change on {result['device']}, {result['rounds']} rounds, share interval {interval:.0f} ms")
    print("| from B's demand to | p50 (ms) | p99 (ms) | max (ms) | p99 in share intervals |")
    print("|---|---:|---:|---:|---:|")
    labels = {"cap": "A capped", "freed": "A freed its excess", "mapped": "B holding its half"}
    for kind, label in labels.items():
        r = result[kind]
        print(f"| {label} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['max_ms']:.1f} | {r['p99_ms'] / interval:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
