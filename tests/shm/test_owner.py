"""Tests of kvcached.shm.owner (MemInfoTracker): real segments under /dev/shm, real processes, no
mocks."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from _procs import ENV, Proc, poke_segment, unique_name, wait_until
from kvcached.errors import KVCachedConfigError, KVCachedError
from kvcached.limits import NO_LIMIT
from kvcached.shm import segment as seg
from kvcached.shm.client import gc_segments, list_segments, read_segment, request_limit, wait_for_ack
from kvcached.shm.owner import MemInfoTracker, close_on_signals
from kvcached.shm.poller import POLLER

pytestmark = pytest.mark.usefixtures("shm_clean")


def test_round_trip_through_the_file(tracker):
    tracker.publish(3 << 20, 5 << 20)
    tracker.set_limit(6 << 30, 7, "deferred")
    tracker.set_capacity(9 << 30)
    snap = read_segment(tracker.name)
    assert (snap.used_bytes, snap.reserved_bytes, snap.mapped_bytes) == (3 << 20, 5 << 20, 8 << 20)
    assert (snap.limit_bytes, snap.limit_revision, snap.limit_status) == (6 << 30, 7, "deferred")
    assert (snap.capacity_bytes, snap.page_size_bytes) == (9 << 30, 2 << 20)
    assert (snap.name, snap.pid, snap.alive, snap.stale, snap.consistent) == (
        tracker.name, os.getpid(), True, False, True)
    with open(tracker.path, "rb") as f:
        raw = f.read()
    assert len(raw) == seg.SEGMENT_BYTES and raw[:4] == b"KVCT"
    for field, value in (("used_bytes", 3 << 20), ("limit_revision", 7), ("pid", os.getpid()),
                         ("capacity_bytes", 9 << 30), ("limit_status", 2)):
        assert struct.unpack_from("=q", raw, seg.OFFSETS[field])[0] == value, field
    assert raw[256:256 + len(tracker.name)] == tracker.name.encode()
    tracker.check_invariants()


def test_default_names_are_unique_and_listed():
    a, b = MemInfoTracker(), MemInfoTracker()
    try:
        assert a.name != b.name and a.name.startswith(f"kvcached_{os.getpid()}_")
        names = {s.name for s in list_segments()}
        assert {a.name, b.name} <= names
    finally:
        a.close()
        b.close()
    assert not os.path.exists(a.path) and not os.path.exists(b.path)


@pytest.mark.parametrize("name", ["", "a/b", "x\ny", ".", "n" * 201])
def test_invalid_names_rejected(name):
    with pytest.raises(KVCachedConfigError, match="segment name"):
        MemInfoTracker(name)


def test_invalid_sizes_rejected():
    with pytest.raises(KVCachedConfigError, match="capacity_bytes=-1"):
        MemInfoTracker(unique_name("bad"), capacity_bytes=-1)
    with pytest.raises(KVCachedConfigError, match="limit_bytes=-5"):
        MemInfoTracker(unique_name("bad"), limit_bytes=-5)


def test_name_held_by_this_process_says_so(tracker):
    with pytest.raises(KVCachedConfigError,
                       match=f"already used by this same process \\(pid {os.getpid()}\\).*"
                             "distinct pool_name"):
        MemInfoTracker(tracker.name)
    assert read_segment(tracker.name).pid == os.getpid()


def test_name_held_by_another_live_process_is_refused():
    name = unique_name("other")
    with Proc("hold", name) as holder:
        with pytest.raises(KVCachedConfigError, match=f"in use by pid {holder.pid} "):
            MemInfoTracker(name)
        assert read_segment(name).pid == holder.pid


def test_close_is_idempotent_and_publish_after_close_is_harmless():
    t = MemInfoTracker(unique_name("close"))
    t.close()
    t.close()
    t.publish(1, 2)
    assert not os.path.exists(t.path)
    with pytest.raises(KVCachedError, match="closed"):
        t.snapshot()


def test_check_invariants_catches_bad_usage(tracker):
    poke_segment(tracker.path, "used_bytes", -1)
    with pytest.raises(AssertionError, match="used_bytes is -1, outside"):
        tracker.check_invariants()


@pytest.mark.parametrize("used, reserved", [(-1, 0), (0, 1 << 63), (1.5, 0), (True, 0)])
def test_publish_refuses_figures_a_segment_cannot_hold(tracker, used, reserved):
    tracker.publish(3, 4)
    with pytest.raises(KVCachedConfigError, match="_bytes="):
        tracker.publish(used, reserved)
    snap = read_segment(tracker.name)
    assert (snap.used_bytes, snap.reserved_bytes, snap.consistent) == (3, 4, True)
    tracker.publish(np.int64(5), np.uint32(6))  # numpy integers are integers
    assert read_segment(tracker.name).mapped_bytes == 11


def test_silent_heartbeat_is_stale_but_never_collected():
    """An owner that is alive but whose heartbeat stopped (hung) is reported stale, not dead."""
    with MemInfoTracker(unique_name("hung"), heartbeat_interval_s=600) as t:
        wait_until(lambda: t.snapshot().heartbeat_ns != t.snapshot().created_ns,
                   what="the first beat (the next is 600 s away)")
        fd = os.open(t.path, os.O_RDWR)
        try:
            old_ns = time.time_ns() - int(2 * seg.STALE_AFTER_S * 1e9)
            os.pwrite(fd, struct.pack("=q", old_ns), seg.OFFSETS["heartbeat_ns"])
        finally:
            os.close(fd)
        snap = read_segment(t.name)
        assert (snap.alive, snap.stale) == (True, True)
        assert snap.heartbeat_age_s > seg.STALE_AFTER_S
        assert t.name not in gc_segments().removed


def test_dead_owners_name_is_taken_over():
    name = unique_name("takeover")
    with Proc("hold", name) as holder:
        holder.kill(signal.SIGKILL)
    with MemInfoTracker(name) as t:
        assert read_segment(name).pid == os.getpid()
        t.check_invariants()


# -- signals: none handled unless the application asks (close_on_signals) ----------------------

_HANDLERS = """
import json, signal, sys
from kvcached.shm.owner import MemInfoTracker
if sys.argv[2] == "engine-first":  # the engine installs its handlers before kvcached is used
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
before = [repr(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGINT)]
trackers = [MemInfoTracker(sys.argv[1]), MemInfoTracker(sys.argv[1] + ".b")]
print(json.dumps({"before": before,
                  "after": [repr(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGINT)]}))
