"""Tests of kvcached.budget: real processes sharing one budget segment, no mocks."""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import random
import signal
import threading
import time

import pytest

from _procs import Proc, unique_name
from kvcached import budget as kb
from kvcached.budget import Budget, delete_budget, gc_budgets, read_budget, set_budget
from kvcached.errors import KVCachedConfigError, KVCachedError

MiB = 1 << 20


@pytest.fixture
def name():
    name = unique_name("bud")
    yield name
    try:
        delete_budget(name, force=True)
    except KVCachedError:
        pass


def test_acquire_within_budget_only(name):
    with Budget.open(name, budget_bytes=10 * MiB) as b:
        assert b.try_acquire(6 * MiB)
        assert not b.try_acquire(5 * MiB)  # refused, nothing changed
        assert b.held_bytes == 6 * MiB and read_budget(name).held_bytes == 6 * MiB
        assert b.try_acquire(4 * MiB) and b.try_acquire(0)
        assert not b.try_acquire(1)
        b.release(7 * MiB)
        b.check_invariants()
        with pytest.raises(ValueError, match="exceeds the 3145728 bytes"):
            b.release(3 * MiB + 1)
        with pytest.raises(ValueError, match="nbytes=-1"):
            b.try_acquire(-1)
        assert b.held_bytes == 3 * MiB
        b.check_invariants()
    snap = read_budget(name)
    assert (snap.held_bytes, snap.holders) == (0, ())  # close released and freed the slot


def test_open_needs_a_size_to_create(name):
    with pytest.raises(KVCachedConfigError, match=f"no budget named '{name}'"):
        Budget.open(name)
    with pytest.raises(KVCachedConfigError, match="budget_bytes=-1"):
        Budget.open(name, budget_bytes=-1)
    Budget.open(name, budget_bytes=5 * MiB).close()
    with Budget.open(name, budget_bytes=99 * MiB) as b:  # an existing budget keeps its size
        assert b.snapshot().budget_bytes == 5 * MiB


def test_lowering_the_budget_blocks_growth_without_taking_back(name):
    with Budget.open(name, budget_bytes=10 * MiB) as b:
        assert b.try_acquire(8 * MiB)
        assert set_budget(name, 4 * MiB).held_bytes == 8 * MiB
        assert not b.try_acquire(1)
        b.release(5 * MiB)
        assert b.try_acquire(1 * MiB) and not b.try_acquire(1)
        b.check_invariants()


def test_handles_share_one_budget(name):
    with Budget.open(name, 3 * MiB) as a, Budget.open(name) as b:
        assert a.try_acquire(2 * MiB)
        assert not b.try_acquire(2 * MiB)
        a.release(1 * MiB)
        assert b.try_acquire(2 * MiB)
        assert sorted(h.held_bytes for h in read_budget(name).holders) == [1 * MiB, 2 * MiB]
        a.check_invariants()
        b.check_invariants()


def test_closed_handle_refuses(name):
    b = Budget.open(name, MiB)
    b.close()
    b.close()
    with pytest.raises(KVCachedError, match="closed"):
        b.try_acquire(1)


def test_slots_run_out_with_a_clear_error(name):
    handles = [Budget.open(name, MiB) for _ in range(kb.NUM_SLOTS)]
    try:
        with pytest.raises(KVCachedError, match="no free slot"):
            Budget.open(name)
    finally:
        for h in handles:
            h.close()


def test_eight_threads_churn(name):
    """8 threads on 2 handles of this process: the totals stay within the budget and add up."""
    budget_bytes = 4 * MiB
    handles = [Budget.open(name, budget_bytes), Budget.open(name)]
    tallies = [0] * 8
    stop = threading.Event()

    def churn(i: int) -> None:
        rng, handle = random.Random(i), handles[i % 2]
        while not stop.is_set():
            if tallies[i] and rng.random() < 0.5:
                amount = rng.randint(1, tallies[i])
                tallies[i] -= amount
                handle.release(amount)
            elif handle.try_acquire(amount := rng.randint(1, MiB)):
                tallies[i] += amount

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 0.8
    while time.monotonic() < deadline:
        snap = read_budget(name)
        assert snap.held_bytes == sum(h.held_bytes for h in snap.holders) <= budget_bytes
    stop.set()
    for t in threads:
        t.join()
    for i, handle in enumerate(handles):
        assert handle.held_bytes == sum(tallies[i::2])
        handle.check_invariants()
        handle.close()
    assert read_budget(name).held_bytes == 0


