"""KVCacheManager's life cycle on the host backend: close, shutdown, concurrent construction,
fork, interpreter exit, and bad arguments that must change nothing. Real mappings, real threads,
real processes; no mocks."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from kvcached import KVCacheManager, alloc_kv_cache, init_kvcached, shutdown_kvcached
from kvcached import runtime as rt_mod
from kvcached.errors import KVCachedArgumentError, KVCachedClosedError, KVCachedConfigError, KVCachedError
from kvcached.kv_cache_manager import MAX_LIMIT_BYTES, MAX_REVISION
from kvcached.shm.client import read_segment, request_limit, wait_for_ack
from kvcached.shm.poller import POLLER, THREAD_NAME

from _procs import wait_until
from _stacks import KV_PAGE_BYTES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLES = os.path.join(REPO, "tests", "_lifecycle_roles.py")
DTYPE = torch.int32
NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, NUM_LAYERS = 200, 16, 2, 32, 2
CELL_SIZE = HEADS * HEAD_DIM * DTYPE.itemsize


def start(kv_env, layout="interleaved", num_blocks=NUM_BLOCKS, **env):
    env.setdefault("MIN_RESERVED_PAGES", 0)
    env.setdefault("MAX_RESERVED_PAGES", 2)
    kv_env(LAYOUT=layout, **env)
    init_kvcached(device="cpu", page_size_bytes=KV_PAGE_BYTES)
    return alloc_kv_cache((2, num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM), BLOCK_SIZE, DTYPE, "cpu", NUM_LAYERS)


def manager(num_blocks=NUM_BLOCKS, **kwargs) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, CELL_SIZE, NUM_LAYERS, **kwargs)


def fill(kv, ids, salt=0) -> None:
    for layer in range(NUM_LAYERS):
        for buffer in range(2):
            for b in ids:
                kv[layer][buffer, b].fill_(((b + salt) * NUM_LAYERS + layer) * 2 + buffer + 1)


def check(kv, ids, salt=0) -> None:
    for layer in range(NUM_LAYERS):
        for buffer in range(2):
            for b in ids:
                assert bool((kv[layer][buffer, b] == ((b + salt) * NUM_LAYERS + layer) * 2 + buffer + 1).all()), \
                    f"block {b} layer {layer} buffer {buffer} changed"


def public_calls(m) -> dict:
    """One call of every public method of the manager but close(), with valid arguments."""
    ids = [0, 1]
    calls = {
        "alloc": lambda: m.alloc(1), "free": lambda: m.free(ids),
        "alloc_into": lambda: m.alloc_into(np.zeros(2, np.int32)),
        "free_from": lambda: m.free_from(np.array(ids, np.int32)), "available_size": m.available_size,
        "try_to_reserve": lambda: m.try_to_reserve(1), "free_reserved": m.free_reserved,
        "resize": lambda: m.resize(m.page_bytes), "trim": m.trim, "clear": m.clear,
        "set_memory_limit": lambda: m.set_memory_limit(m.page_bytes, revision=99), "memory_limit": m.memory_limit,
        "get_mapped_memory_size": m.get_mapped_memory_size, "get_page_occupancy": m.get_page_occupancy,
        "stats": m.stats, "check_invariants": m.check_invariants, "set_stream": lambda: m.set_stream(0),
        "report_demand": lambda: m.report_demand(1), "over_limit_blocks": m.over_limit_blocks, "share": m.share,
        "over_limit_pages": m.over_limit_pages, "pages_of": lambda: m.pages_of(ids),
        "plan_compaction": lambda: m.plan_compaction(ids),
    }
    methods = {name for name, _ in inspect.getmembers(KVCacheManager, inspect.isfunction) if not name.startswith("_")}
    assert set(calls) == methods - {"close"}, "a public method is missing from this test"
    return calls


# -- close and shutdown (issue: a closed manager kept working) ------------------------------------

@pytest.mark.parametrize("how", ["close", "shutdown"])
def test_every_method_raises_after_close(kv_env, how):
    start(kv_env)
    m = manager()
    kept = {name: getattr(m, name) for name in ("alloc", "free", "alloc_into", "free_from", "available_size")}
    m.alloc(10)
    m.close() if how == "close" else shutdown_kvcached()
    assert m.closed
    fix = "Make a new one" if how == "close" else "init_kvcached()"
    for name, call in public_calls(m).items():
        with pytest.raises(KVCachedClosedError, match=fix):
            call()
    m.close()                                            # idempotent
    # a bound method taken while it was open raises too: the allocator itself is closed
    for name, call in (("alloc", lambda: kept["alloc"](1)), ("free", lambda: kept["free"]([0])),
                       ("available_size", kept["available_size"]),
                       ("alloc_into", lambda: kept["alloc_into"](np.zeros(1, np.int32)))):
        with pytest.raises(KVCachedError, match="make a new manager"):
            call()


def test_closed_manager_cannot_alias_or_unmap_under_a_newer_one(kv_env):
    """The old manager's alloc (kept by an engine) hands out nothing, its trim unmaps nothing:
    the newer manager's live blocks keep their data."""
    kv = start(kv_env, MAX_RESERVED_PAGES=4)
    old = manager()
    old_alloc, old_trim = old.alloc, old.trim
    old.alloc(50)
    old.close()
    new = manager()
    ids = new.alloc(120)
    fill(kv, ids)
    new.free(ids[60:])                                   # pages in the new manager's pool
    ids = ids[:60]
    for call in (lambda: old_alloc(5), old_trim, lambda: old.alloc(5), old.trim, old.clear):
        with pytest.raises(KVCachedError, match="(?i)make a new"):
            call()
    check(kv, ids)
    new.check_invariants()
    assert new.stats()["allocated"] == 60
    rest = new.alloc(new.available_size())
    assert rest is not None and not set(rest) & set(ids)
    fill(kv, rest, salt=1000)
    check(kv, ids)
    check(kv, rest, salt=1000)


