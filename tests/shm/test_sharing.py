"""Sharing one device: real processes running real KVCacheManagers (host backend, real mappings),
under one global budget and under limits an operator changes with kvctl. No mocks.

Every wait polls shared memory until the expected state shows, with a generous timeout that only
turns a hang into a failure; nothing here asserts how fast anything happens (that is
benchmarks/bench_sharing.py's job).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import subprocess
import sys
import time

import pytest

from _procs import ENV, KvtopTerminal, kvctl, run_module, unique_name, wait_until
from kvcached.errors import KVCachedError
from kvcached.limits import I64_MAX
from kvcached.shm import budget as kb
from kvcached.shm.budget import read_budget
from kvcached.shm.client import list_segments, read_segment
from kvcached.sizes import format_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "_sharing_procs.py")
WAIT_S = 30.0           # a hang guard, never a performance bound
MiB = 1 << 20

pytestmark = pytest.mark.usefixtures("shm_clean")


class Manager:
    """A process running one KVCacheManager (tests/shm/_sharing_procs.py), past its ready line."""

    def __init__(self, name: str, *args: str, env: dict | None = None) -> None:
        self.name = name
        environ = {**ENV, "KVCACHED_IPC_NAME": name, "KVCACHED_MIN_RESERVED_PAGES": "2",
                   "KVCACHED_MAX_RESERVED_PAGES": "4", "KVCACHED_IDLE_TRIM_S": "0",
                   **(env or {})}
        self.popen = subprocess.Popen([sys.executable, SCRIPT, "manager", *args], env=environ,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
        self.info: dict = {}

    def wait_ready(self) -> Manager:
        self.info = self.read()
        assert self.info.get("ready"), self.info
        return self

    @property
    def pid(self) -> int:
        return self.popen.pid

    def send(self, command: str) -> None:
        self.popen.stdin.write(command + "\n")
        self.popen.stdin.flush()

    def read(self, timeout_s: float = WAIT_S) -> dict:
        ready, _, _ = select.select([self.popen.stdout], [], [], timeout_s)
        line = self.popen.stdout.readline() if ready else ""
        if not line:
            self.popen.kill()
            _, err = self.popen.communicate()
            raise AssertionError(f"manager {self.name} (pid {self.pid}) gave no answer:\n{err}")
        return json.loads(line)

    def ask(self, command: str, timeout_s: float = WAIT_S) -> dict:
        self.send(command)
        return self.read(timeout_s)

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait(WAIT_S)

    def end(self) -> None:
        """Close stdin (the process shuts kvcached down and exits); kill it if it hangs."""
        if self.popen.poll() is None:
            try:
                self.popen.communicate(input="", timeout=WAIT_S)
            except (subprocess.TimeoutExpired, ValueError, OSError):
                self.popen.kill()
                self.popen.wait()
        else:
            self.popen.communicate()


@pytest.fixture
def managers():
    """start(name, *args, env=...) -> Manager; every process is ended at teardown."""
    started: list[Manager] = []

    def start(name: str, *args: str, env: dict | None = None, wait: bool = True) -> Manager:
        m = Manager(name, *args, env=env)
        started.append(m)
        return m.wait_ready() if wait else m

    yield start
    for m in started:
        m.end()
    for m in started:  # a killed process leaves its segment: remove it
        try:
            if not read_segment(m.name).alive:
                kvctl("gc")
        except KVCachedError:
            pass


def poll(what: str, check, timeout_s: float = WAIT_S):
    """check() until it returns a true value; that value. Fails after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def consistent_sample(budget_name: str, names: list[str]) -> tuple[kb.BudgetSnapshot, dict]:
    """The budget and the instances' published usage, taken so that they can be compared.

    Holding the budget's shared lock stops every acquisition and release (both take it
    exclusively), so each holder's share is frozen; a page is mapped only after its share was
    acquired and released only after it was unmapped, so an instance's mapped memory stays
    within its frozen share. The published figures lag by one publish period, so the sample
    waits until every instance has completed a publish that started after the lock was taken."""
    fd = os.open(kb.budget_path(budget_name), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            snap = read_budget(budget_name)
            start = {n: read_segment(n).usage_seq for n in names}
            fresh = poll("fresh publishes", lambda: all(
                s.usage_seq >= start[s.name] + 3 + (start[s.name] & 1)
                for s in (read_segment(n) for n in names)) and {n: read_segment(n) for n in names})
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    return snap, fresh


def held_by_pid(snap: kb.BudgetSnapshot) -> dict[int, int]:
    return {h.pid: h.held_bytes for h in snap.holders}


@pytest.mark.slow
def test_eight_managers_never_map_more_than_the_budget(managers, budget_name):
    """8 processes allocate and free for ~3 s under a budget of 3/8 of what they could map;
    a sampler checks every instance's mapped memory against its share and the sum against the
    budget. At the end the budget held equals what is mapped, and 0 after close."""
    workers, seconds = 8, 3.0
    env = {"KVCACHED_GLOBAL_BUDGET": budget_name}
    # first_come: the sampler freezes the budget with its shared lock and waits for publishes,
    # which a fair holder's share job, trimming its pool to a new cap, would wait behind
    first = managers(unique_name("bud0"), "--blocks", "1024",
                     env={**env, "KVCACHED_GLOBAL_BUDGET_BYTES": "1",
                          "KVCACHED_GLOBAL_BUDGET_POLICY": "first_come"})
    page_bytes, num_pages = first.info["page_bytes"], first.info["num_pages"]
    budget_bytes = workers * num_pages * page_bytes * 3 // 8
    assert kvctl("budget", budget_name, str(budget_bytes)).returncode == 0
    procs = [first] + [managers(unique_name(f"bud{i}"), "--blocks", "1024", env=env, wait=False)
                       for i in range(1, workers)]
    for p in procs[1:]:
        p.wait_ready()
    names = [p.name for p in procs]
    for i, p in enumerate(procs):
        p.send(f"churn {seconds} {i}")
    samples = 0
    while any(not select.select([p.popen.stdout], [], [], 0)[0] for p in procs):
        snap, segs = consistent_sample(budget_name, names)
        shares = held_by_pid(snap)
        assert snap.held_bytes == sum(shares.values()) <= snap.budget_bytes == budget_bytes, snap
        for seg in segs.values():
            assert seg.mapped_bytes <= shares.get(seg.pid, 0), (seg, snap)
        assert sum(s.mapped_bytes for s in segs.values()) <= budget_bytes
        samples += 1
        time.sleep(0.02)
    results = [p.read() for p in procs]
    assert samples >= 5
    assert all(r["allocs"] > 0 and r["checks"] > 0 for r in results), results
    assert sum(r["refused"] for r in results) > 0, results  # the budget was binding

    # Quiet now (blocks still held, pools refilled as far as the budget allows): every byte the
    # budget counts is mapped by its holder.
    def settled():
        snap, segs = consistent_sample(budget_name, names)
        shares = held_by_pid(snap)
        return all(shares.get(s.pid) == s.mapped_bytes for s in segs.values()) and snap

    snap = poll("budget held == mapped", settled)
    assert snap.held_bytes == sum(read_segment(n).mapped_bytes for n in names) > 0
    for p in procs:
        assert p.ask("close") == {"closed": True}
    snap = read_budget(budget_name)
    assert (snap.held_bytes, snap.holders) == (0, ())


@pytest.mark.slow
def test_sigkilled_manager_is_found_dead_and_its_share_recovered(managers, budget_name):
    """A manager holding most of the budget is SIGKILLed while the others churn: kvctl shows it
    dead, kvctl gc removes its segment and recovers its share, and the others go on and can
    then map what it held."""
    env = {"KVCACHED_GLOBAL_BUDGET": budget_name}
    hog = managers(unique_name("hog"), "--blocks", "1024", env={**env, "KVCACHED_GLOBAL_BUDGET_BYTES": "1"})
    page_bytes, bpp = hog.info["page_bytes"], hog.info["blocks_per_page"]
    assert kvctl("budget", budget_name, str(16 * page_bytes)).returncode == 0
    others = [managers(unique_name(f"oth{i}"), "--blocks", "1024", env=env) for i in range(2)]
    assert hog.ask(f"alloc {10 * bpp}")["ok"]
    for i, p in enumerate(others):
        p.send(f"churn 2.0 {i}")
    time.sleep(0.5)
    hog_share = held_by_pid(read_budget(budget_name))[hog.pid]
    assert hog_share >= 10 * page_bytes
    hog.kill()

    # A gc run by a concurrent test may collect the dead segment at any point from here.
    records = {r["name"]: r for r in json.loads(kvctl("list", "--json").stdout)}
    dead = records.get(hog.name, {"state": "dead", "stale": True})
    assert (dead["state"], dead["stale"]) == ("dead", True)
    assert all(records[p.name]["state"] == "alive" for p in others)
    gc = kvctl("gc")
    assert gc.returncode == 0, gc.stderr
    assert f"removed segment {hog.name} (owner dead)" in gc.stdout or hog.name not in gc.stdout
    with pytest.raises(KVCachedError):
        read_segment(hog.name)
    snap = read_budget(budget_name)
    assert hog.pid not in held_by_pid(snap) and snap.recovered_bytes >= hog_share

    results = [p.read() for p in others]  # the survivors kept going
    assert all(r["allocs"] > 0 for r in results), results
    for p in others:
        p.ask("free_all")
    # With the hog's share back, one survivor can now map more than the budget had left for
    # the two of them while the hog held 10 pages.
    assert poll("the survivor maps the recovered share", lambda: others[0].ask(f"alloc {12 * bpp}")["ok"])
    assert others[0].ask("state")["mapped_bytes"] >= 12 * page_bytes


def seg_state(name: str) -> tuple:
    s = read_segment(name)
    return s.limit_bytes, s.limit_status, s.mapped_bytes


def test_kvctl_limits_reach_a_running_manager(managers):
    """Shrink (pool first, then deferred until live pages empty), regrow (the pool grows back),
    restore the original, 0 (deferred while blocks live; applied and nothing mapped once they
    are freed), each seen by a running manager through `kvctl limit` in a subprocess."""
    name = unique_name("lim")
    m = managers(name, "--blocks", "1024")
    page, bpp, capacity = m.info["page_bytes"], m.info["blocks_per_page"], m.info["num_pages"] * m.info["page_bytes"]
    original = 12 * page
    assert m.ask(f"limit {original} 1")["status"] == "applied"
    assert m.ask(f"alloc {4 * bpp}")["ok"]                  # 4 pages of live blocks
    poll("pool refilled", lambda: seg_state(name) == (original, "applied", 6 * page))

    def limit(size: str) -> str:
        result = kvctl("limit", name, size, "--timeout", str(WAIT_S))
        assert result.returncode == 0, result.stderr
        return result.stdout

    # Shrink below live + pool: the pool goes first, the limit is met at once.
    assert limit(str(5 * page)).startswith(f"{name}: applied ")
    poll("shrunk to 5 pages", lambda: seg_state(name)[:2] == (5 * page, "applied")
         and seg_state(name)[2] <= 5 * page)
    # Shrink below the live pages: deferred, and no page is mapped meanwhile.
    assert limit(str(2 * page)).startswith(f"{name}: deferred ")
    poll("pool emptied", lambda: seg_state(name) == (2 * page, "deferred", 4 * page))
    assert not m.ask(f"alloc {4 * bpp + 1}")["ok"]
    m.ask("free_all")                                       # pages empty: released to the limit
    poll("deferred limit met", lambda: seg_state(name)[:2] == (2 * page, "applied")
         and seg_state(name)[2] <= 2 * page)
    state = m.ask("state")
    assert state["limit"]["status"] == "applied" and state["mapped_bytes"] <= 2 * page
    # Regrow: the pool grows back to its minimum (2 pages).
    assert m.ask(f"alloc {2 * bpp}")["ok"]
    assert limit("75%").startswith(f"{name}: applied ")
    poll("pool grown back", lambda: seg_state(name) == (capacity * 3 // 4, "applied", 4 * page))
    # Restore the original limit.
    assert limit(str(original)).startswith(f"{name}: applied ")
    poll("original limit", lambda: seg_state(name) == (original, "applied", 4 * page))
    assert m.ask(f"alloc {10 * bpp}")["ok"] and not m.ask(f"alloc {bpp}")["ok"]  # 12 pages
    # 0 with live blocks: deferred; freeing them drains everything.
    assert limit("0").startswith(f"{name}: deferred ")
    poll("limit 0 deferred", lambda: seg_state(name) == (0, "deferred", 12 * page))
    m.ask("free_all")
    poll("limit 0 applied", lambda: seg_state(name) == (0, "applied", 0))
    assert not m.ask("alloc 1")["ok"]
    # 0 on an idle pool: applied at once, nothing mapped.
    assert limit(str(original)).startswith(f"{name}: applied ")
    poll("pool back", lambda: seg_state(name) == (original, "applied", 2 * page))
    assert limit("0").startswith(f"{name}: applied ")
    poll("idle pool drained", lambda: seg_state(name) == (0, "applied", 0))
    assert read_segment(name).limit_revision == 8  # 1 (the manager's own) + 7 requests
    # Revisions: stale and conflicting requests change nothing.
    stale = kvctl("limit", name, "1M", "--revision", "3", "--timeout", str(WAIT_S))
    assert stale.returncode == 3 and "stale" in stale.stderr
    assert m.ask(f"limit {page} 8")["status"] == "conflict"
    assert m.ask(f"limit {page} 9")["status"] == "applied"
    assert seg_state(name)[:2] == (page, "applied")
    # `none` removes the limit: the pool grows back and every block can be had again.
    assert limit("none").startswith(f"{name}: applied ")
    poll("limit removed", lambda: seg_state(name) == (-1, "applied", 2 * page))
    assert m.ask(f"alloc {m.info['num_pages'] * bpp}")["ok"]


def test_instance_limit_is_split_across_pools_by_capacity():
    """runtime.set_instance_memory_limit divides one limit across the instance's managers in
    proportion to their capacities; stale and conflicting revisions change none of them."""
    from kvcached import KVCacheManager, init_kvcached, shutdown_kvcached
    from kvcached.runtime import set_instance_memory_limit

    init_kvcached(device="cpu", page_size_bytes=64 << 10)
    try:
        big = KVCacheManager(3072, 16, 64, 2, pool_name="big")       # 48 pages
        small = KVCacheManager(1024, 16, 64, 2, group_id=1, pool_name="small")  # 16 pages
        page = big.page_bytes
        result = set_instance_memory_limit(16 * page, revision=1)
        assert result["status"] == "applied"
        assert [big.memory_limit()["limit_bytes"], small.memory_limit()["limit_bytes"]] == [12 * page, 4 * page]
        if big.ipc_name is not None:
            assert read_segment(big.ipc_name).limit_bytes == 12 * page
        assert set_instance_memory_limit(8 * page, revision=0)["status"] == "stale"
        assert set_instance_memory_limit(8 * page, revision=1)["status"] == "conflict"
        assert small.memory_limit()["limit_bytes"] == 4 * page
        ids = small.alloc(small.available_size())
        assert len(ids) == 4 * 64
        assert set_instance_memory_limit(0, revision=2)["status"] == "deferred"
        small.free(ids)
        assert set_instance_memory_limit(-1, revision=3)["status"] == "applied"
        assert big.memory_limit()["limit_bytes"] == small.memory_limit()["limit_bytes"] == -1
    finally:
        shutdown_kvcached()


@contextlib.contextmanager
def host_runtime_under(monkeypatch, budget_name: str, **settings: str):
    """This process's runtime on the host backend (64 KiB pages, no reserved pool) under the
    global budget ``budget_name`` (plus ``settings``, KVCACHED_ names without the prefix); shut
    down and the environment restored afterwards."""
    from kvcached import config, init_kvcached, shutdown_kvcached

    for name, value in {"GLOBAL_BUDGET": budget_name, **settings, "MIN_RESERVED_PAGES": "0",
                        "MAX_RESERVED_PAGES": "0"}.items():
        monkeypatch.setenv(f"KVCACHED_{name}", value)
    config.reload_settings()
    init_kvcached(device="cpu", page_size_bytes=64 << 10)
    try:
        yield
    finally:
        shutdown_kvcached()
        monkeypatch.undo()
        config.reload_settings()


def test_a_budgeted_manager_holds_no_physical_memory_the_budget_does_not_count(monkeypatch, budget_name):
    """Released handles would sit in the backend's cache, holding device memory the budget has
    already been given back: under a budget the cache is off."""
    from kvcached import KVCacheManager

    with host_runtime_under(monkeypatch, budget_name, GLOBAL_BUDGET_BYTES="16M"):
        m = KVCacheManager(1024, 16, 64, 2)
        backend = m._group.page_table.backend
        for _ in range(3):
            ids = m.alloc(1024)
            assert backend.physical_bytes == read_budget(budget_name).held_bytes > 0
            m.free(ids)
            # free() unmaps at once unless the refill thread holds the map lock: that thread
            # then unmaps the pending pages (within its 10 ms poll)
            wait_until(lambda: backend.physical_bytes == read_budget(budget_name).held_bytes == 0,
                       what="the freed pages to be unmapped and their bytes given back")


def test_segment_shows_applied_when_the_limit_is_met_while_the_watcher_answers():
    """The watcher writes its answer ("deferred") after the manager's apply returned; if the
    blocks are freed in between, the publisher's flip to "applied" must not be lost."""
    from kvcached import KVCacheManager, init_kvcached, shutdown_kvcached
    from kvcached.shm.client import request_limit, wait_for_ack

    init_kvcached(device="cpu", page_size_bytes=64 << 10)
    try:
        m = KVCacheManager(1024, 16, 64, 2)
        if m.ipc_name is None:
            pytest.skip("KVCACHED_TRACKER=0")
        ids = m.alloc(256)
        apply = m._apply_limit
        freed = []

        def apply_then_free(limit_bytes: int, revision: int) -> dict:
            result = apply(limit_bytes, revision)
            assert result["status"] == "deferred"
            m.free(ids)                       # the engine frees its blocks meanwhile
            poll("the publisher's flip", lambda: m.memory_limit()["status"] == "applied")
            freed.append(True)
            return result                     # the watcher now records this stale "deferred"

        m._tracker.start_watcher(apply_then_free)
        ack = wait_for_ack(request_limit(m.ipc_name, 0), timeout_s=WAIT_S)
        assert ack is not None and freed
        poll("segment applied", lambda: read_segment(m.ipc_name).limit_status == "applied")
        assert read_segment(m.ipc_name).mapped_bytes == 0
    finally:
        shutdown_kvcached()


def test_kvtop_in_a_terminal_shows_a_live_manager(managers):
    name = unique_name("top")
    m = managers(name, "--blocks", "1024")
    assert m.ask(f"alloc {3 * m.info['blocks_per_page']}")["ok"]
    used = f"used {3 * m.info['page_bytes'] // 1024}.00 KiB".encode()
    with KvtopTerminal(60, 200) as top:
        screen = top.read_until([name.encode(), used], WAIT_S)
        assert name.encode() in screen and used in screen, screen[-2000:]
        assert top.quit(WAIT_S) == 0
    assert name in {s.name for s in list_segments()}


def sampled(budget_name: str) -> kb.BudgetSnapshot:
    """The budget now, checked: never more held than the budget, the total the slots' sum."""
    snap = read_budget(budget_name)
    assert snap.held_bytes == sum(h.held_bytes for h in snap.holders) <= snap.budget_bytes, snap
    return snap


@pytest.mark.parametrize("weights,late_min_pages,hog_pages", [
    (("1", "1"), 0, 8), (("3", "1"), 0, 12), (("1", "1"), 12, 4)], ids=["equal", "3to1", "minimum"])
def test_fair_budget_moves_memory_to_the_waiting_instance(managers, budget_name, weights,
                                                          late_min_pages, hog_pages):
    """One instance holds the whole budget; another reports demand. The first is capped at its
    fair share (equal weights: half; 3:1: 75 %; the other's minimum of 12 pages: 4 pages), its
    reserved pool goes back at once, over_limit_blocks says how many blocks to free, and once
    it frees them the other maps its share. The budget is never exceeded meanwhile."""
    total = 16
    env = {"KVCACHED_GLOBAL_BUDGET": budget_name}
    hog = managers(unique_name("fhog"), "--blocks", "2048",
                   env={**env, "KVCACHED_GLOBAL_BUDGET_BYTES": "1", "KVCACHED_SHARE_WEIGHT": weights[0]})
    page, bpp = hog.info["page_bytes"], hog.info["blocks_per_page"]
    assert kvctl("budget", budget_name, str(total * page)).returncode == 0
    assert hog.ask(f"alloc {14 * bpp}")["ok"]
    poll("the hog's pool filling the budget", lambda: sampled(budget_name).held_bytes == total * page)
    late = managers(unique_name("flate"), "--blocks", "2048",
                    env={**env, "KVCACHED_SHARE_WEIGHT": weights[1],
                         "KVCACHED_SHARE_MIN": str(late_min_pages * page)})
    assert late.ask(f"demand {total * bpp}")["ok"]

    def hog_capped():
        sampled(budget_name)
        state = hog.ask("share")
        return state["share"]["cap_bytes"] == hog_pages * page and state["reserved_pages"] == 0 and state

    state = poll("the hog capped at its share, its pool given back", hog_capped)
    assert state["share"]["share_bytes"] == hog_pages * page and state["share"]["policy"] == "fair"
    assert state["over"] == (14 - hog_pages) * bpp
    if weights == ("1", "1") and not late_min_pages:     # what kvctl and kvtop show of it
        (record,) = [r for r in json.loads(kvctl("list", "--json").stdout) if r["name"] == hog.name]
        assert [(b["budget"], b["share_bytes"]) for b in record["budgets"]] == [(budget_name, hog_pages * page)]
        frame = run_module("kvcached.cli.kvtop", "--once", "--width", "300").stdout
        (line,) = [ln for ln in frame.splitlines() if ln.startswith(hog.name + " ")]
        assert f"share {format_bytes(hog_pages * page)}" in line, line
    late_share = late.ask("share")["share"]
    assert late_share["share_bytes"] == (total - hog_pages) * page and late_share["demand_bytes"] > 0
    assert hog.ask(f"free_blocks {state['over']}")["held_blocks"] == hog_pages * bpp
    assert poll("the hog within its cap", lambda: sampled(budget_name) and hog.ask("share")["over"] == 0)
    late_pages = total - hog_pages
    poll("the waiting instance maps its share",
         lambda: sampled(budget_name) and late.ask(f"alloc {late_pages * bpp}")["ok"])
    assert late.ask("demand 0")["ok"]
    assert late.ask("share")["mapped_bytes"] >= late_pages * page
    snap = sampled(budget_name)
    assert {h.pid: h.held_bytes for h in snap.holders}[hog.pid] <= hog_pages * page


@pytest.mark.slow
def test_fair_budget_under_churn_is_never_exceeded(managers, budget_name):
    """Four processes allocate and free for ~2 s under a fair budget of a quarter of what they
    could map: caps come and go, every block keeps its stamp, every instance gets memory, and
    the budget is never exceeded at a sampled moment."""
    env = {"KVCACHED_GLOBAL_BUDGET": budget_name}
    first = managers(unique_name("fch0"), "--blocks", "1024",
                     env={**env, "KVCACHED_GLOBAL_BUDGET_BYTES": "1"})
    page, num_pages = first.info["page_bytes"], first.info["num_pages"]
    assert kvctl("budget", budget_name, str(num_pages * page)).returncode == 0
    procs = [first] + [managers(unique_name(f"fch{i}"), "--blocks", "1024", env=env) for i in range(1, 4)]
    for i, p in enumerate(procs):
        p.send(f"churn 2.0 {i}")
    samples = 0
    while any(not select.select([p.popen.stdout], [], [], 0.005)[0] for p in procs):  # until all answered
        sampled(budget_name)
        samples += 1
    results = [p.read() for p in procs]
    assert samples > 0 and all(r["allocs"] > 0 and r["checks"] > 0 for r in results), results
    for p in procs:
        assert p.ask("close") == {"closed": True}
    snap = sampled(budget_name)
    assert (snap.held_bytes, snap.holders) == (0, ())


def test_first_come_budget_caps_nobody(managers, budget_name):
    """Under first_come an instance that holds the budget keeps it whatever others wait for."""
    env = {"KVCACHED_GLOBAL_BUDGET": budget_name}
    hog = managers(unique_name("chog"), "--blocks", "2048",
                   env={**env, "KVCACHED_GLOBAL_BUDGET_BYTES": "1",
                        "KVCACHED_GLOBAL_BUDGET_POLICY": "first_come"})
    page, bpp = hog.info["page_bytes"], hog.info["blocks_per_page"]
    assert kvctl("budget", budget_name, str(16 * page)).returncode == 0
    assert hog.ask(f"alloc {14 * bpp}")["ok"]
    poll("the hog's pool filling the budget", lambda: sampled(budget_name).held_bytes == 16 * page)
    late = managers(unique_name("clate"), "--blocks", "2048", env=env)
    assert late.ask(f"demand {16 * bpp}")["ok"]
    poll("the demand published", lambda: any(h.demand_bytes for h in sampled(budget_name).holders))

    def hog_beat_after(t_ns: int) -> int:
        beat = next(h.heartbeat_ns for h in sampled(budget_name).holders if h.pid == hog.pid)
        return beat if beat > t_ns else 0

    # two share rounds of the hog after the demand showed: the first one completed
    shown = time.time_ns()
    beat = poll("a share round of the hog", lambda: hog_beat_after(shown))
    poll("another share round of the hog", lambda: hog_beat_after(beat))
    state = hog.ask("share")
    assert state["share"]["policy"] == "first_come"
    assert state["share"]["cap_bytes"] == I64_MAX and state["over"] == 0
    assert state["reserved_pages"] == 2
    assert not late.ask(f"alloc {bpp}")["ok"]
    assert sampled(budget_name).held_bytes == 16 * page


def test_refused_allocations_are_demand(monkeypatch, budget_name):
    """Two managers of one process hold two slots of one budget: the one whose alloc is refused
    publishes those blocks as demand without report_demand, and the other is capped at half."""
    from kvcached import KVCacheManager
    from kvcached.errors import KVCachedArgumentError

    with host_runtime_under(monkeypatch, budget_name):
        page = (64 << 10) * 2 * 2                   # a page id maps 2 layers x K, V of 64 KiB
        kb.set_budget(budget_name, 8 * page)
        first = KVCacheManager(1024, 16, 64, 2, pool_name="first")
        assert first.page_bytes == page
        bpp = 1024 // first.num_pages
        second = KVCacheManager(1024, 16, 64, 2, group_id=1, pool_name="second")
        for bad in (-1, 1.5, True, "3"):
            with pytest.raises(KVCachedArgumentError, match="blocks="):
                second.report_demand(bad)
        held = first.alloc(8 * bpp)
        assert held is not None and second.alloc(4 * bpp) is None
        wait_until(lambda: second.share()["demand_bytes"] > 0, what="the refused blocks published")
        wait_until(lambda: first.share()["cap_bytes"] == 4 * page, what="the first capped at half")
        assert first.over_limit_blocks() == 4 * bpp and second.over_limit_blocks() == 0
        assert first.over_limit_pages() == 4 and second.over_limit_pages() == 0
        assert first.alloc(1) is None                               # beyond its cap
        # Half the blocks of every page freed: the blocks fit under the cap, the pages do not.
        by_page: dict[int, list[int]] = {}
        for block, page_id in zip(held, first.pages_of(held)):
            by_page.setdefault(page_id, []).append(block)
        assert len(by_page) == 8 and all(len(blocks) == bpp for blocks in by_page.values())
        first.free([block for blocks in by_page.values() for block in blocks[:bpp // 2]])
        assert first.over_limit_blocks() == 0 and first.over_limit_pages() == 4
        first.free([block for blocks in list(by_page.values())[:4] for block in blocks[bpp // 2:]])
        assert first.over_limit_pages() == 0
        wait_until(lambda: second.alloc(4 * bpp) is not None, what="the second mapping its share")
        assert read_budget(budget_name).held_bytes == 8 * page


def test_share_is_none_without_a_budget():
    from kvcached import KVCacheManager, init_kvcached, shutdown_kvcached

    init_kvcached(device="cpu", page_size_bytes=64 << 10)
    try:
        m = KVCacheManager(1024, 16, 64, 2)
        m.report_demand(3)                      # kept, and no effect
        assert m.share() is None and m.over_limit_blocks() == 0
        m.set_memory_limit(2 * m.page_bytes, revision=1)
        ids = m.alloc(4 * (1024 // m.num_pages))
        assert ids is None or m.over_limit_blocks() == 0
    finally:
        shutdown_kvcached()


def test_demand_beyond_the_holders_own_limit_is_no_demand(monkeypatch, budget_name):
    """An instance held down by its operator limit or its capacity publishes as demand only what
    those would let it take beyond what it holds: the blocks its own limit refuses are no demand
    on the budget, so the other instance is not capped while pages sit free. Demand within them
    still caps the other."""
    from kvcached import KVCacheManager

    with host_runtime_under(monkeypatch, budget_name):
        page = (64 << 10) * 2 * 2                   # a page id maps 2 layers x K, V of 64 KiB
        kb.set_budget(budget_name, 16 * page)
        small = KVCacheManager(256, 16, 64, 2, pool_name="small")        # a capacity of 4 pages
        bpp = 256 // small.num_pages
        assert (small.num_pages, small.page_bytes) == (4, page)
        big = KVCacheManager(1024, 16, 64, 2, group_id=1, pool_name="big")
        assert small.alloc(2 * bpp) is not None
        small.report_demand(8 * bpp)
        wait_until(lambda: small.share()["demand_bytes"] == 2 * page, what="demand clipped to the capacity left")
        assert small.set_memory_limit(2 * page, revision=1)["status"] == "applied"
        assert small.alloc(bpp) is None                                 # refused by its own limit
        wait_until(lambda: small.share()["demand_bytes"] == 0, what="no demand beyond the limit")
        assert big.alloc(8 * bpp) is not None
        wait_until(lambda: big.alloc(6 * bpp) is not None, what="the other instance mapping the free pages")
        assert big.share()["cap_bytes"] == I64_MAX and read_budget(budget_name).held_bytes == 16 * page
        # raised by one page: a page's worth of demand, and the other one is capped for it
        assert small.set_memory_limit(3 * page, revision=2)["status"] == "applied"
        wait_until(lambda: small.share()["demand_bytes"] == page, what="demand up to the raised limit")
        wait_until(lambda: big.share()["cap_bytes"] < I64_MAX, what="the other instance capped")
        assert big.over_limit_blocks() > 0
