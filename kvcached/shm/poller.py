"""One thread per process runs every periodic job of kvcached's shared-memory side.

The jobs: each tracker's heartbeat and its poll for limit requests (``owner``), each manager's
usage publishing (``kvcached.kv_cache_manager``), each budget handle's slot heartbeat
(``budget``). One daemon thread, ``kvcached-poller``, runs them all, one at a time, each at its
own interval: it starts with the first job and ends with the last, so a process with N managers
runs one such thread, not two per manager. See Note [One poller per process].

Pure Python; imports only kvcached._threads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from .._threads import start_daemon

THREAD_NAME = "kvcached-poller"

log = logging.getLogger("kvcached")


class Job:
    """A callback the poller runs every ``interval_s`` seconds (the first time at once) until
    ``cancel``. ``what`` names it in the log: "<what> failed; retrying every ... s"."""

    __slots__ = ("fn", "interval_s", "what", "due", "failing", "_poller")

    def __init__(self, poller: Poller, fn: Callable[[], object], interval_s: float,
                 what: str) -> None:
        self.fn, self.interval_s, self.what, self._poller = fn, interval_s, what, poller
        self.due = time.monotonic()
        self.failing = False

    def run(self) -> None:
        """Call ``fn`` once. An exception is logged (once while it keeps failing) and swallowed:
        one failed round must not end the job, nor any other job of the process."""
        try:
            self.fn()
        except Exception:
            if not self.failing:
                log.exception("kvcached: %s failed; retrying every %g s", self.what,
                              self.interval_s)
            self.failing = True
        else:
            if self.failing:
                log.warning("kvcached: %s works again", self.what)
            self.failing = False

    def cancel(self) -> None:
        """Run it no more. Waits for a run in progress, unless called from that run (the poller's
        own thread): once it returns, ``fn`` is not running and never runs again. Idempotent."""
        self._poller.cancel(self)

    def __repr__(self) -> str:
        return f"Job({self.what!r}, every {self.interval_s:g} s)"


class Poller:
    """The process's poller: ``every`` adds a job, ``Job.cancel`` removes it.

    Lock contract: ``self._cond`` guards the jobs, the thread and the run in progress; a job runs
    without it, so a job may add and cancel jobs, its own included. The thread runs while at
    least one job is scheduled; the ``cancel`` that removes the last one joins it (unless it runs
    on that thread: it then ends once the job returns).
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._jobs: list[Job] = []
        self._thread: threading.Thread | None = None
        self._running: Job | None = None
        self._runner: threading.Thread | None = None   # the thread running ``_running``

    def every(self, interval_s: float, fn: Callable[[], object], what: str) -> Job:
        """Run ``fn()`` on the poller thread now and then every ``interval_s`` seconds (measured
        from the end of a run), starting the thread if none runs. O(1).

        ``fn`` must not wait for a lock held by a thread that cancels its job (the cancel waits
        for ``fn``), and should return quickly: the other jobs wait meanwhile.

        Raises:
            ValueError: ``interval_s`` not in (0, 1e6).
        """
        if not 0 < interval_s < 1e6:  # NaN fails too
            raise ValueError(f"interval_s={interval_s!r} is invalid: give seconds in (0, 1e6)")
        job = Job(self, fn, interval_s, what)
        with self._cond:
            self._jobs.append(job)
            if self._thread is None:
                self._thread = start_daemon(self._run, THREAD_NAME)
            self._cond.notify_all()
        return job

    def cancel(self, job: Job) -> None:
        """See ``Job.cancel``. O(jobs)."""
        me = threading.current_thread()
        with self._cond:
            if job in self._jobs:
                self._jobs.remove(job)
            thread = None
            if not self._jobs and self._thread is not None:  # before waiting: a thread runs
                thread, self._thread = self._thread, None     # only while there are jobs
                self._cond.notify_all()
            while self._running is job and self._runner is not me:
                self._cond.wait()
        if thread is not None and thread is not me:
            thread.join()

    def jobs(self) -> list[str]:
        """What every scheduled job is (its ``what``), in the order they were added."""
        with self._cond:
            return [job.what for job in self._jobs]

    def _run(self) -> None:
        me = threading.current_thread()
        with self._cond:
            while self._thread is me:
                job = min(self._jobs, key=lambda j: j.due)
                wait_s = job.due - time.monotonic()
                if wait_s > 0:
                    self._cond.wait(wait_s)
                    continue
                self._running, self._runner = job, me
                self._cond.release()
                try:
                    job.run()
                finally:
                    self._cond.acquire()
                    self._running = self._runner = None
                    job.due = time.monotonic() + job.interval_s
                    self._cond.notify_all()

    def after_fork_in_child(self) -> None:
        """The child has no poller thread, and the jobs it inherited are its parent's."""
        self._reset()


POLLER = Poller()
os.register_at_fork(after_in_child=POLLER.after_fork_in_child)


# Note [One poller per process]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Each manager used to run a publisher thread and its tracker a watcher thread, and the budgets
# a heartbeat thread of their own: two threads per manager, each waking every few milliseconds
# to do microseconds of work. Now one thread runs every job, each at its own interval, and sleeps
# until the earliest is due: a tracker's limit-request poll every 5 ms (owner.REQUEST_POLL_S, the
# watcher's interval before, so a request is answered as fast as then), a manager's publish every
# PUBLISH_INTERVAL_S (10 ms), a tracker's heartbeat every HEARTBEAT_INTERVAL_S (0.1 s), a
# budget handle's heartbeat every stale_after_s / 8. The jobs run one at a time, so a limit
# callback that takes long delays the other jobs of the process (a heartbeat stays far within
# STALE_AFTER_S unless a callback blocks for seconds).
# What the threads guaranteed, the jobs keep: a job that raises is logged once and runs again at
# its next interval, and the other jobs run on (Job.run). Job.cancel returns once the job's run
# in progress has ended, so the manager's close() still takes the publisher off first and the
# tracker's jobs next, a limit being applied finishing before close() returns (Note [Manager life
# cycle] in kv_cache_manager); cancelling from within the job itself (a limit callback that
# closes its manager) does not wait for itself. Waiting happens without the poller's lock, so a
# job may add or cancel jobs. The last cancel joins the thread; the next job starts a new one.
# After fork() the child starts with no jobs and no thread: its inherited trackers, managers and
# budget handles are its parent's, and a cancel of one of their jobs in the child is a no-op.