def jobs_of(m) -> list[str]:
    """The manager's jobs (publishing, its tracker's heartbeat and limit requests) on the poller."""
    return [what for what in POLLER.jobs() if what.endswith(f"segment {m.ipc_name}") or
            what.startswith(f"tracker {m.ipc_name}:")]


def publishing(m) -> bool:
    """Whether the manager's publishing job is scheduled and its last round succeeded."""
    return m._publisher.what in POLLER.jobs() and not m._publisher.failing


def test_close_joins_every_thread(kv_env):
    start(kv_env, TRACKER=1, MIN_RESERVED_PAGES=1)
    before = set(threading.enumerate())
    m = manager()
    started = set(threading.enumerate()) - before
    assert [t.name for t in threading.enumerate()].count(THREAD_NAME) == 1
    assert len(jobs_of(m)) == 3, POLLER.jobs()
    m.close()
    alive = [t.name for t in started if t.is_alive()]
    assert not alive, f"threads still running after close(): {alive}"
    assert jobs_of(m) == [] and not m._pages.running


def test_managers_of_a_process_share_one_poller_thread(kv_env):
    """Four managers with trackers run one poller thread between them (not a publisher and a
    watcher thread each), which publishes and answers limit requests for every one of them; closing
    the last manager ends it."""
    start(kv_env, TRACKER=1)
    assert POLLER.jobs() == [], "a job of an earlier test is still scheduled"
    managers = [manager(group_id=g, pool_name=f"p{g}") for g in range(4)]
    (poller,) = [t for t in threading.enumerate() if t.name == THREAD_NAME]
    assert len(POLLER.jobs()) == 3 * len(managers)      # publishing, heartbeat, limit requests each
    for m in managers:
        m.alloc(1)
        ack = wait_for_ack(request_limit(m.ipc_name, 64 * m.page_bytes), timeout_s=30)
        assert ack is not None and ack.ack_status == "applied", ack
        wait_until(lambda: read_segment(m.ipc_name).used_bytes == m.page_bytes,     # published by the poller
                   what=f"the poller to publish {m.ipc_name}")
    for m in managers[:-1]:
        m.close()
        assert jobs_of(m) == [] and poller.is_alive()
    managers[-1].close()
    assert POLLER.jobs() == [] and not poller.is_alive()
    assert THREAD_NAME not in [t.name for t in threading.enumerate()]


# -- concurrent construction ------------------------------------------------------------------

