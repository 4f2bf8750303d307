"""Handover: an operator moves memory from an idle instance to a busy one by changing two limits.

Instance A (a process) holds --size mapped and idle (its blocks were freed; the pages stay in its
reserved pool). Instance B (another process) is at its limit (0), retrying alloc in a loop. The
operator (this script) lowers A's limit to 0 and raises B's to --size, then prints a timeline in
ms after the start of the two limit writes: A's answer (applied), A's memory unmapped, and B
having mapped 25/50/75/100% of --size. Target: B has mapped all of it <= 250 ms after the writes.

Both instances use the interleaved layout (one mapping per page id) and pages of 2 MiB per
buffer, with --layers layers: a page id is one mapping of 2 MiB x layers x 2 (K, V).

Run: ``python benchmarks/bench_handover.py [--device cpu|cuda] [--size 40G] [--json PATH]``
(defaults: 40 GiB on cuda, 1 GiB on cpu). Children are killed on any failure or timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

PAGE_MB = 2
BLOCK_SIZE, CELL_SIZE = 16, 8 * 128 * 2        # 16 tokens x 8 KV heads x 128 x bf16: 32 KiB
BLOCK_BYTES = BLOCK_SIZE * CELL_SIZE
MARKS = (25, 50, 75, 100)


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


# -- the instances ------------------------------------------------------------------------------

def _manager(args):
    from kvcached import KVCacheManager, init_kvcached

    init_kvcached(device="cuda:0" if args.device == "cuda" else "cpu")
    num_blocks = args.size // (BLOCK_BYTES * args.layers * 2)
    return KVCacheManager(num_blocks, BLOCK_SIZE, CELL_SIZE, args.layers)


def role_holder(args) -> None:
    """A: map --size, free every block (the pages stay pooled), report when it is all unmapped."""
    m = _manager(args)
    start = time.perf_counter()
    ids = m.alloc(m.num_blocks)
    if ids is None:
        raise SystemExit(f"holder: could not map {args.size} bytes")
    map_ms = (time.perf_counter() - start) * 1e3
    m.free(ids)
    mapped = int(m.get_mapped_memory_size())
    emit({"ready": True, "ipc_name": m.ipc_name, "mapped_bytes": mapped, "map_ms": map_ms,
          "page_bytes": m.page_bytes, "num_pages": m.num_pages})

    def watch() -> None:
        while m.get_mapped_memory_size() > 0:
            time.sleep(0.0002)
        t_ns = time.time_ns()
        while m.memory_limit()["limit_bytes"] != 0:
            time.sleep(0.0002)
        # physical memory A still holds (mapped or cached handles) once its limit is applied
        backend = m._group.page_table.backend.stats()
        emit({"event": "a_unmapped", "t_ns": t_ns, "physical_bytes": backend["physical_bytes"]})

    threading.Thread(target=watch, daemon=True).start()
    sys.stdin.read()
    from kvcached import shutdown_kvcached

    shutdown_kvcached()


def role_taker(args) -> None:
    """B: at limit 0, retry alloc of one page id's blocks until --size is mapped."""
    m = _manager(args)
    m.set_memory_limit(0, revision=1)
    m.trim()
    bpp = m.num_blocks // m.num_pages
    emit({"ready": True, "ipc_name": m.ipc_name, "mapped_bytes": int(m.get_mapped_memory_size())})
    sys.stdin.readline()                         # "start"
    held, marks, failures, retry_s = [], list(MARKS), 0, args.retry_us / 1e6
    total, target = 0, m.num_blocks
    while total < target:
        n = min(bpp * args.chunk_pages, target - total)
        ids = m.alloc(n)
        if ids is None:
            failures += 1
            time.sleep(retry_s)
            continue
        held.append(ids)
        total += n
        mapped = m.get_mapped_memory_size()
        while marks and total * 100 >= marks[0] * target:
            emit({"event": f"b_{marks.pop(0)}", "t_ns": time.time_ns(), "mapped_bytes": int(mapped)})
    emit({"event": "b_done", "t_ns": time.time_ns(), "failed_allocs": failures})
    sys.stdin.read()
    for ids in held:
        m.free(ids)
    from kvcached import shutdown_kvcached

    shutdown_kvcached()


# -- the operator -------------------------------------------------------------------------------

