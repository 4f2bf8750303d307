"""kvcached's own threads block the signals meant for the application (kvcached._threads).

The kernel hands a process-directed signal to any thread that does not block it; one taken by a
kvcached thread would not wake the main thread out of a blocking call. Read off /proc, each
thread's blocked set must hold SIGINT, SIGTERM and SIGHUP, and not SIGSEGV.
"""

from __future__ import annotations

import signal
import threading

from kvcached.shm.owner import MemInfoTracker

from _procs import unique_name
from test_kv_cache_manager import make


def blocked_signals(thread: threading.Thread) -> set[int]:
    with open(f"/proc/self/task/{thread.native_id}/status") as status:
        mask = int(next(line for line in status if line.startswith("SigBlk:")).split()[1], 16)
    return {signum for signum in range(1, 65) if mask >> (signum - 1) & 1}


def kvcached_threads() -> dict[str, threading.Thread]:
    return {t.name: t for t in threading.enumerate() if t.name.startswith("kvcached")}


def test_the_poller_and_refill_threads_block_the_applications_signals(kv_env):
    m, _ = make(kv_env, min_reserved=1, max_reserved=2)
    with MemInfoTracker(unique_name("sig"), capacity_bytes=1 << 20):
        m.free(m.alloc(1))                                      # activity starts the refill thread
        threads = kvcached_threads()
        assert {"kvcached-poller", "kvcached-page-allocator"} <= set(threads), threads
        for name, thread in threads.items():
            assert {signal.SIGINT, signal.SIGTERM, signal.SIGHUP} <= blocked_signals(thread), name
            assert signal.SIGSEGV not in blocked_signals(thread), name   # its own faults still show
    assert signal.SIGINT not in blocked_signals(threading.current_thread())   # the creator's as before