def test_concurrent_construction_has_one_winner(kv_env):
    """Two threads construct a manager of one group at the same moment, many times: one wins,
    the other raises the usual error and touches nothing of the winner's pages."""
    kv = start(kv_env, MIN_RESERVED_PAGES=2, MAX_RESERVED_PAGES=4, TRACKER=1)
    for round_ in range(30):
        barrier = threading.Barrier(2)
        made, errors = [], []

        def construct(i):
            barrier.wait()
            try:
                made.append(manager(pool_name=f"p{i}"))
            except KVCachedConfigError as exc:
                errors.append(exc)

        threads = [threading.Thread(target=construct, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(made) == 1 and len(errors) == 1, (made, errors)
        assert "already has a manager" in str(errors[0])
        winner = made[0]
        assert rt_mod.managers() == [winner]
        ids = winner.alloc(winner.available_size())
        assert len(ids) == NUM_BLOCKS
        fill(kv, ids, salt=round_)
        winner.free(ids[::2])                            # pages emptied: pooled and unmapped
        check(kv, ids[1::2], salt=round_)
        winner.check_invariants()
        winner.close()


# -- fork -----------------------------------------------------------------------------------------

def run_role(role: str, env: dict, timeout_s: float = 120) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    full.update({"PYTHONPATH": REPO, "KVCACHED_LAYOUT": "interleaved", "KVCACHED_MIN_RESERVED_PAGES": "0",
                 "KVCACHED_MAX_RESERVED_PAGES": "2", **env})
    return subprocess.run([sys.executable, ROLES, role], env=full, capture_output=True, text=True,
                          timeout=timeout_s)


@pytest.mark.parametrize("sharing", ["none", pytest.param("tracker", marks=pytest.mark.slow),
                                     pytest.param("budget", marks=pytest.mark.slow)])
def test_forked_child_leaves_the_parent_cache_alone(sharing, budget_name):
    """A child forked while another thread holds the runtime lock: every manager call raises,
    shutdown_kvcached() neither hangs nor touches the parent, the child can start its own
    kvcached, and its normal exit (at-exit handlers, finalisation) leaves the parent's data,
    counters, mappings, pool file and budget share exactly as they were."""
    env = {"KVCACHED_TRACKER": str(int(sharing == "tracker"))}
    if sharing == "budget":
        env.update(KVCACHED_GLOBAL_BUDGET=budget_name, KVCACHED_GLOBAL_BUDGET_BYTES=str(1 << 30))
    done = run_role("fork", env)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout + done.stderr


def test_exit_without_shutdown_cleans_up():
    """At interpreter exit live managers are closed, their threads joined, before the trackers
    close: no error is printed and the segment file is gone."""
    done = run_role("exit", {"KVCACHED_TRACKER": "1", "KVCACHED_MIN_RESERVED_PAGES": "2"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1] == "OK", done.stdout
    assert json.loads(lines[2]) == {"closed": True, "threads": []}, done.stdout
    segment = json.loads(lines[0])["segment"]
    assert not os.path.exists(f"/dev/shm/kvcached.{segment}")


# -- limits: validated first, nothing changed on error --------------------------------------------

BAD_LIMITS = [
    (True, 1), (1.5, 1), (float("nan"), 1), (float("inf"), 1), (np.float64(4096), 1), ("4096", 1), (None, 1),
    (-2, 1), (MAX_LIMIT_BYTES + 1, 1), (10**20, 1), (4096, True), (4096, 1.5), (4096, -1), (4096, 2**63),
    (4096, float("nan")), (4096, None),
]


def limit_state(m) -> tuple:
    state = m.memory_limit()
    return state["status"], state["limit_bytes"], state["revision"]


@pytest.mark.parametrize("tracker", [0, 1])
def test_bad_limits_change_nothing(kv_env, tracker):
    start(kv_env, TRACKER=tracker, MIN_RESERVED_PAGES=1)
    m = manager()
    ids = m.alloc(50)
    assert m.set_memory_limit(np.int64(40 * m.page_bytes), revision=np.int32(3))["status"] == "applied"
    state = m.memory_limit()
    assert (state["limit_bytes"], state["revision"]) == (40 * m.page_bytes, 3)
    assert type(state["limit_bytes"]) is int and type(state["revision"]) is int
    limit_state_before = limit_state(m)
    limit_pages = m._pages.limit_pages
    recorded = m._tracker.recorded_limit() if tracker else None
    for limit, revision in BAD_LIMITS:
        with pytest.raises(KVCachedArgumentError) as info:
            m.set_memory_limit(limit, revision=revision)
        assert f"limit_bytes={limit!r}" in str(info.value) or f"revision={revision!r}" in str(info.value), info.value
        assert limit_state(m) == limit_state_before, (limit, revision)    # mapped bytes move with the refill
        assert m._pages.limit_pages == limit_pages
        if tracker:
            assert m._tracker.recorded_limit() == recorded
            assert publishing(m), f"the publisher stopped after set_memory_limit({limit!r}, {revision!r})"
    # the largest values are accepted; the page limit is clamped to the table
    assert m.set_memory_limit(MAX_LIMIT_BYTES, revision=MAX_REVISION - 1)["status"] == "applied"
    assert m._pages.limit_pages == m._group.page_table.num_pages
    assert m.set_memory_limit(-1, revision=MAX_REVISION)["status"] == "applied"
    assert m.alloc(m.available_size()) is not None
    m.free(ids)


def test_instance_limit_validated_first(kv_env):
    start(kv_env)
    m = manager()
    before = limit_state(m)
    for limit, revision in BAD_LIMITS:
        with pytest.raises(KVCachedArgumentError):
            rt_mod.set_instance_memory_limit(limit, revision=revision)
        assert limit_state(m) == before
    result = rt_mod.set_instance_memory_limit(np.int64(3 * m.page_bytes), revision=np.int64(2))
    assert result["status"] == "applied" and m.memory_limit()["revision"] == 2


def test_publisher_survives_a_failing_publish(kv_env, caplog):
    """One failed publish is logged; the thread goes on and publishes again once it works."""
    start(kv_env, TRACKER=1)
    m = manager()
    tracker = m._tracker
    real_publish = tracker.publish
    calls = {"failed": 0, "after": 0}
    recovered = threading.Event()

    def flaky(used, reserved):
        if calls["failed"] < 3:
            calls["failed"] += 1
            raise OSError("segment went away")
        calls["after"] += 1
        recovered.set()
        return real_publish(used, reserved)

    tracker.publish = flaky
    assert recovered.wait(30), "publishing never resumed"
    deadline = time.monotonic() + 30
    while "works again" not in caplog.text:
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.01)
    assert publishing(m)
    assert caplog.text.count("publishing to segment") == 2, caplog.text     # once failing, once recovered
    tracker.publish = real_publish


# -- bad arguments everywhere ---------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda m: m.try_to_reserve(True), "n=True"),
    (lambda m: m.try_to_reserve(2.0), "n=2.0"),
    (lambda m: m.resize(True), "new_mem_size=True"),
    (lambda m: m.resize(float(1 << 20)), "new_mem_size=1048576.0"),
    (lambda m: m.resize(-1), "new_mem_size=-1"),
    (lambda m: m.get_mapped_memory_size(None), "unit=None is unknown"),
    (lambda m: m.get_mapped_memory_size("tb"), "unit='tb' is unknown"),
    (lambda m: m.set_stream(True), "stream=True"),
    (lambda m: m.set_stream(-1), "stream=-1"),
])
def test_bad_arguments_change_nothing(kv_env, call, match):
    start(kv_env)
    m = manager()
    m.alloc(30)
    before = (m.stats(), m._blocks.block_states().tolist())
    with pytest.raises(KVCachedArgumentError, match=match):
        call(m)
    assert (m.stats(), m._blocks.block_states().tolist()) == before