"""


@pytest.mark.parametrize("order", ["engine-first", "defaults"])
def test_making_a_tracker_installs_no_signal_handler(order):
    """Trackers wrapped the SIGTERM and SIGINT handlers of the main thread: an engine's handler
    installed before kvcached was wrapped, one installed after replaced kvcached's. Now neither
    changes; clean-up at a normal exit is atexit's (the process ends here without closing its
    trackers)."""
    name = unique_name("nosig")
    result = subprocess.run([sys.executable, "-c", _HANDLERS, name, order], capture_output=True,
                            text=True, env=ENV, timeout=60)
    assert result.returncode == 0, result.stderr
    handlers = json.loads(result.stdout)
    assert handlers["after"] == handlers["before"], handlers
    assert not os.path.exists(seg.segment_path(name))  # removed at exit, by atexit
    assert not os.path.exists(seg.segment_path(name + ".b"))


def test_sigterm_kills_at_once_and_gc_collects_the_segment():
    """With no handler, SIGTERM kills as without kvcached; the segment stays behind, is seen dead
    (pid gone) and is removed by gc, like a SIGKILLed owner's."""
    name = unique_name("term")
    with Proc("hold", name) as holder:
        path = read_segment(name).path
        status = holder.kill(signal.SIGTERM)
    assert status == -signal.SIGTERM  # died of the signal, as without kvcached
    if os.path.exists(path):  # (or a concurrent test's gc removed it already)
        assert not read_segment(name).alive
        assert gc_segments().removed.get(name, "owner dead") == "owner dead"
    assert not os.path.exists(path)


# Runs the command in its arguments with SIGINT at its default: a child inherits an ignored SIGINT
# (a suite started as a background job of a non-interactive shell), and Python then installs no
# KeyboardInterrupt handler. exec keeps an ignored signal ignored and resets a default one.
_WITH_DEFAULT_SIGINT = (sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, "
                        "signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])")


def test_sigint_exits_through_keyboard_interrupt_and_atexit_unlinks():
    name = unique_name("int")
    with Proc("hold", name, prefix=_WITH_DEFAULT_SIGINT) as holder:
        path = read_segment(name).path
        status = holder.kill(signal.SIGINT)
    assert status == -signal.SIGINT  # Python's own exit for an uncaught KeyboardInterrupt
    assert not os.path.exists(path)