class Child:
    def __init__(self, role: str, name: str, args, extra_env: dict) -> None:
        env = {**os.environ, "PYTHONPATH": REPO, "KVCACHED_IPC_NAME": name,
               "KVCACHED_LAYOUT": "interleaved", "KVCACHED_PAGE_SIZE_MB": str(PAGE_MB),
               "KVCACHED_IDLE_TRIM_S": "0", **extra_env}
        env.pop("KVCACHED_GLOBAL_BUDGET", None)
        self.role, self.name = role, name
        self.popen = subprocess.Popen(
            [sys.executable, __file__, "--role", role, "--device", args.device, "--size", str(args.size),
             "--layers", str(args.layers), "--chunk-pages", str(args.chunk_pages),
             "--retry-us", str(args.retry_us)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
        self.events: dict[str, dict] = {}
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        # A thread per child: select() on a buffered pipe misses lines already read into the
        # buffer, so lines are moved into a queue as they come.
        for line in self.popen.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def read(self, deadline: float) -> dict | None:
        try:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if line is None:
            self.lines.put(None)
            raise RuntimeError(f"{self.role} (pid {self.popen.pid}) exited with status "
                               f"{self.popen.wait()}:\n{self.popen.stderr.read()[-3000:]}")
        record = json.loads(line)
        if "event" in record:
            self.events[record["event"]] = record
        return record

    def poll_events(self) -> None:
        while self.read(time.monotonic()) is not None:
            pass

    def expect(self, key: str, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            record = self.read(deadline)
            if record is None:
                raise TimeoutError(f"{self.role}: no {key!r} within {timeout_s} s")
            if key in record or record.get("event") == key:
                return record

    def send(self, line: str) -> None:
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()

    def end(self) -> None:
        if self.popen.poll() is None:
            try:
                self.popen.stdin.close()
                self.popen.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


def operate(args) -> dict:
    from kvcached.shm.client import read_segment, request_limit

    tag = uuid.uuid4().hex[:6]
    pages = args.size // (PAGE_MB << 20) // 1 + 1
    children: list[Child] = []
    try:
        a = Child("holder", f"handover-A-{tag}", args,
                  {"KVCACHED_MAX_RESERVED_PAGES": str(pages), "KVCACHED_MIN_RESERVED_PAGES": "0"})
        children.append(a)
        b = Child("taker", f"handover-B-{tag}", args, {})
        children.append(b)
        info_a = a.expect("ready", args.timeout)
        info_b = b.expect("ready", args.timeout)
        if info_a["mapped_bytes"] < args.size * 0.99:
            raise RuntimeError(f"A mapped only {info_a['mapped_bytes']} of {args.size} bytes")
        print(f"A mapped {info_a['mapped_bytes'] / 2**30:.2f} GiB in {info_a['map_ms']:.1f} ms "
              f"({info_a['num_pages']} page ids of {info_a['page_bytes'] >> 20} MiB); B at limit 0 "
              f"with {info_b['mapped_bytes']} bytes mapped", file=sys.stderr)
        b.send("start")
        time.sleep(0.2)                                   # B spins at its limit
        t0 = time.time_ns()
        req_a = request_limit(a.name, 0)
        req_b = request_limit(b.name, args.size)
        t_written = time.time_ns()
        deadline = time.monotonic() + args.timeout
        a_applied = None
        while "b_done" not in b.events or a_applied is None or "a_unmapped" not in a.events:
            if time.monotonic() > deadline:
                raise TimeoutError(f"handover not finished within {args.timeout} s: B events "
                                   f"{sorted(b.events)}, A events {sorted(a.events)}, A applied {a_applied}")
            if a_applied is None:
                snap = read_segment(a.name)
                if snap.ack_request_seq >= req_a.request_seq:
                    if snap.ack_status != "applied":
                        raise RuntimeError(f"A answered {snap.ack_status}, not applied: {snap}")
                    a_applied = snap.ack_ns
            a.poll_events()
            b.poll_events()
            time.sleep(0.0005)
        snap_b = read_segment(b.name)
        if snap_b.ack_status != "applied" or snap_b.ack_request_seq < req_b.request_seq:
            raise RuntimeError(f"B's limit request was answered {snap_b.ack_status}")
        ms = lambda t_ns: (t_ns - t0) / 1e6  # noqa: E731
        timeline = [("both limits written", ms(t_written)), ("A applied limit 0", ms(a_applied)),
                    ("A's memory unmapped", ms(a.events["a_unmapped"]["t_ns"]))]
        timeline += [(f"B mapped {p}%", ms(b.events[f"b_{p}"]["t_ns"])) for p in MARKS]
        return {"device": args.device, "size_bytes": args.size, "layers": args.layers,
                "page_id_bytes": info_a["page_bytes"], "num_page_ids": info_a["num_pages"],
                "a_map_ms": info_a["map_ms"], "timeline_ms": dict(timeline),
                "b_failed_allocs": b.events["b_done"]["failed_allocs"],
                "a_physical_bytes_after": a.events["a_unmapped"]["physical_bytes"]}
    finally:
        for child in children:
            child.end()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--size", help="bytes per instance, e.g. 40G (default 40G cuda, 1G cpu)")
    parser.add_argument("--layers", type=int, help="layers (default 32 on cuda, 8 on cpu)")
    parser.add_argument("--chunk-pages", type=int, default=4, help="page ids per alloc call of B")
    parser.add_argument("--retry-us", type=float, default=200, help="B's pause after a refused alloc")
    parser.add_argument("--timeout", type=float, default=50, help="seconds for each phase")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--role", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from kvcached.sizes import parse_size

    args.size = parse_size(args.size or ("40G" if args.device == "cuda" else "1G")) \
        if not str(args.size).isdigit() else int(args.size)
    args.layers = args.layers or (32 if args.device == "cuda" else 8)
    if args.role == "holder":
        role_holder(args)
        return 0
    if args.role == "taker":
        role_taker(args)
        return 0
    if 2 * args.size > 100 << 30:
        parser.error(f"--size {args.size}: A + B would map more than 100 GiB")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run the clean-up in `finally`
    try:
        result = operate(args)
    except Exception as exc:
        print(f"bench_handover: FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"\nhandover of {args.size / 2**30:.2f} GiB on {args.device}: {result['num_page_ids']} page ids "
          f"of {result['page_id_bytes'] >> 20} MiB ({args.layers} layers, interleaved), A mapped it in "
          f"{result['a_map_ms']:.1f} ms\n")
    print("| event (ms after the start of the two limit writes) | ms |\n|---|--:|")
    for event, value in result["timeline_ms"].items():
        print(f"| {event} | {value:.1f} |")
    full = result["timeline_ms"]["B mapped 100%"]
    print(f"\nB had mapped all of it {full:.1f} ms after the writes (target <= 250 ms): "
          f"{'met' if full <= 250 else 'MISSED'}; B's refused allocs meanwhile: {result['b_failed_allocs']}; "
          f"physical memory A still holds after its limit: {result['a_physical_bytes_after'] >> 20} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
