"""The owner's side of an instance segment: what the process that owns the instance writes.

``MemInfoTracker`` creates the segment (``segment`` holds its format), publishes the usage the
manager hands it, records the limit, beats the heartbeat and answers operators' limit requests
through the manager's callback: the last two as jobs on the process's poller (``poller``), not
a thread of their own. At exit it removes the segment (atexit; signal handlers only when the
application calls ``close_on_signals``).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import struct
import threading
import time
from collections.abc import Callable, Iterable

from ..checks import as_int
from ..errors import KVCachedConfigError, KVCachedError
from ..limits import I64_MAX, NO_LIMIT
from . import segment
from .files import (
    ShmFileError,
    create_exclusive,
    own_identity,
    pid_now,
    replace_if_dead,
    validate_name,
)
from .poller import POLLER, Job
from .segment import (
    LAYOUT,
    MAGIC,
    OFFSETS,
    SEGMENT_BYTES,
    SEGMENT_FILES,
    STALE_AFTER_S,
    VERSION,
    W_HEARTBEAT,
    W_LIMIT_SEQ,
    W_RESERVED,
    W_USAGE_SEQ,
    W_USED,
    WORD,
    WORDS,
    Snapshot,
    default_name,
    parse_segment,
    read_consistent,
    read_path,
    removable,
    segment_path,
    status_code,
    status_name,
)

HEARTBEAT_INTERVAL_S = 0.1
REQUEST_POLL_S = 0.005          # how often the limit-request job looks for a request

log = logging.getLogger("kvcached")


# --------------------------------------------------------------------------------------------
# Clean-up on exit, and on signals when the application asks. See Note [Signals and clean-up].
# --------------------------------------------------------------------------------------------

_to_close: dict[int, MemInfoTracker] = {}
_to_close_lock = threading.RLock()  # re-entered by a signal handler
_signals_chained: set[int] = set()


def close_at_exit(obj: MemInfoTracker) -> None:
    """Call ``obj.close()`` at interpreter exit (atexit; no signal handler, see
    ``close_on_signals``)."""
    with _to_close_lock:
        if not _to_close:
            atexit.register(_close_all)
        _to_close[id(obj)] = obj


def close_on_signals(signums: Iterable[int] = (signal.SIGTERM,)) -> None:
    """Opt in: make each of ``signums`` close every tracker of this process (removing its
    segment) before the signal has its previous effect.

    kvcached installs no signal handler by itself: without this call a SIGTERM kills the process
    as it would without kvcached, and its segments are left to ``gc_segments`` (``kvctl gc``),
    which sees their owner dead, or to the next instance of the same name. Call it from the main
    thread, after the application installed its own handlers: a previous Python handler is then
    called in its place (clean-up left to the exit it leads to), SIG_IGN stays ignored, and for
    SIG_DFL the trackers are closed and the signal re-sent, so the process still dies of it.
    Idempotent per signal. See Note [Signals and clean-up].

    Raises:
        KVCachedConfigError: not on the main thread, or a value that is no signal a handler can
            be installed for (SIGKILL, SIGSTOP, out of range, not an int). No handler changed.
    """
    signums = list(signums)
    catchable = signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}
    for signum in signums:
        if isinstance(signum, bool) or not isinstance(signum, int) or signum not in catchable:
            raise KVCachedConfigError(
                f"signal {signum!r} is invalid: give signals a handler can be installed for, "
                "such as signal.SIGTERM or signal.SIGHUP (never SIGKILL or SIGSTOP)")
    if threading.current_thread() is not threading.main_thread():
        raise KVCachedConfigError(
            "close_on_signals() was called off the main thread: Python installs signal handlers "
            "only from the main thread; call it there")
    for signum in signums:
        if signum not in _signals_chained:
            previous = signal.getsignal(signum)
            if previous is None:
                continue  # installed outside Python: cannot be chained
            signal.signal(signum, _make_handler(previous))
            _signals_chained.add(signum)


def cancel_close_at_exit(obj: MemInfoTracker) -> None:
    """Forget ``obj`` (it was closed)."""
    with _to_close_lock:
        _to_close.pop(id(obj), None)
        if not _to_close:
            atexit.unregister(_close_all)


def _close_all(join: bool = True) -> None:
    with _to_close_lock:
        objs = list(_to_close.values())
    for obj in objs:
        try:
            obj._close(join)
        except Exception:  # keep closing the others; exit must not fail on clean-up
            log.exception("kvcached: closing %r at exit failed", obj)


def _make_handler(previous: object) -> Callable[[int, object], None]:
    def handler(signum: int, frame: object) -> None:
        if previous is signal.SIG_IGN:
            return
        if callable(previous):
            previous(signum, frame)
            return
        _close_all(join=False)  # the thread interrupted may hold a lock a job waits for
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    return handler


# --------------------------------------------------------------------------------------------
# The owner side
# --------------------------------------------------------------------------------------------

ApplyLimit = Callable[[int, int], dict]


class MemInfoTracker:
    """The segment of one instance (or one pool of it), owned and written by this process.

    Lock contract: ``publish`` takes no lock and must not run in two threads at once (the
    manager calls it from its one publishing job); the limit block is written under
    ``self._limit_lock`` (``set_limit``, ``set_capacity``, the limit-request job); the heartbeat
    word is written only by the heartbeat job. Both jobs run on the process's poller thread.
    ``close`` is idempotent and may run in any thread, the poller's too (from a limit callback);
    it returns once neither job runs any more.

    Why not ``multiprocessing.shared_memory``: before Python 3.13 it registers every segment with
    the resource tracker, which unlinks segments that *other* processes created when this one
    exits. Why pread/pwrite and not a mapping: a mapping of a file another program truncates
    faults (SIGBUS) on the next access; see Note [A segment changed by another process] in
    segment.
    """

    def __init__(self, name: str | None = None, *, capacity_bytes: int = 0,
                 page_size_bytes: int = 0, limit_bytes: int = NO_LIMIT,
                 heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        """Create the segment; start beating its heartbeat (a job on the process's poller).

        ``name``: the instance's name (the caller passes KVCACHED_IPC_NAME, suffixed per pool
        where it has several); None picks ``kvcached_<pid>_<n>``. A segment of that name left by
        a dead process, or a file there that is not a segment, is taken over; an entry that is no
        regular file of this user (a FIFO, a directory, a link, another user's file) is not
        (Note [Files in /dev/shm] in files).

        Raises:
            KVCachedConfigError: invalid name or sizes, a live process owns that name (the
                message names its pid, or says it is this process), or an entry that is no
                regular file of this user has it (the message names it and how to remove it).
            KVCachedError: /dev/shm is missing or not writable.
        """
        self.name = validate_name(default_name() if name is None else name)
        self.path = segment_path(self.name)
        capacity_bytes = as_int(capacity_bytes, "capacity_bytes", minimum=0, maximum=I64_MAX)
        page_size_bytes = as_int(page_size_bytes, "page_size_bytes", minimum=0, maximum=I64_MAX)
        limit_bytes = _check_limit(limit_bytes)
        if not 0 < heartbeat_interval_s < 1e6:  # NaN fails too
            raise KVCachedConfigError(
                f"heartbeat_interval_s={heartbeat_interval_s!r} must be in (0, 1e6) seconds "
                f"(default {HEARTBEAT_INTERVAL_S}); readers call an instance stale after "
                f"{STALE_AFTER_S} s")
        pid, start_time, pid_ns = self._identity = own_identity()
        now = time.time_ns()
        content = LAYOUT.pack(
            MAGIC, VERSION, SEGMENT_BYTES, pid, start_time, pid_ns, now, now, page_size_bytes,
            0, 0, 0,                                                      # usage block
            0, limit_bytes, 0, status_code("none"), capacity_bytes, 0, 0, 0,  # limit block
            0, 0, 0, 0, 0,                                                # request block
            self.name.encode())
        self._fd = self._create(content)
        self._ino = os.fstat(self._fd).st_ino
        # What this process wrote: the owner reads its own fields here, never from the file.
        self._shadow_raw = bytearray(content)
        self._shadow = memoryview(self._shadow_raw).cast("q")
        self._detached: str | None = None  # why the file no longer holds the segment
        # Every write of the file by this process. Re-entrant: a signal handler may close the
        # tracker while the poller is inside a write (See Note [Signals and clean-up]).
        self._write_lock = threading.RLock()
        self._limit_lock = threading.Lock()
        self._close_lock = threading.RLock()  # re-entered by a signal handler
        self._closed = False
        self._requests: Job | None = None  # the limit-request job, once start_watcher ran
        close_at_exit(self)
        self._heartbeat = POLLER.every(heartbeat_interval_s, self._beat,
                                       f"tracker {self.name}: heartbeat")

    def _create(self, content: bytes) -> int:
        for _ in range(16):
            fd = create_exclusive(self.path, content)
            if fd is not None:
                return fd
            try:
                taken = not replace_if_dead(self.path, SEGMENT_FILES, removable)
            except ShmFileError as exc:
                raise KVCachedConfigError(
                    f"segment name {self.name!r} cannot be used: {exc}; or give this instance "
                    "another name (KVCACHED_IPC_NAME)") from None
            if taken and os.path.lexists(self.path):
                raise KVCachedConfigError(self._name_taken())
        raise KVCachedError(f"could not create {self.path}: other processes keep replacing it")

    def _name_taken(self) -> str:
        try:
            snap = read_path(self.path)
        except (OSError, KVCachedError) as exc:
            owner = f"a file this kvcached cannot read as a segment ({exc})"
        else:
            if (snap.pid, snap.start_time, snap.pid_ns) == self._identity:
                return (
                    f"segment name {self.name!r} is already used by this same process (pid "
                    f"{snap.pid}): each tracker of a process needs its own name. Give every "
                    "manager a distinct pool_name (its segment is named "
                    "<KVCACHED_IPC_NAME>.<pool_name>), or close the one that uses the name")
            owner = f"pid {snap.pid}"
        return (f"segment name {self.name!r} is in use by {owner} ({self.path}); give this "
                "instance another name (KVCACHED_IPC_NAME) or stop that process")

    def _file_ok(self) -> bool:
        """Whether writes may go to the file: open, not detached, not a forked child's copy
        (the segment is the parent's), and a segment long (one fstat). Assumes
        ``self._write_lock``. See Note [A segment changed by another process] in segment."""
        if self._closed or self._detached is not None or self._forked_copy():
            return False
        size = os.fstat(self._fd).st_size
        if size < SEGMENT_BYTES:
            self._detach(f"was truncated to {size} bytes by another program")
            return False
        return True

    def _detach(self, why: str) -> None:
        """Stop writing to the file (nobody can read it as a segment); warn once. Assumes
        ``self._write_lock``."""
        self._detached = why
        log.warning("kvcached: segment %s %s; instance %r no longer publishes its usage or takes "
                    "limit requests until it restarts (`kvctl gc` removes the file)",
                    self.path, why, self.name)

    def _forked_copy(self) -> bool:
        """This object was inherited by a forked child: it writes nothing and takes no lock (the
        parent's poller thread may have held one at the fork, and that thread is not here)."""
        return pid_now[0] != self._identity[0]

    def _write_block(self, seq_index: int, stores: list[tuple[int, int]]) -> None:
        """Write ``stores`` ((word index, checked value), one block's fields) under the block's
        sequence counter ``seq_index``: into the shadow, then with pwrite into the file."""
        if self._forked_copy():
            return
        with self._write_lock:
            shadow = self._shadow
            seq = shadow[seq_index] + 1
            for index, value in stores:
                shadow[index] = value
            shadow[seq_index] = seq + 1
            if not self._file_ok():
                return
            fd, fence = self._fd, segment.FENCE
            first = min(index for index, _ in stores)
            last = max(index for index, _ in stores) + 1
            os.pwrite(fd, WORD.pack(seq), seq_index * 8)
            if fence is not None:
                fence()  # odd before the fields
            os.pwrite(fd, self._shadow_raw[first * 8:last * 8], first * 8)
            if fence is not None:
                fence()  # the fields before even
            os.pwrite(fd, WORD.pack(seq + 1), seq_index * 8)

    # -- usage --------------------------------------------------------------------------------

    def publish(self, used_bytes: int, reserved_bytes: int) -> None:
        """Record the instance's usage: an fstat and three pwrites, no waiting (~3 µs).

        Not thread-safe against itself: call it from one thread at a time (the manager's
        publishing job). After ``close`` it writes nowhere. See Note [Seqlock over pread and
        pwrite] in segment.

        Raises:
            KVCachedConfigError: a figure outside [0, I64_MAX] or not an int. Nothing written.
        """
        used_bytes = as_int(used_bytes, "used_bytes", minimum=0, maximum=I64_MAX)
        reserved_bytes = as_int(reserved_bytes, "reserved_bytes", minimum=0, maximum=I64_MAX)
        self._write_block(W_USAGE_SEQ, [(W_USED, used_bytes), (W_RESERVED, reserved_bytes)])

    # -- limit block --------------------------------------------------------------------------

    def set_limit(self, limit_bytes: int, revision: int, status: str = "applied") -> None:
        """Record the instance's current limit (NO_LIMIT for none), its revision and state.

        Raises:
            KVCachedConfigError: limit outside [NO_LIMIT, I64_MAX], revision outside
                [0, I64_MAX], either not an int, or a status not in STATUS_NAMES. Nothing was
                written.
        """
        limit_bytes = _check_limit(limit_bytes)
        revision = as_int(revision, "revision", minimum=0, maximum=I64_MAX)
        code = status_code(status)
        if self._forked_copy():
            return
        with self._limit_lock:
            self._write_limit_block(limit_bytes=limit_bytes, limit_revision=revision,
                                    limit_status=code)

    def recorded_limit(self) -> tuple[int, int, str]:
        """(limit_bytes, revision, status) as this owner last wrote them into the segment. O(1),
        no system call."""
        with contextlib.nullcontext() if self._forked_copy() else self._limit_lock:
            words = self._shadow
            return (words[WORDS["limit_bytes"]], words[WORDS["limit_revision"]],
                    status_name(words[WORDS["limit_status"]]))

    def set_capacity(self, capacity_bytes: int) -> None:
        """Record the most bytes the instance could ever map (after its tensors were sized).

        Raises:
            KVCachedConfigError: outside [0, I64_MAX] or not an int. Nothing was written.
        """
        capacity_bytes = as_int(capacity_bytes, "capacity_bytes", minimum=0, maximum=I64_MAX)
        if self._forked_copy():
            return
        with self._limit_lock:
            self._write_limit_block(capacity_bytes=capacity_bytes)

    def _write_limit_block(self, **fields: int) -> None:
        """Assumes ``self._limit_lock``. Every value is checked before the first write, so a
        failure never leaves the sequence odd."""
        self._write_block(W_LIMIT_SEQ, [
            (WORDS[field], as_int(value, field, minimum=-I64_MAX - 1, maximum=I64_MAX))
            for field, value in fields.items()])

    # -- on the poller: heartbeat and limit requests ------------------------------------------

    def start_watcher(self, apply: ApplyLimit, interval_s: float = REQUEST_POLL_S) -> None:
        """Poll for operators' limit requests every ``interval_s`` and hand each to ``apply``.

        ``apply(limit_bytes, revision)`` runs on the process's poller thread and returns a dict
        ``{"status": "applied"|"deferred"|"stale"|"conflict", "limit_bytes": int,
        "revision": int}``. For applied/deferred the tracker records limit_bytes and revision
        (default: the requested ones) as the current limit; for stale/conflict it changes only the
        acknowledgement. An exception or a malformed answer is logged and acknowledged as
        ``error``; so is a request the segment holds that no operator could have made (a limit
        below NO_LIMIT, a negative revision: another program wrote it), without calling
        ``apply``. A request already pending when the watcher starts is handled at once. A
        second call replaces the callback (after a call of the first one in progress).

        Raises:
            KVCachedConfigError: ``interval_s`` not in (0, 1].
        """
        if not 0 < interval_s <= 1:
            raise KVCachedConfigError(
                f"interval_s={interval_s!r} is invalid: give a poll interval in (0, 1] seconds")
        self.stop_watcher()
        self._requests = POLLER.every(interval_s, lambda: self._handle_request(apply),
                                      f"tracker {self.name}: limit requests")

    def stop_watcher(self) -> None:
        """Stop handing requests to the callback (they stay pending in the segment); waits for a
        call in progress, unless made from it."""
        requests, self._requests = self._requests, None
        if requests is not None:
            requests.cancel()

    def _beat(self) -> None:
        now_ns = time.time_ns()
        with self._write_lock:
            self._shadow[W_HEARTBEAT] = now_ns
            if not self._file_ok():
                return
            if os.pread(self._fd, len(MAGIC), 0) != MAGIC:
                self._detach("was overwritten by another program")
                return
            os.pwrite(self._fd, WORD.pack(now_ns), OFFSETS["heartbeat_ns"])

    def _handle_request(self, apply: ApplyLimit) -> None:
        if self._closed or self._detached is not None:
            return
        fd, fence = self._fd, segment.FENCE
        head = os.pread(fd, 8, OFFSETS["request_seq"])
        if len(head) < 8:
            return  # truncated: the next heartbeat detaches
        seq = WORD.unpack(head)[0]
        if seq & 1 or seq < 0 or seq == self._shadow[WORDS["ack_request_seq"]]:
            return  # (negative: another program's; readers report the segment as corrupt)
        if fence is not None:
            fence()  # the fields are read after the sequence ...
        body = os.pread(fd, 16, OFFSETS["request_limit_bytes"])
        if fence is not None:
            fence()  # ... and before it is read again
        if len(body) < 16 or os.pread(fd, 8, OFFSETS["request_seq"]) != head:
            return  # rewritten meanwhile: take the newer request on the next poll
        limit_bytes, revision = struct.unpack("=2q", body)
        if limit_bytes < NO_LIMIT or revision < 0:
            log.warning("kvcached: %s: request %d (limit %d, revision %d) is not one an operator "
                        "can make (another program wrote it); answered as error",
                        self.name, seq, limit_bytes, revision)
            status, code = "error", status_code("error")
        else:
            try:
                result = apply(limit_bytes, revision)
                status = result["status"]
                code = status_code(status)
                if status in ("applied", "deferred"):
                    limit_bytes = _check_limit(result.get("limit_bytes", limit_bytes))
                    revision = as_int(result.get("revision", revision), "revision", minimum=0,
                                      maximum=I64_MAX)
            except Exception:
                log.exception("kvcached: limit callback failed for %s (limit %r, revision %r)",
                              self.name, limit_bytes, revision)
                status, code = "error", status_code("error")
        ack = {"ack_request_seq": seq, "ack_status": code, "ack_ns": time.time_ns()}
        with self._limit_lock:
            if status in ("applied", "deferred"):
                self._write_limit_block(limit_bytes=limit_bytes, limit_revision=revision,
                                        limit_status=code, **ack)
            else:
                self._write_limit_block(**ack)

    # -- reading and checking -----------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """This segment as a reader sees it.

        Raises:
            KVCachedError: the tracker is closed, or another program truncated or overwrote its
                file (it publishes no more).
        """
        why = "is closed" if self._closed else self._detached
        if why is not None:
            raise KVCachedError(f"tracker {self.name!r}: its segment {self.path} {why}")
        raw, consistent = read_consistent(self._fd, self.path)
        return parse_segment(raw, self.path, consistent)

    def check_invariants(self) -> None:
        """Raise AssertionError if the segment is inconsistent with this owner, or holds a field
        no owner writes (segment.FIELD_BOUNDS). O(1).

        Call it when no other thread of this process publishes.
        """
        try:
            snap = self.snapshot()
        except KVCachedError as exc:
            if self._closed or self._detached is not None:
                raise
            raise AssertionError(f"tracker {self.name!r}: {exc}") from None
        problems = []
        if not snap.consistent:
            problems.append("a seqlock stayed odd")
        if (snap.pid, snap.start_time, snap.pid_ns) != self._identity:
            problems.append(f"owner {snap.pid} is not this process {self._identity[0]}")
        if snap.name != self.name:
            problems.append(f"name {snap.name!r} != {self.name!r}")
        if snap.ack_request_seq > snap.request_seq or snap.ack_request_seq & 1:
            problems.append(f"ack {snap.ack_request_seq} beyond request {snap.request_seq}")
        if problems:
            raise AssertionError(f"tracker {self.name!r}: " + "; ".join(problems))

    # -- life cycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Take the heartbeat and limit-request jobs off the poller, and unlink the segment (if
        it is still ours). Idempotent; safe from any thread, a limit callback included (it then
        does not wait for itself).

        Waits for a limit callback in progress: do not call it while holding a lock the callback
        takes. A forked child that inherited this object leaves its parent's segment alone.
        """
        self._close(join=True)

    def _close(self, join: bool) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            cancel_close_at_exit(self)
            if os.getpid() != self._identity[0]:
                return
            if join:  # (a signal handler does not: Note [Signals and clean-up])
                self.stop_watcher()
                self._heartbeat.cancel()
            try:
                if os.stat(self.path).st_ino == self._ino:
                    os.unlink(self.path)
            except FileNotFoundError:
                pass
            with self._write_lock:  # a write in progress finishes first; later ones skip the file
                os.close(self._fd)

    def __enter__(self) -> MemInfoTracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MemInfoTracker(name={self.name!r}, path={self.path!r}, closed={self._closed})"


def _check_limit(limit_bytes: object) -> int:
    return as_int(limit_bytes, "limit_bytes", minimum=NO_LIMIT, maximum=I64_MAX,
                  hint=f"give bytes, or NO_LIMIT ({NO_LIMIT}) for no limit")


# Note [Signals and clean-up]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# close() unlinks the segment; atexit runs it at a normal exit, including one by an uncaught
# KeyboardInterrupt (SIGINT's default) or by a SystemExit an application's SIGTERM handler
# raises. kvcached installs no signal handler unless the application calls close_on_signals():
# making a tracker used to wrap the SIGTERM and SIGINT handlers of the main thread, and whether an
# engine's own handler was then wrapped (installed before) or silently replaced kvcached's
# (installed after) depended on import order. A process killed by SIGTERM with no handler leaves
# its segment, as a SIGKILLed one does: readers see its owner dead (Note [Telling a dead owner]
# in files), gc_segments() removes it, and an instance of the same name takes it over; a budget
# slot it held is reclaimed the same way (Note [Slot heartbeats] in budget).
# With close_on_signals(), a signal whose previous disposition is SIG_DFL would kill the process
# without atexit, so the handler closes every tracker (without taking its jobs off the poller,
# which would wait for a job in progress: the main thread the handler interrupted may hold the
# write lock that job waits for, or the poller's own lock, and the process dies next anyway; the
# write lock is re-entrant for the same reason), restores SIG_DFL and
# re-sends the signal: the process still dies of it, with the usual exit status. A previous
# Python handler (SIGINT's default_int_handler, a server's own) is called instead and clean-up is
# left to the exit it leads to: unlinking then would hide a process that catches the signal and
# keeps running. SIG_IGN stays ignored. Handlers can only be installed from the main thread.