def test_the_programs_own_sigterm_handler_runs_and_atexit_unlinks():
    name = unique_name("own")
    with Proc("hold", name, "--own-sigterm") as holder:
        path = read_segment(name).path
        status = holder.kill(signal.SIGTERM)
    assert status == 0  # the program's handler ran (sys.exit(0)); atexit unlinked
    assert not os.path.exists(path)


def test_normal_exit_unlinks():
    name = unique_name("exit")
    with Proc("hold", name) as holder:
        path = read_segment(name).path
        status, _, err = holder.finish()
    assert status == 0, err
    assert not os.path.exists(path)


_OPTED_IN = """
import sys
from kvcached.shm.owner import MemInfoTracker, close_on_signals
tracker = MemInfoTracker(sys.argv[1], heartbeat_interval_s=float(sys.argv[2]))
close_on_signals()
print("READY", flush=True)
k = 0
while True:  # publish flat out: inside the write lock most of the time
    k += 1
    tracker.publish(k, k)
"""


def _opted_in_and_killed(name: str, heartbeat_s: str, signum: int) -> int:
    """Run a publisher that called close_on_signals(); send it ``signum``; its exit status."""
    popen = subprocess.Popen([sys.executable, "-c", _OPTED_IN, name, heartbeat_s], env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([popen.stdout], [], [], 60)
        assert ready and popen.stdout.readline().strip() == "READY", popen.stderr.read()
        assert read_segment(name).alive
        popen.send_signal(signum)
        return popen.wait(30)
    finally:
        if popen.poll() is None:
            popen.kill()
        popen.communicate()


@pytest.mark.parametrize("attempt", range(3))
def test_opted_in_sigterm_in_the_middle_of_a_write_still_kills_and_unlinks(attempt):
    """close_on_signals(): the main thread publishes flat out while the poller thread beats
    every millisecond (waiting for the write lock): SIGTERM must still end the process at once,
    segment removed, instead of waiting on a thread that waits on it."""
    name = unique_name("termwrite")
    assert _opted_in_and_killed(name, "0.001", signal.SIGTERM) == -signal.SIGTERM
    assert not os.path.exists(seg.segment_path(name))


def test_close_on_signals_refuses_what_it_cannot_install():
    before = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)]
    for bad in ([signal.SIGTERM, signal.SIGKILL], [signal.SIGSTOP], [0], [10_000], ["TERM"], [True]):
        with pytest.raises(KVCachedConfigError, match=re.escape(repr(bad[-1]))):
            close_on_signals(bad)
    errors = []

    def off_main() -> None:
        try:
            close_on_signals()
        except KVCachedConfigError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=off_main)
    thread.start()
    thread.join(30)
    assert len(errors) == 1 and "main thread" in errors[0]
    assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)] == before


class Recorder:
    def __init__(self, status: str = "applied") -> None:
        self.calls, self.status = [], status

    def __call__(self, limit_bytes: int, revision: int) -> dict:
        self.calls.append((limit_bytes, revision))
        if isinstance(self.status, Exception):
            raise self.status
        return {"status": self.status, "limit_bytes": limit_bytes, "revision": revision}


def test_limit_requests_reach_the_watcher(tracker):
    recorder = Recorder()
    tracker.set_limit(4 << 30, 3)
    tracker.start_watcher(recorder)
    for limit in (1 << 30, 6 << 30, 4 << 30, 0):
        request = request_limit(tracker.name, limit)
        ack = wait_for_ack(request, timeout_s=10)
        assert ack is not None and ack.ack_request_seq == request.request_seq
        assert (ack.ack_status, ack.limit_bytes, ack.limit_revision) == (
            "applied", limit, request.revision)
    assert recorder.calls == [(1 << 30, 4), (6 << 30, 5), (4 << 30, 6), (0, 7)]
    tracker.check_invariants()


def test_stale_answer_leaves_the_limit(tracker):
    tracker.set_limit(4 << 30, 9)
    tracker.start_watcher(Recorder("stale"))
    ack = wait_for_ack(request_limit(tracker.name, 1 << 30, revision=2), timeout_s=10)
    assert (ack.ack_status, ack.limit_bytes, ack.limit_revision) == ("stale", 4 << 30, 9)


