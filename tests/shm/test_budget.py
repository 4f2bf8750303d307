"""Tests of kvcached.shm.budget: real processes sharing one budget segment, no mocks."""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import random
import shutil
import signal
import struct
import subprocess
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _procs import Proc, kvctl, unique_name, wait_until
from kvcached.errors import KVCachedClosedError, KVCachedConfigError, KVCachedError
from kvcached.limits import I64_MAX
from kvcached.shm import budget as kb
from kvcached.shm.budget import format as budget_format
from kvcached.shm.budget import (
    Budget,
    delete_budget,
    gc_budgets,
    read_budget,
    remove_broken_budgets,
    scan_budgets,
    set_budget,
)
from kvcached.shm.poller import POLLER, THREAD_NAME

MiB = 1 << 20

pytestmark = pytest.mark.usefixtures("shm_clean")


@pytest.fixture
def name(budget_name):
    return budget_name


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
            # this handle scans for dead holders at most every RECLAIM_EVERY_S
            wait_until(lambda: b.try_acquire(10 * MiB), what="the dead holder's share")
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
        gc_budgets()  # (a concurrent test's gc may come first: the budget's own count tells)
        snap = read_budget(name)
        assert (snap.held_bytes, [h.pid for h in snap.holders]) == (1 * MiB, [os.getpid()])
        assert snap.recovered_bytes == 3 * MiB


def test_delete_refused_while_in_use(name):
    with Budget.open(name, MiB):
        with pytest.raises(KVCachedError, match=f"in use by pid\\(s\\) {os.getpid()}"):
            delete_budget(name)
    delete_budget(name)
    with pytest.raises(KVCachedError, match="no budget named"):
        read_budget(name)


@pytest.mark.slow
def test_eight_processes_never_exceed_the_budget(name):
    """8 processes acquire and release random amounts for ~2 s; one is SIGKILLed midway.

    Each worker shadows what it holds in ``actual`` (raised only after an acquisition succeeded,
    lowered before a release). While the sampler holds the budget's shared flock no acquisition
    can complete, so the shadows must sum to at most the budget: a broken lock would let them
    exceed it. The total is the sum of the slots, except while the killed worker's slot is
    still there: killed between its two writes (Note [The total is the sum of the slots] in
    kvcached.shm.budget) it leaves the two apart until a reclaim recounts, the total then still
    at least what the others hold."""
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
            assert snap.held_bytes <= budget_bytes, snap
            others = sum(h.held_bytes for h in snap.holders if h.pid != procs[0].pid)
            if killed_share is not None and any(h.pid == procs[0].pid for h in snap.holders):
                assert others <= snap.held_bytes, snap
            else:
                assert snap.held_bytes == sum(h.held_bytes for h in snap.holders), snap
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


# -- integers, as every entry point takes them ---------------------------------------------------

def test_sizes_take_numpy_integers_and_refuse_bools_floats_and_overflow(name):
    for bad in (True, 1.5, float("nan"), 1 << 63, -1, "5"):
        with pytest.raises(KVCachedConfigError, match="budget_bytes="):
            Budget.open(name, budget_bytes=bad)
        with pytest.raises(KVCachedConfigError, match="budget_bytes="):
            set_budget(name, bad)
    assert not os.path.exists(kb.budget_path(name))  # nothing was created
    with Budget.open(name, budget_bytes=np.int64(4 * MiB)) as b:
        assert b.try_acquire(np.int32(MiB)) and b.held_bytes == MiB
        for bad in (True, 1.0, -1, 1 << 63):
            with pytest.raises(ValueError, match="nbytes="):
                b.try_acquire(bad)
            with pytest.raises(ValueError, match="nbytes="):
                b.release(bad)
        b.release(np.uint8(1))
        b.check_invariants()
    for bad in (0.1, float("inf"), True, "1"):
        with pytest.raises(KVCachedConfigError, match="stale_after_s="):
            set_budget(name, MiB, stale_after_s=bad)


# -- free_bytes ------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["acquire", "release", "resize"]),
                                st.integers(0, 1), st.integers(0, 6 * MiB)), max_size=30))
