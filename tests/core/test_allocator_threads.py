"""8 threads allocating and freeing at once, with the background thread running and an operator
thread trimming and checking: no id is ever live in two places, and nothing is lost at the end."""

import random
import threading

import numpy as np
import pytest

KIB = 1 << 10


def test_eight_threads_churn(stack_factory):
    s = stack_factory(num_pages=64, capacity_granules=48, segments=2, block_bytes=16 * KIB,
                      min_reserved=2, max_reserved=4)
    s.pages.start()
    owner = {}                                   # block id -> thread index
    owner_lock = threading.Lock()
    errors = []
    stop = threading.Event()
    barrier = threading.Barrier(9)

    def worker(index):
        rng = random.Random(index)
        mine = []
        try:
            barrier.wait()
            for _ in range(1500):
                if mine and rng.random() < 0.5:
                    batch = mine.pop(rng.randrange(len(mine)))
                    with owner_lock:
                        for b in batch:
                            assert owner.pop(b) == index
                    if rng.random() < 0.5:
                        s.blocks.free(batch)
                    else:
                        s.blocks.free_from(np.array(batch, dtype=np.int32))
                else:
                    got = s.blocks.alloc(rng.choice((1, 2, 4, 16, 33)))
                    if got is None:
                        continue
                    with owner_lock:
                        for b in got:
                            assert b not in owner, f"block {b} handed to threads {owner[b]} and {index}"
                            owner[b] = index
                    mine.append(got)
            for batch in mine:
                with owner_lock:
                    for b in batch:
                        owner.pop(b)
                s.blocks.free(batch)
        except BaseException as exc:   # reported below
            errors.append(exc)

    def operator():
        barrier.wait()
        n = 0
        while not stop.is_set():
            n += 1
            s.blocks.available_blocks()
            s.blocks.stats()
            if n % 7 == 0:
                s.blocks.trim()
            if n % 11 == 0:
                s.blocks.check_invariants()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    op = threading.Thread(target=operator)
    for t in threads + [op]:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    op.join()
    s.pages.stop()
    assert not errors, errors[0]
    assert owner == {}
    st = s.blocks.stats()
    assert st["allocated"] == 0 and st["owned_pages"] == 0 and st["pages"]["in_use"] == 0
    assert s.pages.last_error is None
    s.blocks.check_invariants()
    s.pages.drain(wait=True)
    assert s.pages.stats()["mapped"] == s.pages.stats()["reserved"]


@pytest.mark.parametrize("mapper", ["alloc", "try_to_reserve"])
def test_free_does_not_wait_behind_another_threads_mapping(stack_factory, mapper):
    """An alloc that maps (here: held up in the budget gate, as it would be in a slow driver
    call) does not hold the allocator's lock: a free, and an alloc served by owned pages, finish
    meanwhile. The gate waits on an event, so nothing depends on timing but a generous bound."""
    s = stack_factory(num_pages=16, capacity_granules=None, block_bytes=16 * KIB, min_reserved=0, max_reserved=0)
    entered, release = threading.Event(), threading.Event()

    def acquire(nbytes):
        entered.set()
        return release.wait(60)

    keep = s.blocks.alloc(6)                     # pages 0 and 1 (4 blocks each), 2 slots free
    s.pages.set_budget_gate(acquire, lambda nbytes: None)
    result = {}
    if mapper == "alloc":
        thread = threading.Thread(target=lambda: result.setdefault("big", s.blocks.alloc(8)))
    else:
        thread = threading.Thread(target=lambda: result.setdefault(
            "big", s.blocks.alloc(8) if s.blocks.try_to_reserve(8) else None))
    thread.start()
    try:
        assert entered.wait(60), "the alloc never reached the gate"
        done = threading.Event()

        def other():
            s.blocks.free(keep[:3])
            result["small"] = s.blocks.alloc(2)
            done.set()

        threading.Thread(target=other, daemon=True).start()
        assert done.wait(30), "a free waited behind another thread's mapping"
        assert not release.is_set() and result["small"] is not None
    finally:
        release.set()
        thread.join(60)
    assert result["big"] is not None and len(result["big"]) == 8
    live = set(keep[3:]) | set(result["small"]) | set(result["big"])
    assert len(live) == 3 + 2 + 8
    s.blocks.check_invariants()