def test_sigkilled_holder_is_recovered_by_the_next_acquirer(name):
    set_budget(name, 10 * MiB)
    with Proc("budget-hog", name, str(7 * MiB)) as hog:
        with Budget.open(name) as b:
            assert not b.try_acquire(4 * MiB)
            hog.kill(signal.SIGKILL)
            time.sleep(kb.RECLAIM_EVERY_S)  # this handle scans for dead holders at most so often
            assert b.try_acquire(10 * MiB)
            snap = b.snapshot()
            assert (snap.held_bytes, snap.recovered_bytes) == (10 * MiB, 7 * MiB)
            assert [h.pid for h in snap.holders] == [os.getpid()]
            b.check_invariants()


def test_gc_recovers_dead_holders_and_keeps_live_ones(name):
    set_budget(name, 10 * MiB)
    with Budget.open(name) as mine:
        assert mine.try_acquire(1 * MiB)
        with Proc("budget-hog", name, str(3 * MiB)) as hog:
            hog.kill(signal.SIGKILL)
        assert gc_budgets().get(name) == 3 * MiB
        snap = read_budget(name)
        assert (snap.held_bytes, [h.pid for h in snap.holders]) == (1 * MiB, [os.getpid()])


def test_delete_refused_while_in_use(name):
    with Budget.open(name, MiB):
        with pytest.raises(KVCachedError, match=f"in use by pid\\(s\\) {os.getpid()}"):
            delete_budget(name)
    delete_budget(name)
    with pytest.raises(KVCachedError, match="no budget named"):
        read_budget(name)


def test_eight_processes_never_exceed_the_budget(name):
    """8 processes acquire and release random amounts for ~2 s; one is SIGKILLed midway.

    Each worker shadows what it holds in ``actual`` (raised only after an acquisition succeeded,
    lowered before a release). While the sampler holds the budget's shared flock no acquisition
    can complete, so the shadows must sum to at most the budget: a broken lock would let them
    exceed it."""
    budget_bytes, workers, seconds = 8 * MiB, 8, 2.0
    set_budget(name, budget_bytes)
    actual_path = f"/dev/shm/test-actual-{name}"
    with open(actual_path, "wb") as f:
        f.write(bytes(8 * 64))
    procs = []
    try:
        for i in range(workers):
            procs.append(Proc("budget-worker", name, str(i), actual_path, str(seconds), str(i),
                              str(2 * MiB), wait=False))
        for p in procs:
            p.wait_ready()
        for p in procs:
            p.send("go")
        fd = os.open(kb.budget_path(name), os.O_RDONLY)
        with open(actual_path, "rb") as f:
            actual = memoryview(mmap.mmap(f.fileno(), 8 * 64, prot=mmap.PROT_READ)).cast("q")
        samples, killed_share = 0, None
        start = time.monotonic()
        while any(p.popen.poll() is None for p in procs):
            if killed_share is None and time.monotonic() - start > seconds / 2:
                procs[0].kill(signal.SIGKILL)
                killed_share = sum(h.held_bytes for h in read_budget(name).holders
                                   if h.pid == procs[0].pid)
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                shadow = sum(actual[i] for i in (range(workers) if killed_share is None
                                                 else range(1, workers)))
                snap = read_budget(name)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            assert shadow <= budget_bytes, (shadow, snap)
            assert snap.held_bytes == sum(h.held_bytes for h in snap.holders) <= budget_bytes
            samples += 1
            time.sleep(0.002)
        os.close(fd)
        results = [json.loads(p.finish()[1].strip().splitlines()[-1]) for p in procs[1:]]
    finally:
        for p in procs:
            p.__exit__()
        os.unlink(actual_path)
    assert samples > 20
    assert all(r["acquired"] > 0 for r in results)  # the survivors went on after the kill
    assert sum(r["refused"] for r in results) > 0  # the budget was binding
    with Budget.open(name) as b:  # whatever the killed worker held is recovered now
        assert b.try_acquire(budget_bytes)
        assert b.snapshot().recovered_bytes >= killed_share
        b.release(budget_bytes)
    snap = read_budget(name)
    assert (snap.held_bytes, snap.holders) == (0, ())
