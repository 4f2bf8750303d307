"""Tests of kvcached.shm.poller: one thread runs every job; real threads and a real fork, no mocks.

Most tests use a Poller of their own, so that jobs of other tests in this process (the process's
POLLER) do not change what they see; the fork test uses POLLER, whose at-fork handler it checks.
"""

from __future__ import annotations

import logging
import os
import threading

import pytest

from kvcached.shm.poller import POLLER, THREAD_NAME, Poller

WAIT_S = 30


def poller_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


class Counter:
    """A job that counts its runs and sets an event once it has run ``n`` times."""

    def __init__(self, n: int = 3) -> None:
        self.runs, self.n, self.done = 0, n, threading.Event()

    def __call__(self) -> None:
        self.runs += 1
        if self.runs >= self.n:
            self.done.set()


def test_one_thread_runs_every_job_and_the_last_cancel_ends_it():
    poller, before = Poller(), set(poller_threads())
    counters = [Counter() for _ in range(5)]
    jobs = [poller.every(0.001 * (i + 1), c, f"job {i}") for i, c in enumerate(counters)]
    started = [t for t in poller_threads() if t not in before]
    assert len(started) == 1
    assert all(c.done.wait(WAIT_S) for c in counters)
    assert poller.jobs() == [f"job {i}" for i in range(5)]
    for job in jobs[:-1]:
        job.cancel()
        assert started[0].is_alive()
    jobs[-1].cancel()
    assert poller.jobs() == [] and not started[0].is_alive()  # the last cancel joined it
    again = Counter(1)
    job = poller.every(1, again, "again")                     # the next job starts a new one
    assert again.done.wait(WAIT_S)
    job.cancel()
    job.cancel()                                              # idempotent


def test_a_failing_job_is_logged_once_and_stops_nothing(caplog):
    poller, healthy, failures, recovered = Poller(), Counter(20), [], threading.Event()

    def flaky() -> None:
        if len(failures) < 5:
            failures.append(1)
            raise OSError("segment went away")
        recovered.set()

    with caplog.at_level(logging.INFO, logger="kvcached"):
        jobs = [poller.every(0.001, flaky, "flaky job"), poller.every(0.001, healthy, "healthy")]
        assert recovered.wait(WAIT_S) and healthy.done.wait(WAIT_S)
        for job in jobs:
            job.cancel()
    assert caplog.text.count("flaky job failed; retrying every 0.001 s") == 1, caplog.text
    assert caplog.text.count("flaky job works again") == 1, caplog.text
    assert "healthy" not in caplog.text


def test_cancel_waits_for_the_run_in_progress():
    poller = Poller()
    entered, release, finished = threading.Event(), threading.Event(), threading.Event()

    def slow() -> None:
        entered.set()
        release.wait(WAIT_S)
        finished.set()

    other = Counter(1)
    keeper = poller.every(60, lambda: None, "keeper")   # so that the cancel below is not the last
    job = poller.every(0.001, slow, "slow")
    assert entered.wait(WAIT_S)
    seen = []
    canceller = threading.Thread(target=lambda: (job.cancel(), seen.append(finished.is_set())))
    canceller.start()
    canceller.join(0.2)
    assert canceller.is_alive()                 # still waiting for slow() to return
    adder = poller.every(1, other, "added meanwhile")   # the poller's lock is free meanwhile
    release.set()
    canceller.join(WAIT_S)
    assert seen == [True]                       # cancel returned only after the run ended
    assert other.done.wait(WAIT_S)
    adder.cancel()
    keeper.cancel()


def test_cancelling_the_last_job_while_it_runs_ends_the_thread_cleanly(monkeypatch):
    """The thread must not look for a next job once the last one was cancelled under it (it
    raised ValueError from min() of no jobs)."""
    errors = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    poller, before = Poller(), set(poller_threads())
    entered, release = threading.Event(), threading.Event()

    def slow() -> None:
        entered.set()
        release.wait(WAIT_S)

    job = poller.every(0.001, slow, "slow")
    (thread,) = set(poller_threads()) - before
    assert entered.wait(WAIT_S)
    canceller = threading.Thread(target=job.cancel)
    canceller.start()
    release.set()
    canceller.join(WAIT_S)
    assert not canceller.is_alive() and not thread.is_alive()
    assert errors == []


def test_a_job_may_cancel_itself_and_add_jobs():
    poller, second = Poller(), Counter(1)
    cancelled, jobs = threading.Event(), []

    def once() -> None:
        jobs[0].cancel()                        # from the poller thread: must not wait for itself
        jobs.append(poller.every(1, second, "second"))
        cancelled.set()

    jobs.append(poller.every(0.001, once, "once"))
    assert cancelled.wait(WAIT_S) and second.done.wait(WAIT_S)
    assert poller.jobs() == ["second"]
    jobs[1].cancel()
    assert poller.jobs() == []


@pytest.mark.parametrize("interval_s", [0, -1, float("nan"), 1e6])
def test_bad_interval_is_refused(interval_s):
    poller, before = Poller(), set(poller_threads())
    with pytest.raises(ValueError, match=f"interval_s={interval_s!r}"):
        poller.every(interval_s, lambda: None, "bad")
    assert poller.jobs() == [] and set(poller_threads()) == before   # no thread started


def test_forked_child_starts_with_no_job_and_no_thread():
    parent = Counter(1)
    job = POLLER.every(60, parent, "the parent's job")
    try:
        assert parent.done.wait(WAIT_S)
        pid = os.fork()
        if pid == 0:  # the child: no thread, no job; its own job runs on a thread of its own
            code = 1
            try:
                if not poller_threads() and "the parent's job" not in POLLER.jobs():
                    code = 2
                    job.cancel()                # the parent's job: nothing to wait for
                    mine = Counter(2)
                    own = POLLER.every(0.001, mine, "the child's job")
                    if mine.done.wait(WAIT_S) and len(poller_threads()) == 1:
                        own.cancel()
                        code = 0 if not poller_threads() else 3
            finally:
                os._exit(code)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        assert "the parent's job" in POLLER.jobs()
    finally:
        job.cancel()