def test_bools_are_not_counts(kv_env):
    """alloc(True), free([True]) and alloc_into of a bool buffer are refused, not taken as 1."""
    start(kv_env)
    m = manager()
    before = m.stats()
    with pytest.raises(TypeError, match="True"):
        m.alloc(True)
    ids = m.alloc(2)
    assert 1 in ids or 0 in ids
    with pytest.raises(TypeError, match="True"):
        m.free([True])
    with pytest.raises(TypeError):
        m.alloc_into(np.zeros(2, np.bool_))
    m.free(ids)
    assert m.stats()["allocated"] == before["allocated"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_blocks=True), "num_blocks=True"), (dict(block_size=16.0), "block_size=16.0"),
    (dict(num_layers=True), "num_layers=True"), (dict(cell_size=np.float32(256)), "cell_size="),
    (dict(pp_rank=-1), "pp_rank=-1"), (dict(world_size=1.0), "world_size=1.0"),
    (dict(async_sched=True), "async_sched=True is not supported"), (dict(pool_name=3), "pool_name=3"),
    (dict(group_id=True), "group_id=True"),
])
def test_constructor_refuses(kv_env, kwargs, match):
    start(kv_env)
    args = dict(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, cell_size=CELL_SIZE, num_layers=NUM_LAYERS)
    args.update(kwargs)
    with pytest.raises(KVCachedConfigError, match=match):
        KVCacheManager(**args)
    assert rt_mod.managers() == []
    manager()


