"""Costs of the multi-instance layer: what the allocator pays per usage update, how fast an
instance hears of a limit change, and how long an operator waits for ``kvctl list``.

Run: ``python benchmarks/bench_tracker.py`` (from the repository root; adds it to sys.path).
Timings are medians over repeated runs; they include Python start-up where the operator pays it.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from kvcached.shm.budget import Budget, delete_budget  # noqa: E402
from kvcached.shm.client import read_segment, request_limit, wait_for_ack  # noqa: E402
from kvcached.shm.owner import MemInfoTracker  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": REPO}
ROWS: list[tuple[str, str, str]] = []


def row(measure: str, value: str, note: str = "") -> None:
    ROWS.append((measure, value, note))
    print(f"  {measure}: {value} {note}", file=sys.stderr, flush=True)


def best_ns(stmt: str, env: dict, number: int, repeat: int = 5) -> float:
    return min(timeit.repeat(stmt, globals=env, number=number, repeat=repeat)) * 1e9 / number


def bench_hot_path() -> None:
    with MemInfoTracker(f"bench-{uuid.uuid4().hex[:8]}") as tracker:
        empty = best_ns("f(1, 2)", {"f": lambda a, b: None}, 200_000)
        publish = best_ns("p(1, 2)", {"p": tracker.publish}, 20_000)
        row("publish(used, reserved)", f"{publish:.0f} ns",
            f"(fstat + three pwrites; a Python call of two args: {empty:.0f} ns)")
        snap = best_ns("s()", {"s": tracker.snapshot}, 5_000)
        row("tracker.snapshot()", f"{snap / 1000:.1f} us")
        read = best_ns("r(n)", {"r": read_segment, "n": tracker.name}, 2_000)
        row("read_segment(name) (open + three preads)", f"{read / 1000:.1f} us")
    name = f"bench-{uuid.uuid4().hex[:8]}"
    with Budget.open(name, budget_bytes=1 << 40) as budget:
        cycle = best_ns("b.try_acquire(2 << 20); b.release(2 << 20)", {"b": budget}, 5_000)
        row("budget try_acquire + release", f"{cycle / 1000:.1f} us", "(two flocks, two preads, two pwrites each)")
        free = best_ns("f()", {"f": budget.free_bytes}, 200_000)
        row("budget free_bytes()", f"{free:.0f} ns", "(lock-free: one pread)")
    delete_budget(name, force=True)


def spawn_instance(name: str, watch: bool) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--instance", name] + (["--watch"] if watch else []),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=ENV, text=True)
    if proc.stdout.readline().strip() != "READY":
        raise RuntimeError(f"instance {name} did not start")
    return proc


def bench_limit_latency(samples: int = 60) -> None:
    name = f"bench-{uuid.uuid4().hex[:8]}"
    proc = spawn_instance(name, watch=True)
    try:
        notify_ms, round_trip_ms = [], []
        for i in range(samples):
            time.sleep(random.uniform(0.01, 0.03))  # idle instance, random phase of its poll
            start = time.perf_counter()
            request = request_limit(name, (i % 7 + 1) << 30)
            ack = wait_for_ack(request, timeout_s=5, poll_s=0.0002)
            round_trip_ms.append((time.perf_counter() - start) * 1e3)
            notify_ms.append((ack.ack_ns - ack.request_ns) / 1e6)
        for label, values in (("limit request -> recorded by instance", notify_ms),
                              ("kvctl-side round trip (request, wait_for_ack)", round_trip_ms)):
            values.sort()
            row(label, f"{statistics.median(values):.2f} ms",
                f"(p90 {values[int(len(values) * 0.9)]:.2f}, max {values[-1]:.2f} ms; watcher "
                "polls every 5 ms)")
    finally:
        proc.communicate("")


def bench_kvctl_list(instances: int = 16, runs: int = 10) -> None:
    names = [f"bench-{uuid.uuid4().hex[:8]}-{i}" for i in range(instances)]
    procs = [spawn_instance(n, watch=False) for n in names]
    pycache = tempfile.TemporaryDirectory(prefix="kvcached-bench-pyc-")
    # As installed: byte code compiled once (PYTHONDONTWRITEBYTECODE may be set in dev shells).
    installed = {**ENV, "PYTHONPYCACHEPREFIX": pycache.name, "PYTHONDONTWRITEBYTECODE": ""}

    def wall(cmd: list[str], env: dict) -> tuple[float, str]:
        subprocess.run(cmd, env=env, capture_output=True, check=True)  # warm caches
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times), out.stdout

    try:
        baseline, _ = wall([sys.executable, "-c", "pass"], ENV)
        kvctl = [sys.executable, "-m", "kvcached.cli.kvctl", "list"]
        listed, out = wall(kvctl, installed)
        assert all(n in out for n in names)
        row(f"kvctl list, {instances} instances", f"{listed:.0f} ms",
            f"(wall, with interpreter start-up; python -c pass: {baseline:.0f} ms)")
        row(f"kvctl list, {instances} instances, no .pyc", f"{wall(kvctl, ENV)[0]:.0f} ms",
            "(PYTHONDONTWRITEBYTECODE=1: kvcached compiled on every run)")
        as_json, _ = wall(kvctl + ["--json"], installed)
        row(f"kvctl list --json, {instances} instances", f"{as_json:.0f} ms")
        top, _ = wall([sys.executable, "-m", "kvcached.cli.kvtop", "--once"], installed)
        row(f"kvtop --once, {instances} instances", f"{top:.0f} ms")
    finally:
        pycache.cleanup()
        for proc in procs:
            proc.communicate("")


def run_instance(name: str, watch: bool) -> None:
    tracker = MemInfoTracker(name, capacity_bytes=8 << 30, page_size_bytes=2 << 20)
    tracker.publish(1 << 30, 256 << 20)
    if watch:
        tracker.start_watcher(lambda limit, revision: {"status": "applied"})
    print("READY", flush=True)
    sys.stdin.read()
    tracker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instance", help=argparse.SUPPRESS)
    parser.add_argument("--watch", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.instance:
        run_instance(args.instance, args.watch)
        return
    print(f"bench_tracker: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}",
          file=sys.stderr)
    bench_hot_path()
    bench_limit_latency()
    bench_kvctl_list()
    width = max(len(r[0]) for r in ROWS)
    print(f"\n| {'measure':<{width}} | value | note |\n|{'-' * (width + 2)}|--:|---|")
    for measure, value, note in ROWS:
        print(f"| {measure:<{width}} | {value} | {note} |")


if __name__ == "__main__":
    main()
