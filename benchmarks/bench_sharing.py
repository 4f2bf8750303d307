"""Costs of sharing one device, measured through real KVCacheManagers.

(a) alloc(16)+free through KVCacheManager with the tracker on vs off (KVCACHED_TRACKER=1/0),
    in one process, the two settings interleaved run by run (target: <= 5% overhead);
(b) limit change -> applied, for an idle instance in another process: the operator writes the
    request and polls the segment until the instance's answer shows "applied" (target: <= 100 ms);
(c) `kvctl list` wall time with 16 live instances, interpreter start included (target: <= 200 ms).

Run: ``python benchmarks/bench_sharing.py [--device cpu|cuda] [--json PATH]`` from the repository
root. Prints a table (stdout) and progress (stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

ENV = {**os.environ, "PYTHONPATH": REPO}
# Geometry of every manager here: 4 layers, blocks of 16 tokens x 8 heads x 64 x fp16 (16 KiB).
NUM_LAYERS, BLOCK_SIZE, CELL_SIZE, NUM_BLOCKS = 4, 16, 8 * 64 * 2, 4096
ROWS: list[dict] = []


def row(measure: str, value: str, target: str = "", note: str = "", **data) -> None:
    ROWS.append({"measure": measure, "value": value, "target": target, "note": note, **data})
    print(f"  {measure}: {value} {note}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))]


def _init(device: str) -> None:
    from kvcached import init_kvcached

    init_kvcached(device="cuda:0" if device == "cuda" else "cpu")


# -- (a) the fast path with the tracker on and off --------------------------------------------

def _fast_path_us(device: str, tracker: bool, ops: int) -> float:
    from kvcached import KVCacheManager, shutdown_kvcached
    from kvcached import config

    os.environ["KVCACHED_TRACKER"] = "1" if tracker else "0"
    config.reload_settings()
    _init(device)
    try:
        m = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, CELL_SIZE, NUM_LAYERS)
        assert (m.ipc_name is not None) == tracker
        alloc, free = m.alloc, m.free
        for _ in range(2000):  # warm: the pool holds the pages, the tracker has published
            free(alloc(16))
        time.sleep(0.05)
        start = time.perf_counter()
        for _ in range(ops):
            free(alloc(16))
        return (time.perf_counter() - start) / ops * 1e6
    finally:
        shutdown_kvcached()


def bench_fast_path(device: str, rounds: int, ops: int) -> None:
    saved = os.environ.get("KVCACHED_TRACKER")
    on, off = [], []
    try:
        for r in range(rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            for tracker in order:
                (on if tracker else off).append(_fast_path_us(device, tracker, ops))
    finally:
        if saved is None:
            os.environ.pop("KVCACHED_TRACKER", None)
        else:
            os.environ["KVCACHED_TRACKER"] = saved
        from kvcached import config

        config.reload_settings()
    m_on, m_off = statistics.median(on), statistics.median(off)
    overhead = (m_on / m_off - 1) * 100
    row("alloc(16)+free, tracker off", f"{m_off:.2f} us", note=f"median of {rounds} runs of {ops}",
        runs_us=off)
    row("alloc(16)+free, tracker on", f"{m_on:.2f} us", note=f"median of {rounds} runs of {ops}",
        runs_us=on)
    row("tracker overhead on the fast path", f"{overhead:+.1f} %", "<= 5 %",
        "runs interleaved on/off; publisher every 10 ms + watcher every 5 ms", overhead_pct=overhead)


# -- instances in other processes ---------------------------------------------------------------

def spawn(name: str, device: str, extra_env: dict | None = None) -> subprocess.Popen:
    env = {**ENV, "KVCACHED_IPC_NAME": name, "KVCACHED_IDLE_TRIM_S": "0", **(extra_env or {})}
    return subprocess.Popen([sys.executable, __file__, "--role", "instance", "--device", device],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)


def wait_ready(proc: subprocess.Popen, timeout_s: float = 120) -> dict:
    import select

    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("{"):
        proc.kill()
        raise RuntimeError(f"instance pid {proc.pid} did not start (got {line!r})")
    return json.loads(line)


def end(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                proc.stdin.close()
            except OSError:
                pass
    deadline = time.monotonic() + 20
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_instance(device: str) -> None:
    """An idle instance: a manager holding a few live blocks and its reserved pool."""
    from kvcached import KVCacheManager, shutdown_kvcached

    _init(device)
    m = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, CELL_SIZE, NUM_LAYERS)
    ids = m.alloc(16)
    print(json.dumps({"ipc_name": m.ipc_name, "page_bytes": m.page_bytes,
                      "capacity_bytes": m.num_pages * m.page_bytes}), flush=True)
    sys.stdin.read()
    m.free(ids)
    shutdown_kvcached()


# -- (b) limit change -> applied --------------------------------------------------------------

def bench_limit_latency(device: str, samples: int) -> None:
    from kvcached.shm.client import read_segment, request_limit

    name = f"bench-share-{uuid.uuid4().hex[:8]}"
    proc = spawn(name, device)
    try:
        info = wait_ready(proc)
        page, capacity = info["page_bytes"], info["capacity_bytes"]
        # alternate between a limit that cuts the pool (applied once the pool is unmapped) and
        # the full capacity (applied at once; the pool grows back meanwhile)
        limits = (page, capacity)
        applied_ms, acked_ms = [], []
        for i in range(samples):
            time.sleep(0.02 + 0.01 * (i % 3))          # idle; random phase of the watcher's poll
            start_ns = time.time_ns()
            request = request_limit(name, limits[i % 2])
            deadline = time.monotonic() + 10
            while True:
                snap = read_segment(name)
                if (snap.ack_request_seq >= request.request_seq and snap.limit_status == "applied"
                        and snap.limit_revision == request.revision):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"limit {limits[i % 2]} not applied within 10 s: {snap}")
                time.sleep(0.0002)
            applied_ms.append((time.time_ns() - start_ns) / 1e6)
            acked_ms.append((snap.ack_ns - start_ns) / 1e6)
    finally:
        end([proc])
    for label, values, target in (("limit write -> applied seen in the segment", applied_ms, "<= 100 ms"),
                                  ("limit write -> instance's answer recorded", acked_ms, "")):
        row(label, f"{statistics.median(values):.2f} ms", target,
            f"p90 {pct(values, 0.9):.2f}, max {max(values):.2f} ms over {len(values)} changes "
            "(idle instance; watcher polls every 5 ms)",
            p50_ms=statistics.median(values), p90_ms=pct(values, 0.9), max_ms=max(values))


# -- (c) kvctl list with 16 instances ---------------------------------------------------------

def bench_kvctl_list(device: str, instances: int, runs: int) -> None:
    names = [f"bench-share-{uuid.uuid4().hex[:6]}-{i:02d}" for i in range(instances)]
    procs = []
    pycache = tempfile.TemporaryDirectory(prefix="kvcached-bench-pyc-")
    # As installed: byte code compiled once (a dev shell may set PYTHONDONTWRITEBYTECODE).
    installed = {**ENV, "PYTHONPYCACHEPREFIX": pycache.name, "PYTHONDONTWRITEBYTECODE": ""}
    try:
        for n in names:
            procs.append(spawn(n, device))
        for proc in procs:
            wait_ready(proc)

        def wall(cmd: list[str]) -> tuple[list[float], str]:
            subprocess.run(cmd, env=installed, capture_output=True, check=True, timeout=60)
            times, out = [], ""
            for _ in range(runs):
                start = time.perf_counter()
                out = subprocess.run(cmd, env=installed, capture_output=True, text=True, check=True,
                                     timeout=60).stdout
                times.append((time.perf_counter() - start) * 1e3)
            return times, out

        base, _ = wall([sys.executable, "-c", "pass"])
        listed, out = wall([sys.executable, "-m", "kvcached.cli.kvctl", "list"])
        missing = [n for n in names if n not in out]
        if missing:
            raise RuntimeError(f"kvctl list did not show {missing}")
        row(f"kvctl list, {instances} live instances", f"{statistics.median(listed):.0f} ms", "<= 200 ms",
            f"wall, interpreter start included (max {max(listed):.0f} ms; python -c pass: "
            f"{statistics.median(base):.0f} ms)", p50_ms=statistics.median(listed), max_ms=max(listed))
    finally:
        end(procs)
        pycache.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--rounds", type=int, default=10, help="(a): runs per setting")
    parser.add_argument("--ops", type=int, default=100_000, help="(a): alloc+free per run")
    parser.add_argument("--samples", type=int, default=50, help="(b): limit changes")
    parser.add_argument("--instances", type=int, default=16, help="(c): live instances")
    parser.add_argument("--role", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "instance":
        run_instance(args.device)
        return 0
    print(f"bench_sharing: device {args.device}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}",
          file=sys.stderr)
    bench_fast_path(args.device, args.rounds, args.ops)
    bench_limit_latency(args.device, args.samples)
    bench_kvctl_list(args.device, args.instances, runs=10)
    width = max(len(r["measure"]) for r in ROWS)
    print(f"\n| {'measure':<{width}} | value | target | note |\n|{'-' * (width + 2)}|--:|--:|---|")
    for r in ROWS:
        print(f"| {r['measure']:<{width}} | {r['value']} | {r['target']} | {r['note']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "cpus": os.cpu_count(), "rows": ROWS}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