def test_two_groups_under_one_ipc_name_say_pool_name(kv_env):
    start(kv_env, TRACKER=1, IPC_NAME=f"lifecycle-{os.getpid()}")
    alloc_kv_cache((2, 50, BLOCK_SIZE, HEADS, HEAD_DIM), BLOCK_SIZE, DTYPE, "cpu", NUM_LAYERS, group_id=1)
    first = manager()
    with pytest.raises(KVCachedConfigError, match="pass a distinct pool_name"):
        manager(num_blocks=50, group_id=1)
    assert rt_mod.managers() == [first]
    second = manager(num_blocks=50, group_id=1, pool_name="draft")
    assert second.ipc_name == f"lifecycle-{os.getpid()}.draft" and first.ipc_name == f"lifecycle-{os.getpid()}"


def test_debug_checks_setting_is_honoured(kv_env):
    start(kv_env, DEBUG_CHECKS=1)
    m = manager()
    assert m._blocks.debug_checks is True
    m.free(m.alloc(10))


# -- global budget ---------------------------------------------------------------------------------

def test_null_block_under_a_budget_closes_cleanly(kv_env, budget_name):
    """The null block's page is mapped through the budget gate, so close() gives back exactly
    what was taken (it used to be mapped before the gate existed, and close() raised)."""
    from kvcached.shm.budget import read_budget

    start(kv_env, GLOBAL_BUDGET=budget_name, GLOBAL_BUDGET_BYTES=1 << 30)
    m = manager(reserve_null_block=True)
    assert read_budget(budget_name).held_bytes == m.page_bytes
    ids = m.alloc(20)
    m.free(ids)
    m.close()
    assert read_budget(budget_name).held_bytes == 0


def test_available_size_counts_the_budget(kv_env, budget_name):
    """With the global budget as the binding constraint, alloc(available_size()) succeeds and
    alloc(available_size() + 1) returns None, while other holders take and give back bytes."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from kvcached.shm.budget import Budget, set_budget

    kv = start(kv_env, GLOBAL_BUDGET=budget_name, GLOBAL_BUDGET_BYTES=1 << 30, MAX_RESERVED_PAGES=1)
    m = manager()
    other = Budget.open(budget_name)
    pb = m.page_bytes
    try:
        @settings(max_examples=40, deadline=None)
        @given(budget_pages=st.integers(0, 12), taken_by_other=st.integers(0, 12),
               limit_pages=st.none() | st.integers(0, 12), live=st.integers(0, 60))
        def run(budget_pages, taken_by_other, limit_pages, live):
            m.clear()
            m.trim()
            m.set_memory_limit(-1 if limit_pages is None else limit_pages * pb,
                               revision=m.memory_limit()["revision"] + 1)
            set_budget(budget_name, (budget_pages + taken_by_other) * pb + pb // 3)
            held = m.alloc(min(live, m.available_size()))
            other.try_acquire(taken_by_other * pb)          # may not fit: then the budget binds anyway
            try:
                a = m.available_size()
                assert m.alloc(a + 1) is None
                ids = m.alloc(a)
                assert ids is not None and len(ids) == a, (a, m.stats()["pages"])
                assert m.available_size() == 0
                fill(kv, ids[:3] + held[:3])
                m.free(ids)
            finally:
                other.release(other.held_bytes)
            m.free(held)
            m.check_invariants()

        run()
    finally:
        other.close()
