"""Lifecycle of the compiled core: a closed allocator refuses everything, and a forked child can
neither use nor tear down what it inherited (Note [Fork and close] in core/vmm.pyx).

Real processes: the fork tests run a fresh interpreter that builds a stack, writes a pattern into
its blocks, forks, and lets the child try everything (its exit, at-exit handlers included), then
checks in the parent that every block still reads what it wrote and the pool memfd lost nothing.
"""

from __future__ import annotations

import pytest

from kvcached.errors import KVCachedError

from _backends import run_child
from _stacks import make_stack


def _methods_of_blocks(s, ids):
    return {
        "alloc": lambda: s.blocks.alloc(1),
        "alloc_into": lambda: s.blocks.alloc_into(bytearray(4)),
        "free": lambda: s.blocks.free(ids[:1]),
        "free_from": lambda: s.blocks.free_from(bytearray(4)),
        "available_blocks": lambda: s.blocks.available_blocks(),
        "try_to_reserve": lambda: s.blocks.try_to_reserve(1),
        "free_reserved": lambda: s.blocks.free_reserved(),
        "clear": lambda: s.blocks.clear(),
        "resize": lambda: s.blocks.resize(4),
        "trim": lambda: s.blocks.trim(),
        "page_occupancy": lambda: s.blocks.page_occupancy(),
    }


def _methods_of_pages(s):
    return {
        "take": lambda: s.pages.take(1),
        "available_pages": lambda: s.pages.available_pages(),
        "set_limit_pages": lambda: s.pages.set_limit_pages(3),
        "set_pool_bounds": lambda: s.pages.set_pool_bounds(0, 1),
        "set_idle_trim": lambda: s.pages.set_idle_trim(1.0),
        "set_budget_gate": lambda: s.pages.set_budget_gate(None, None),
        "resize": lambda: s.pages.resize(4),
        "trim": lambda: s.pages.trim(),
        "drain": lambda: s.pages.drain(),
        "refresh_physical": lambda: s.pages.refresh_physical(),
        "start": lambda: s.pages.start(),
    }


def test_closed_block_allocator_refuses_every_method_and_unmapped_everything():
    s = make_stack(num_pages=16, capacity_granules=None, max_reserved=4)
    acquired, released = [], []
    s.pages.set_budget_gate(lambda n: acquired.append(n) or True, released.append)
    s.pages.start()
    ids = s.blocks.alloc(9)
    assert s.blocks.try_to_reserve(3)
    assert s.table.num_mapped > 0
    s.blocks.close()
    assert s.blocks.lifecycle == s.pages.lifecycle == "closed"
    assert not s.pages.running
    assert s.table.num_mapped == 0, "close() must unmap every page it mapped"
    assert sum(acquired) == sum(released), "the budget gate got back every byte"
    for name, call in {**_methods_of_blocks(s, ids), **_methods_of_pages(s)}.items():
        with pytest.raises(KVCachedError, match="is closed; .*new manager") as info:
            call()
        assert "forked" not in str(info.value), name
    stats = s.blocks.stats()                              # the final figures still answer
    assert stats["allocated"] == stats["held"] == 0 and stats["pages"]["in_use"] == 0
    s.blocks.check_invariants()
    s.blocks.close()                                      # idempotent
    s.pages.close()
    # the table itself is still open: another allocator over it can map again
    assert s.table.lifecycle == "live"


def test_block_allocator_close_under_a_waiting_caller_hands_out_nothing():
    """A call that passed the closed check before close() ran waits for the lock, then finds the
    allocator closed: no block handed out, no page mapped after close."""
    import threading

    s = make_stack(num_pages=16, capacity_granules=None, max_reserved=2)
    s.blocks.alloc(3)
    results = []
    start = threading.Barrier(9)

    def caller():
        start.wait()
        for _ in range(200):
            try:
                results.append(s.blocks.alloc(5))
            except KVCachedError as exc:
                results.append(exc)
                return

    threads = [threading.Thread(target=caller) for _ in range(8)]
    for t in threads:
        t.start()
    start.wait()
    s.blocks.close()
    for t in threads:
        t.join(60)
    assert s.table.num_mapped == 0
    assert isinstance(results[-1], KVCachedError) or all(not isinstance(r, KVCachedError) for r in results)
    s.blocks.check_invariants()