def test_free_bytes_is_what_the_budget_has_left(steps):
    name = unique_name("free")
    try:
        with Budget.open(name, 4 * MiB) as a, Budget.open(name) as b:
            handles, budget_bytes = (a, b), 4 * MiB
            for op, which, amount in steps:
                handle = handles[which]
                if op == "acquire":
                    handle.try_acquire(amount)
                elif op == "release":
                    handle.release(min(amount, handle.held_bytes))
                else:
                    budget_bytes = amount
                    set_budget(name, amount)
                held = a.held_bytes + b.held_bytes
                assert a.free_bytes() == b.free_bytes() == max(0, budget_bytes - held)
                # what free_bytes promises can be taken, while nothing changes in between
                free = a.free_bytes()
                assert a.try_acquire(free)
                a.release(free)
    finally:
        delete_budget(name, force=True)


def test_free_bytes_takes_no_lock_and_refuses_a_closed_handle(name):
    b = Budget.open(name, 8 * MiB)
    assert b.try_acquire(3 * MiB)
    fd = os.open(kb.budget_path(name), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another holder inside its critical section
        answer = []
        reader = threading.Thread(target=lambda: answer.append(b.free_bytes()))
        reader.start()
        reader.join(30)
        assert answer == [5 * MiB]  # answered while the flock was held
    finally:
        os.close(fd)
    b.close()
    with pytest.raises(KVCachedClosedError, match="closed"):
        b.free_bytes()


# -- a holder killed between its two writes ------------------------------------------------------

@pytest.mark.parametrize("op", ["acquire", "release"])
def test_holder_killed_between_slot_and_total_leaks_nothing(name, op):
    set_budget(name, 10 * MiB)
    with Budget.open(name) as mine:
        assert mine.try_acquire(1 * MiB)
        with Proc("budget-die-midway", name, str(4 * MiB), op, str(2 * MiB), wait=False) as doomed:
            status = doomed.popen.wait(30)
        assert status == -signal.SIGKILL  # died between the two writes
        gc_budgets()
        snap = read_budget(name)
        assert snap.held_bytes == sum(h.held_bytes for h in snap.holders) == 1 * MiB
        assert mine.free_bytes() == 9 * MiB
        assert mine.try_acquire(9 * MiB)  # nothing of the dead holder is left counted
        mine.check_invariants()


# -- heartbeats: reclaiming holders of other pid namespaces -----------------------------------------

_UNSHARE = ("unshare", "--user", "--map-root-user", "--pid", "--fork")


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run([*_UNSHARE, "true"], capture_output=True, check=False).returncode == 0


def _child_pid(pid: int) -> int:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return int(f.read().split()[0])


def _heartbeat_age_s(name: str, pid: int) -> float:
    holder = next(h for h in read_budget(name).holders if h.pid == pid)
    return (time.time_ns() - holder.heartbeat_ns) / 1e9


@pytest.mark.slow
@pytest.mark.skipif(not _can_unshare(), reason="no unprivileged user and pid namespaces here")
def test_foreign_holder_is_reclaimed_only_once_its_heartbeat_stops(name):
    """A holder in another pid namespace (another container): kept while it beats, reclaimed once
    its heartbeat is older than the budget's stale_after_s."""
    stale_s = 1.5  # a loaded machine must not starve the foreign holder's beat that long
    set_budget(name, 10 * MiB, stale_after_s=stale_s)
    with Proc("budget-hog", name, str(6 * MiB), prefix=_UNSHARE) as hog:
        python = _child_pid(hog.pid)
        (foreign,) = read_budget(name).holders
        assert foreign.pid == 1 and foreign.alive  # pid 1 of its own namespace
        with Budget.open(name) as mine:
            start = time.monotonic()
            while time.monotonic() - start < 2 * stale_s:  # it beats: never reclaimed
                assert not mine.try_acquire(5 * MiB)
                assert gc_budgets().get(name, 0) == 0
                time.sleep(0.01)
            os.kill(python, signal.SIGSTOP)  # its heartbeat stops; /proc cannot tell
            try:
                wait_until(lambda: mine.try_acquire(5 * MiB), what="the stalled holder's reclaim")
                snap = mine.snapshot()
                assert (snap.held_bytes, snap.recovered_bytes) == (5 * MiB, 6 * MiB)
                assert [h.pid for h in snap.holders] == [os.getpid()]
                mine.check_invariants()
            finally:
                os.kill(python, signal.SIGKILL)


def test_live_holder_of_this_namespace_is_never_reclaimed(name):
    """A stopped holder whose heartbeat is long stale is still alive by /proc: kept."""
    set_budget(name, 10 * MiB, stale_after_s=kb.MIN_STALE_AFTER_S)
    with Proc("budget-hog", name, str(6 * MiB)) as hog:
        os.kill(hog.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: _heartbeat_age_s(name, hog.pid) > 3 * kb.MIN_STALE_AFTER_S,
                  what="a stale heartbeat")
            assert gc_budgets().get(name, 0) == 0
            with Budget.open(name) as mine:
                assert not mine.try_acquire(5 * MiB)
            (held,) = [h for h in read_budget(name).holders if h.pid == hog.pid]
            assert held.alive and held.held_bytes == 6 * MiB
        finally:
            os.kill(hog.pid, signal.SIGCONT)


def test_the_poller_beats_while_a_handle_is_open(name):
    set_budget(name, MiB, stale_after_s=kb.MIN_STALE_AFTER_S)
    with Budget.open(name) as b:
        first = read_budget(name).holders[0].heartbeat_ns
        wait_until(lambda: read_budget(name).holders[0].heartbeat_ns > first, what="a beat")
        (thread,) = [t for t in threading.enumerate() if t.name == THREAD_NAME]
        assert f"budget {name}: slot {b._slot}'s heartbeat" in POLLER.jobs()
        b.try_acquire(1)
    assert not [what for what in POLLER.jobs() if what.startswith(f"budget {name}:")]
    if not POLLER.jobs():  # no other job in this process: the last cancel joined the thread
        assert not thread.is_alive()


# -- no /proc under the flock ---------------------------------------------------------------------

def test_no_proc_read_while_the_flock_is_held(name, monkeypatch):
    """Every /proc judgement of a holder (owner_alive) runs while nobody holds the flock: a
    non-blocking LOCK_EX on a fresh descriptor succeeds at that moment."""
    held_during = []
    real = budget_format.owner_alive

    def spy(pid, start, pid_ns):
        fd = os.open(kb.budget_path(name), os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held_during.append(pid)
        finally:
            os.close(fd)
        return real(pid, start, pid_ns)

    set_budget(name, 8 * MiB)
    monkeypatch.setattr(budget_format, "owner_alive", spy)
    handles = [Budget.open(name)]
    try:
        with Proc("budget-hog", name, str(6 * MiB)) as hog:
            hog.kill(signal.SIGKILL)
        assert handles[0].try_acquire(4 * MiB)  # short: reclaims the dead holder first
        with Proc("budget-hog", name, str(1 * MiB)) as hog:
            hog.kill(signal.SIGKILL)
        while len(handles) < kb.NUM_SLOTS - 1:  # every slot taken, the dead one's included
            handles.append(Budget.open(name))
        handles.append(Budget.open(name))  # no free slot: reclaims the dead holder's
        with pytest.raises(KVCachedError, match="no free slot"):
            Budget.open(name)  # scans again, finds only live holders
        read_budget(name)
        gc_budgets()
        assert read_budget(name).recovered_bytes == 7 * MiB
    finally:
        for h in handles:
            h.close()
    assert held_during == []


# -- a budget file changed by another program ----------------------------------------------------

@pytest.mark.parametrize("change", ["truncate", "scribble"])
def test_holder_survives_its_budget_file_being_truncated_or_overwritten(name, change):
    """The holder reads and writes the file with pread/pwrite: a truncated file is an error it
    reports (it died of SIGBUS before), an overwritten one too; release and close still work."""
    set_budget(name, 8 * MiB)
    path = kb.budget_path(name)
    with Proc("budget-outlive", name, str(2 * MiB)) as holder:
        if change == "truncate":
            os.truncate(path, 0)
        else:
            with open(path, "r+b") as f:
                f.write(b"\x1b[2J")
        holder.send("go")
        line = holder.readline(timeout_s=30)
        status, _, err = holder.finish()
    assert status == 0, err
    report = json.loads(line)
    assert report["free_bytes"] == (0 if change == "truncate" else report["free_bytes"])
    assert "no budget any more" in report.get("acquire_error", "") or (
        "not a kvcached budget" in report.get("acquire_error", ""))
    assert report["held_after_release"] == 0
    assert err.count("stops counting against it") == 1  # one warning


# -- a corrupt budget file: listed, removed by gc and by delete --force --------------------------

def _corrupt(path: str, how: str) -> None:
    """Change a budget file as another program could."""
    if how == "empty":
        os.truncate(path, 0)
    elif how == "short header":
        os.truncate(path, 20)
    elif how == "truncated slots":  # magic and version intact
        os.truncate(path, kb.SEGMENT_BYTES - 1)
    elif how == "scribbled":
        with open(path, "r+b") as f:
            f.write(b"\x1b[2J")
    elif how == "zeroed":
        os.truncate(path, 0)
        os.truncate(path, kb.SEGMENT_BYTES)
    else:  # "other version": a budget another kvcached wrote
        with open(path, "r+b") as f:
            f.seek(4)
            f.write(struct.pack("=I", kb.VERSION + 1))


CORRUPTIONS = ["empty", "short header", "truncated slots", "scribbled", "zeroed"]


@pytest.mark.parametrize("how", [*CORRUPTIONS, "other version"])
def test_delete_force_removes_whatever_file_has_the_name(name, how):
    """Every message about an unreadable budget says `--delete --force`: it must work, even though
    the file cannot be read (it read the budget first, and failed with the same message)."""
    set_budget(name, MiB)
    path = kb.budget_path(name)
    _corrupt(path, how)
    with pytest.raises(KVCachedError, match="--delete --force"):
        read_budget(name)
    with pytest.raises(KVCachedError, match="--delete --force"):
        delete_budget(name)  # refused without --force, nothing removed
    if os.path.exists(path) or how == "other version":  # (or a concurrent test's gc removed it)
        delete_budget(name, force=True)
    assert not os.path.exists(path)
    with pytest.raises(KVCachedError, match=f"no budget named {name!r}"):
        delete_budget(name, force=True)


def test_delete_force_removes_a_budget_in_use(name):
    with Budget.open(name, MiB) as holder:
        assert holder.try_acquire(1)
        delete_budget(name, force=True)
        assert not os.path.exists(kb.budget_path(name))


def test_gc_removes_corrupt_budgets_and_keeps_every_other():
    """gc removes the files at budget names that no kvcached can read as a budget, and says why;
    it keeps a budget in use and a budget of another layout version (not its to judge)."""
    broken = {how: unique_name("broken") for how in CORRUPTIONS}
    live, other = unique_name("live"), unique_name("v3")
    try:
        for how, n in broken.items():
            set_budget(n, MiB)
            _corrupt(kb.budget_path(n), how)
        set_budget(other, MiB)
        _corrupt(kb.budget_path(other), "other version")
        with Budget.open(live, MiB) as holder:
            assert holder.try_acquire(MiB // 2)
            scanned = dict(scan_budgets())
            for n in broken.values():  # reported, not hidden (unless a concurrent gc took it)
                assert isinstance(scanned.get(n, KVCachedError()), KVCachedError), scanned.get(n)
            assert isinstance(scanned[other], KVCachedError)
            assert scanned[live].held_bytes == MiB // 2
            removed = remove_broken_budgets().removed
            for n in broken.values():
                assert not os.path.exists(kb.budget_path(n))
                assert "not a kvcached budget" in removed.get(n, "not a kvcached budget"), removed
            assert other not in removed and os.path.exists(kb.budget_path(other))
            assert live not in removed and holder.try_acquire(MiB // 2)
            holder.check_invariants()
    finally:
        for n in (*broken.values(), live, other):
            try:
                delete_budget(n, force=True)
            except KVCachedError:
                pass


# -- fair sharing (segment version 3) ---------------------------------------------------------

def _word(name: str, offset: int) -> int:
    with open(kb.budget_path(name), "rb") as f:
        f.seek(offset)
        return struct.unpack("=q", f.read(8))[0]


def _poke(name: str, offset: int, value: int) -> None:
    fd = os.open(kb.budget_path(name), os.O_RDWR)
    try:
        os.pwrite(fd, struct.pack("=q", value), offset)
    finally:
        os.close(fd)


def _slot_offset(slot: int, field: int) -> int:
    return kb.SLOTS_OFFSET + slot * kb.SLOT_BYTES + 8 * field


def test_v3_fields_round_trip(name):
    """What set_budget, Budget.open, set_share and set_demand write is where the layout table
    says, and what snapshots and to_dict read back."""
    snap = set_budget(name, 10 * MiB, policy="first_come")
    assert (snap.policy, _word(name, 64)) == ("first_come", 0)
    assert set_budget(name, 10 * MiB).policy == "first_come"        # unchanged unless given
    with Budget.open(name, weight=2.5, min_bytes=MiB) as b:
        assert _word(name, _slot_offset(b.slot, 7)) == 2500             # weight_milli
        assert _word(name, _slot_offset(b.slot, 8)) == MiB              # min_bytes
        assert _word(name, _slot_offset(b.slot, 9)) == I64_MAX          # cap: none yet
        b.set_demand(3 * MiB)
        assert _word(name, _slot_offset(b.slot, 6)) == 3 * MiB
        b.set_share(0.5, 2 * MiB)
        (h,) = b.snapshot().holders
        assert (h.weight, h.min_bytes, h.demand_bytes, h.cap_bytes) == (0.5, 2 * MiB, 3 * MiB, I64_MAX)
        assert h.share_bytes == 3 * MiB                                 # all it wants
        record = read_budget(name).to_dict()
        assert record["policy"] == "first_come"
        assert {"weight", "min_bytes", "demand_bytes", "share_bytes", "cap_bytes"} <= set(record["holders"][0])
        b.check_invariants()
    assert kb.set_policy(name, "fair").policy == "fair" and _word(name, 64) == 1


def test_new_budgets_are_fair_and_bad_shares_are_refused(name):
    assert set_budget(name, MiB).policy == kb.DEFAULT_POLICY == "fair"
    for bad in (0, -1, float("nan"), float("inf"), 0.0001, True, "1", 2e6):
        with pytest.raises(KVCachedConfigError, match="weight="):
            Budget.open(name, weight=bad)
    with Budget.open(name) as b:
        with pytest.raises(KVCachedConfigError, match="weight="):
            b.set_share(0, 0)
        with pytest.raises(KVCachedConfigError, match="min_bytes"):
            b.set_share(1, -1)
        with pytest.raises(ValueError, match="nbytes"):
            b.set_demand(-1)
    with pytest.raises(KVCachedConfigError, match="policy="):
        kb.set_policy(name, "fifo")
    with pytest.raises(KVCachedConfigError, match="policy="):
        set_budget(name, MiB, policy="FAIR")


def test_a_holder_is_capped_at_its_share_only_while_another_waits(name):
    """Two handles (two holders): the one holding everything is capped at its fair share once
    the other publishes demand, refused beyond it, and uncapped when the demand goes, or under
    first_come."""
    set_budget(name, 10 * MiB)
    with Budget.open(name) as hog, Budget.open(name) as late:
        assert hog.try_acquire(10 * MiB) and hog.cap_bytes() == I64_MAX
        late.set_demand(8 * MiB)
        assert hog.cap_bytes() == 5 * MiB and late.cap_bytes() == I64_MAX
        shares = {h.slot: h.share_bytes for h in hog.snapshot().holders}
        assert shares == {hog.slot: 5 * MiB, late.slot: 5 * MiB}
        assert _word(name, _slot_offset(hog.slot, 9)) == 5 * MiB       # published for kvctl
        hog.release(6 * MiB)                                             # below its cap now
        assert not hog.try_acquire(2 * MiB)                              # past its cap
        assert late.try_acquire(5 * MiB)                                 # the freed bytes go here
        assert hog.try_acquire(MiB)                                      # up to its cap
        assert not hog.try_acquire(1)
        late.set_demand(0)
        assert hog.cap_bytes() == I64_MAX
        late.set_demand(MiB)
        kb.set_policy(name, "first_come")
        assert hog.cap_bytes() == I64_MAX
        hog.check_invariants()
        late.check_invariants()


def test_set_holder_share_by_pid(name):
    set_budget(name, 8 * MiB)
    with Proc("budget-demand", name, str(8 * MiB)) as other, Budget.open(name) as mine:
        assert mine.try_acquire(8 * MiB)
        assert mine.cap_bytes() == 4 * MiB
        snap = kb.set_holder_share(name, other.pid, weight=3)
        assert {h.pid: h.weight for h in snap.holders} == {other.pid: 3.0, os.getpid(): 1.0}
        assert mine.cap_bytes() == 2 * MiB                               # 3:1
        kb.set_holder_share(name, os.getpid(), min_bytes=6 * MiB)
        assert mine.cap_bytes() == 6 * MiB                               # its minimum first
        with pytest.raises(KVCachedError, match=f"pid {2**22 + 7}"):
            kb.set_holder_share(name, 2**22 + 7, weight=1)
        with pytest.raises(KVCachedConfigError, match="weight="):
            kb.set_holder_share(name, other.pid, weight=-1)
        with pytest.raises(KVCachedConfigError, match="give weight"):
            kb.set_holder_share(name, other.pid)
        mine.check_invariants()


@pytest.mark.parametrize("field,value", [
    ("weight", -5), ("weight", 0), ("weight", I64_MAX), ("min", -1), ("min", I64_MAX),
    ("demand", -7), ("demand", I64_MAX), ("cap", -1), ("policy", 99), ("policy", -1)])
def test_tampered_share_fields_never_break_a_holder(name, field, value):
    """Values no kvcached writes are read as the defaults (weight 1, min 0, demand 0, the fair
    policy) or, for a huge min or demand, used as they are (Python ints: no overflow)."""
    set_budget(name, 8 * MiB)
    with Budget.open(name) as a, Budget.open(name) as b:
        assert a.try_acquire(6 * MiB)
        b.set_demand(4 * MiB)
        offset = 64 if field == "policy" else _slot_offset(
            b.slot, {"demand": 6, "weight": 7, "min": 8, "cap": 9}[field])
        _poke(name, offset, value)
        cap = a.cap_bytes()
        snap = a.snapshot()
        assert snap.policy in kb.POLICIES
        assert all(h.weight > 0 and h.min_bytes >= 0 and h.demand_bytes >= 0 for h in snap.holders)
        assert 0 <= sum(h.share_bytes for h in snap.holders) <= snap.budget_bytes
        assert 0 <= cap <= I64_MAX and b.cap_bytes() >= 0
        assert a.try_acquire(0) and b.try_acquire(MiB) in (True, False)
        a.check_invariants()
        b.check_invariants()


def test_a_killed_holder_drops_out_and_the_survivor_is_uncapped(name):
    set_budget(name, 8 * MiB)
    with Budget.open(name) as survivor:
        assert survivor.try_acquire(8 * MiB)
        with Proc("budget-demand", name, str(8 * MiB)) as other:
            assert survivor.cap_bytes() == 4 * MiB
            other.kill(signal.SIGKILL)
            wait_until(lambda: survivor.cap_bytes() == I64_MAX, what="the survivor uncapped")
        snap = survivor.snapshot()
        assert [h.share_bytes for h in snap.holders if not h.alive] in ([], [0])
        survivor.check_invariants()


def test_a_stopped_holders_demand_stops_capping_the_others(name):
    """A SIGSTOPped holder's last demand kept every other holder capped: once its heartbeat is
    older than the budget's stale_after_s its demand no longer counts (its memory still does),
    and it counts again once the holder runs and beats again."""
    set_budget(name, 8 * MiB, stale_after_s=1.0)
    with Budget.open(name) as survivor, Proc("budget-demand", name, str(8 * MiB)) as other:
        assert survivor.try_acquire(8 * MiB)
        wait_until(lambda: survivor.cap_bytes() == 4 * MiB, 60, "the survivor capped")
        os.kill(other.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: survivor.cap_bytes() == I64_MAX, 60, "the survivor uncapped")
            (stopped,) = [h for h in read_budget(name).holders if h.pid == other.pid]
            assert stopped.alive and stopped.stale and stopped.demand_bytes == 8 * MiB
            line = next(ln for ln in kvctl("budget", name).stdout.splitlines()
                        if f"pid {other.pid:>8}" in ln)
            assert "  stale  " in line and "demand 8.00 MiB" in line
        finally:
            os.kill(other.pid, signal.SIGCONT)
        wait_until(lambda: survivor.cap_bytes() == 4 * MiB, 60, "the survivor capped again")
        assert not any(h.stale for h in survivor.snapshot().holders)
        survivor.check_invariants()


def test_a_version_2_budget_is_left_alone(name):
    set_budget(name, MiB)
    with open(kb.budget_path(name), "r+b") as f:
        f.seek(4)
        f.write(struct.pack("=I", 2))
    with pytest.raises(KVCachedError, match="layout version 2"):
        Budget.open(name)
    assert name not in remove_broken_budgets().removed
    assert os.path.exists(kb.budget_path(name))
