"""Whole processes for the life-cycle tests: what a forked child and a process exit do to a live
KV cache. Run as ``python tests/_lifecycle_roles.py ROLE`` (PYTHONPATH = repository root, the
KVCACHED_* settings in the environment). A role prints ``OK`` as its last line when every check
passed; any failure is a traceback on stderr and a non-zero status.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvcached.shm.budget import read_budget  # noqa: E402
from kvcached import (  # noqa: E402
    KVCachedClosedError,
    KVCachedError,
    KVCacheManager,
    alloc_kv_cache,
    get_kv_cache_manager,
    init_kvcached,
    runtime,
    shutdown_kvcached,
)

PAGE_BYTES = 64 << 10
NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, NUM_LAYERS = 256, 16, 2, 32, 2
CELL_SIZE = HEADS * HEAD_DIM * 4


def make():
    init_kvcached(device="cpu", page_size_bytes=PAGE_BYTES)
    kv = alloc_kv_cache((2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM), BLOCK_SIZE, torch.int32, "cpu", NUM_LAYERS)
    return KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, CELL_SIZE, NUM_LAYERS), kv


def fill(kv, ids) -> None:
    for layer in range(NUM_LAYERS):
        for buffer in range(2):
            for b in ids:
                kv[layer][buffer, b].fill_((b * NUM_LAYERS + layer) * 2 + buffer + 1)


def check(kv, ids) -> None:
    for layer in range(NUM_LAYERS):
        for buffer in range(2):
            for b in ids:
                want = (b * NUM_LAYERS + layer) * 2 + buffer + 1
                got = kv[layer][buffer, b]
                assert bool((got == want).all()), \
                    f"block {b} layer {layer} buffer {buffer} changed: {got.flatten()[:4]}"


def snapshot(m) -> dict:
    """What the parent owns: block states, page counts, mapped page ids, the pool file's blocks."""
    stats = m.stats()
    pages = {k: stats["pages"][k] for k in ("free", "in_use", "reserved", "pending_unmap", "transit", "mapped",
                                            "num_maps", "num_unmaps")}
    budget = os.environ.get("KVCACHED_GLOBAL_BUDGET")
    return {"blocks": m._blocks.block_states().tolist(), "allocated": stats["allocated"], "pages": pages,
            "mapped_ids": m._group.page_table.mapped_page_ids(),
            "pool_file_blocks": os.fstat(runtime.runtime().backend.pool_fd).st_blocks,
            "budget_held": None if budget is None else read_budget(budget).held_bytes}


def child_calls(m, kept_alloc, kept_free, ids) -> list[str]:
    """Every manager call in the child; returns the ones that did not raise KVCachedClosedError."""
    buf = np.zeros(2, np.int32)
    calls = {
        "alloc": lambda: m.alloc(4), "free": lambda: m.free(ids[:2]), "alloc_into": lambda: m.alloc_into(buf),
        "free_from": lambda: m.free_from(np.array(ids[:2], np.int32)), "available_size": m.available_size,
        "try_to_reserve": lambda: m.try_to_reserve(1), "free_reserved": m.free_reserved,
        "resize": lambda: m.resize(0), "trim": m.trim, "clear": m.clear,
        "set_memory_limit": lambda: m.set_memory_limit(0, revision=7), "memory_limit": m.memory_limit,
        "get_mapped_memory_size": m.get_mapped_memory_size, "get_page_occupancy": m.get_page_occupancy,
        "stats": m.stats, "check_invariants": m.check_invariants, "set_stream": lambda: m.set_stream(0),
        "kept alloc": lambda: kept_alloc(4), "kept free": lambda: kept_free(ids[:2]),
        "init_kvcached": lambda: init_kvcached(device="cpu", page_size_bytes=PAGE_BYTES),
        "get_kv_cache_manager": lambda: get_kv_cache_manager(NUM_BLOCKS, BLOCK_SIZE, CELL_SIZE, NUM_LAYERS),
        "alloc_kv_cache": lambda: alloc_kv_cache((2, 8, BLOCK_SIZE, HEADS, HEAD_DIM), BLOCK_SIZE, torch.int32,
                                                 "cpu", NUM_LAYERS, group_id=5),
        "set_instance_memory_limit": lambda: runtime.set_instance_memory_limit(0, revision=9),
    }
    wrong = []
    for name, call in calls.items():
        try:
            call()
        except KVCachedError as exc:
            # the manager and runtime raise KVCachedClosedError; a kept bound method is the
            # Cython allocator's own, which raises its KVCachedError
            if not (isinstance(exc, KVCachedClosedError) or name.startswith("kept")) or "fork" not in str(exc):
                wrong.append(f"{name}: {type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - anything but the closed error is a failure
            wrong.append(f"{name}: {type(exc).__name__}: {exc}")
        else:
            wrong.append(f"{name}: no error")
    return wrong


def role_fork() -> None:
    """The parent writes known data to live blocks, then forks while another thread holds the
    runtime lock. The child tries every manager call and shutdown_kvcached(), makes its own
    kvcached, and exits normally (at-exit handlers run). The parent's data, counters and
    mappings must be exactly as before."""
    m, kv = make()
    ids = m.alloc(200)
    fill(kv, ids)
    m.free(ids[150:])
    ids = ids[:150]
    kept_alloc, kept_free = m.alloc, m.free
    m._pages.stop()                                 # the parent's refill thread would move its counters
    before = snapshot(m)
    holding, release = threading.Event(), threading.Event()

    def hold_runtime_lock() -> None:
        with runtime._lock:
            holding.set()
            release.wait(30)

    holder = threading.Thread(target=hold_runtime_lock)
    holder.start()
    assert holding.wait(30)
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            wrong = child_calls(m, kept_alloc, kept_free, ids)
            assert not wrong, "in the forked child: " + "; ".join(wrong)
            m.close()                               # a no-op in the child
            shutdown_kvcached()                     # forgets the inherited runtime; no hang on the lock
            m2, kv2 = make()                        # the child's own kvcached works
            mine = m2.alloc(10)
            fill(kv2, mine)
            check(kv2, mine)
            status = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        if status:
            os._exit(status)
        sys.exit(0)                                 # a normal exit: atexit and finalisation run
    release.set()
    holder.join()
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child hung")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0, f"child failed: {status}"
    check(kv, ids)
    after = snapshot(m)
    assert after == before, f"the child's exit changed the parent's cache:\n{before}\n{after}"
    m._pages.start()
    m.check_invariants()
    more = m.alloc(m.available_size())              # every other block is still the parent's to hand out
    assert more is not None and not set(more) & set(ids)
    fill(kv, more)
    check(kv, ids + more)
    shutdown_kvcached()
    print("OK")


def role_exit() -> None:
    """A process that never shuts kvcached down: at exit its managers are closed and their
    threads joined before the trackers and budget handles close themselves (no error on stderr).
    A handler registered before the manager runs after kvcached's and reports what it sees."""
    made = []

    def report() -> None:
        threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("kvcached"))
        print(json.dumps({"closed": made[0].closed, "threads": threads}), flush=True)

    atexit.register(report)
    m, kv = make()
    made.append(m)
    ids = m.alloc(100)
    fill(kv, ids)
    m.set_memory_limit(20 * m.page_bytes, revision=3)
    print(json.dumps({"segment": m.ipc_name}))
    print("OK")


if __name__ == "__main__":
    {"fork": role_fork, "exit": role_exit}[sys.argv[1]]()