_FORK_SCRIPT = r"""
import atexit, ctypes, gc, os, sys
sys.path.insert(0, "tests")
from _stacks import make_stack
from kvcached import core
from kvcached.errors import KVCachedError

s = make_stack(num_pages=16, capacity_granules=None, segments=2, min_reserved=2, max_reserved=4)
s.pages.start()
ids = s.blocks.alloc(20)
pages = sorted({p for p in range(16) if s.table.is_mapped(p)})
g = s.backend.granularity

def fill_pattern():
    for p in pages:
        for i, a in enumerate(s.table.segment_addresses(p)):
            ctypes.memset(a, (p * 7 + i * 3 + 1) % 251, g)

def pattern_ok():
    return all(ctypes.string_at(a, g) == bytes([(p * 7 + i * 3 + 1) % 251]) * g
               for p in pages for i, a in enumerate(s.table.segment_addresses(p)))

fill_pattern()
pool_blocks = os.fstat(s.backend.pool_fd).st_blocks
MODE = sys.argv[1] if len(sys.argv) > 1 else "{mode}"
pid = os.fork()
if pid == 0:
    code = 0
    try:
        assert core.fork_generation() == 1
        assert s.blocks.lifecycle == s.pages.lifecycle == s.table.lifecycle == "forked"
        calls = {
            "alloc": lambda: s.blocks.alloc(1), "free": lambda: s.blocks.free(ids[:4]),
            "available_blocks": lambda: s.blocks.available_blocks(), "clear": lambda: s.blocks.clear(),
            "trim": lambda: s.blocks.trim(), "stats": lambda: s.blocks.stats(),
            "check_invariants": lambda: s.blocks.check_invariants(),
            "take": lambda: s.pages.take(1), "set_limit_pages": lambda: s.pages.set_limit_pages(0),
            "pages.trim": lambda: s.pages.trim(), "resize": lambda: s.pages.resize(0),
            "table.map": lambda: s.table.map([15]), "table.unmap": lambda: s.table.unmap(pages[:1]),
            "acquire": lambda: s.backend.acquire(g), "release_cached": lambda: s.backend.release_cached(),
            "create": lambda: s.backend.create(g), "range.free": lambda: s.ranges[0].free(),
        }
        for name, call in calls.items():
            try:
                call()
            except KVCachedError as exc:
                assert "unusable in a forked child" in str(exc) and "after fork" in str(exc), (name, exc)
            else:
                print("not refused:", name, flush=True)
                code = 3
        if MODE == "atexit":
            # the child's exit runs these, as an engine's at-exit shutdown would
            atexit.register(s.table.close)
            atexit.register(s.blocks.close)
        else:
            s.blocks.close(); s.pages.stop(); s.pages.close(); s.table.close()
            del calls
            s.__dict__.clear()
            gc.collect()
    except BaseException as exc:
        print("child failed:", repr(exc), flush=True)
        code = 4
    sys.stdout.flush()
    if MODE == "atexit":
        sys.exit(code)        # a normal exit: atexit handlers and garbage collection run
    os._exit(code)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
print("pattern", pattern_ok())
print("pool", os.fstat(s.backend.pool_fd).st_blocks == pool_blocks)
print("mapped", all(s.table.is_mapped(p) for p in pages))
more = s.blocks.alloc(10)
fill_pattern()
print("alloc", more is not None and pattern_ok())
s.blocks.free(ids)
s.blocks.check_invariants()
print("invariants", True)
"""


@pytest.mark.parametrize("mode", ["explicit", "atexit"])
def test_forked_child_refuses_everything_and_leaves_the_parent_cache_untouched(mode):
    result = run_child(_FORK_SCRIPT.replace("{mode}", mode))
    detail = f"rc={result.returncode}\nstdout={result.stdout}\nstderr={result.stderr[-3000:]}"
    assert result.returncode == 0, detail
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    assert lines.get("child") == "0", detail
    assert lines.get("pattern") == "True", "the child changed the parent's blocks\n" + detail
    assert lines.get("pool") == "True", "the child punched holes in the shared pool memfd\n" + detail
    assert lines.get("mapped") == "True", detail
    assert lines.get("alloc") == "True" and lines.get("invariants") == "True", detail


_FORK_UNDER_A_MAPPER = r"""
import os, sys, threading, time
sys.path.insert(0, "tests")
from _stacks import make_stack
from kvcached.errors import KVCachedError

s = make_stack(num_pages=16, capacity_granules=None)
stop = threading.Event()

def mapper():                      # holds the table's lock most of the time
    while not stop.is_set():
        s.table.map(list(range(8, 16)))
        s.table.unmap(list(range(8, 16)))

thread = threading.Thread(target=mapper)
thread.start()
hung = 0
for _ in range(60):
    pid = os.fork()
    if pid == 0:
        try:
            s.table.map([5])
        except KVCachedError:
            os._exit(0)
        os._exit(3)
    deadline = time.monotonic() + 10           # the child needs milliseconds
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0, status
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            hung += 1
            break
        time.sleep(0.001)
stop.set()
thread.join()
print("hung", hung)
"""


def test_forked_child_raises_even_when_the_parent_held_the_table_lock():
    """A fork while the parent's thread holds the page table's lock: the child's map must raise
    (forked), not wait for a lock nobody in the child will release (it hung in ~1 of 6 runs of
    the test above)."""
    result = run_child(_FORK_UNDER_A_MAPPER, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hung 0" in result.stdout, result.stdout + result.stderr[-2000:]