def test_request_pending_before_the_watcher_is_handled(tracker):
    request = request_limit(tracker.name, 123 << 20)
    assert wait_for_ack(request, timeout_s=0.05) is None
    recorder = Recorder("deferred")
    tracker.start_watcher(recorder)
    ack = wait_for_ack(request, timeout_s=10)
    assert recorder.calls == [(123 << 20, 1)]
    assert (ack.ack_status, ack.limit_status, ack.limit_bytes) == ("deferred", "deferred",
                                                                   123 << 20)


def test_failing_callback_is_acknowledged_as_error(tracker):
    tracker.start_watcher(Recorder(RuntimeError("boom")))
    ack = wait_for_ack(request_limit(tracker.name, 1 << 20), timeout_s=10)
    assert ack.ack_status == "error" and ack.limit_bytes == NO_LIMIT
    tracker.start_watcher(Recorder("nonsense"))
    ack = wait_for_ack(request_limit(tracker.name, 2 << 20), timeout_s=10)
    assert ack.ack_status == "error"


def test_watcher_survives_requests_no_operator_can_make(tracker):
    recorder = Recorder()
    tracker.start_watcher(recorder)
    for limit, revision in ((-7, 1), (5, -1)):  # written by another program, not by kvctl
        seq = read_segment(tracker.name).request_seq + 2
        poke_segment(tracker.path, "request_limit_bytes", limit, revision)
        poke_segment(tracker.path, "request_seq", seq)
        wait_until(lambda seq=seq: read_segment(tracker.name).ack_request_seq == seq,
              what="the answer")
        assert read_segment(tracker.name).ack_status == "error"
    assert recorder.calls == []  # never handed to the callback

    class Huge(Recorder):
        def __call__(self, limit_bytes, revision):
            return {"status": "applied", "limit_bytes": 1 << 64, "revision": revision}

    tracker.start_watcher(Huge())  # a callback answering what no segment holds
    ack = wait_for_ack(request_limit(tracker.name, 1 << 20), timeout_s=30)
    assert ack.ack_status == "error" and ack.consistent
    tracker.start_watcher(recorder)  # the poller still runs and answers
    ack = wait_for_ack(request_limit(tracker.name, 2 << 20), timeout_s=30)
    assert (ack.ack_status, ack.limit_bytes) == ("applied", 2 << 20)
    tracker.check_invariants()


# -- close ------------------------------------------------------------------------------------

def jobs_of(t: MemInfoTracker) -> list[str]:
    """The tracker's jobs on the process's poller."""
    return [what for what in POLLER.jobs() if what.startswith(f"tracker {t.name}:")]


def test_close_waits_for_the_watcher_to_end():
    t = MemInfoTracker(unique_name("join"))
    assert jobs_of(t) == [f"tracker {t.name}: heartbeat"]
    entered, release = threading.Event(), threading.Event()

    def blocking(limit_bytes, revision):
        entered.set()
        release.wait(30)
        return {"status": "applied"}

    t.start_watcher(blocking)
    request_limit(t.name, 1 << 20)
    assert entered.wait(30)
    closer = threading.Thread(target=t.close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive()  # still waiting for the callback in progress
    release.set()
    closer.join(30)
    assert not closer.is_alive() and jobs_of(t) == []
    assert not os.path.exists(t.path)


def test_close_from_the_callback_and_from_many_threads():
    t = MemInfoTracker(unique_name("selfclose"))
    closed = threading.Event()

    def closing(limit_bytes, revision):
        t.close()  # from the poller thread, in its own job: must not wait for itself
        closed.set()
        return {"status": "applied"}

    t.start_watcher(closing)
    request_limit(t.name, 1 << 20)
    assert closed.wait(30)
    assert jobs_of(t) == [] and not os.path.exists(t.path)

    t = MemInfoTracker(unique_name("manyclose"))
    closers = [threading.Thread(target=t.close) for _ in range(8)]
    for c in closers:
        c.start()
    for c in closers:
        c.join(30)
    assert not any(c.is_alive() for c in closers) and jobs_of(t) == []
    assert not os.path.exists(t.path)


# -- a segment file changed by another program -------------------------------------------------

def _truncate(path, size):
    os.truncate(path, size)


def _regrow(path):
    os.truncate(path, 0)
    os.truncate(path, seg.SEGMENT_BYTES)  # the right size again, all zeros


def _scribble(path):
    fd = os.open(path, os.O_RDWR)
    os.pwrite(fd, b"\x1b[2J", 0)
    os.close(fd)


def _replace(path):
    with open(path + ".new", "wb") as f:
        f.write(b"garbage")
    os.rename(path + ".new", path)


@pytest.mark.parametrize("change, detaches", [
    (lambda p: _truncate(p, 0), True), (lambda p: _truncate(p, 100), True), (_regrow, True),
    (_scribble, True), (os.unlink, False), (_replace, False)],
    ids=["truncate-0", "truncate-100", "truncate-regrow", "scribble", "unlink", "replace"])
def test_owner_survives_any_change_to_its_file(change, detaches):
    """A process publishing flat out while another program changes its segment file keeps
    running (it died of SIGBUS before); gc then removes whatever is not a segment, and never
    the live segment of a bystander."""
    name, bystander = unique_name("victim"), unique_name("bystander")
    with Proc("hold", bystander), Proc("busy", name) as busy:
        path = read_segment(name).path
        change(path)
        deadline = time.monotonic() + 30
        while True:
            busy.send("report")
            report = json.loads(busy.readline(timeout_s=30))
            if bool(report["detached"]) == detaches or time.monotonic() > deadline:
                break
        assert bool(report["detached"]) == detaches, report
        busy.send("report")
        assert json.loads(busy.readline(timeout_s=30))["publishes"] > report["publishes"]
        removed = gc_segments().removed
        assert bystander not in removed and read_segment(bystander).alive
        assert not os.path.exists(path)  # nothing valid is left at the name
        assert removed.get(name) in (None, "not a valid segment")  # None: unlinked, or a
        # concurrent test's gc came first
        status, _, err = busy.finish()
    assert status == 0, err
    if detaches:
        assert err.count("no longer publishes") == 1  # one warning


def test_a_file_that_is_not_a_segment_is_taken_over():
    name = unique_name("takeinvalid")
    with open(seg.segment_path(name), "wb") as f:
        f.write(b"")
    with MemInfoTracker(name) as t:
        t.check_invariants()


# -- memory ordering ----------------------------------------------------------------------------

def test_fence_only_where_the_cpu_needs_one(monkeypatch, tracker):
    assert seg.fence_for("x86_64") is None
    try:
        fence = seg.fence_for("aarch64")  # libatomic's fence, as on Grace
    except OSError:
        fence = None
    if fence is None:
        pytest.skip("libatomic.so.1 is not installed")
    calls = []
    monkeypatch.setattr(seg, "FENCE", lambda: (calls.append(1), fence()))
    tracker.start_watcher(Recorder())
    tracker.publish(7, 8)
    ack = wait_for_ack(request_limit(tracker.name, 1 << 20), timeout_s=30)
    assert ack.ack_status == "applied" and ack.mapped_bytes == 15
    assert len(calls) >= 8  # publish, request, answer and reads each fenced twice


def test_forked_child_never_waits_for_a_lock_its_parents_poller_held(tracker):
    """A fork can come while the parent's poller thread holds the tracker's write or limit lock
    (a heartbeat, a limit answer): that thread is not in the child, so the child must take
    neither lock. Before, its publish / set_limit / close hung for good."""
    held, release = threading.Event(), threading.Event()

    def poller_like():
        with tracker._write_lock, tracker._limit_lock:
            held.set()
            release.wait(60)

    thread = threading.Thread(target=poller_like)
    thread.start()
    try:
        assert held.wait(60)
        pid = os.fork()
        if pid == 0:
            try:
                tracker.publish(5, 6)
                tracker.set_limit(7 << 20, 8)
                tracker.set_capacity(9)
                tracker.recorded_limit()
                tracker.close()
            finally:
                os._exit(0)
        pidfd = os.pidfd_open(pid)
        try:
            exited = select.select([pidfd], [], [], 60)[0]   # readable once the child has exited
        finally:
            os.close(pidfd)
        if not exited:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on a lock the parent's thread held at the fork")
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    finally:
        release.set()
        thread.join()


def test_forked_child_never_writes_its_parents_segment(tracker):
    tracker.publish(1, 2)
    tracker.set_limit(3 << 20, 4)
    pid = os.fork()
    if pid == 0:  # the child: every write stays in its own copy, and its exit removes nothing
        try:
            tracker.publish(5, 6)
            tracker.set_limit(7 << 20, 8)
            tracker.close()
        finally:
            os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    snap = read_segment(tracker.name)
    assert (snap.used_bytes, snap.reserved_bytes, snap.limit_bytes, snap.limit_revision) == (
        1, 2, 3 << 20, 4)
    tracker.check_invariants()
