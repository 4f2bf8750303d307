"""What operators use: read, list, and scan instance segments; request a limit and wait for the
answer; delete a segment; collect dead owners' segments (``kvctl``, ``kvtop``, the demo).

Pure Python over ``segment``'s format: ``kvctl list`` must start in well under 200 ms.
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ..checks import as_int
from ..errors import KVCachedError
from ..limits import I64_MAX, NO_LIMIT
from . import segment
from .files import (
    SHM_DIR,
    TMP_PREFIX,
    ShmFileError,
    Sweep,
    process_start_time,
    remove_entry,
    replace_if_dead,
)
from .segment import (
    OFFSETS,
    SEGMENT_FILES,
    SEGMENT_PREFIX,
    W_REQUEST_SEQ,
    WORD,
    WORDS,
    Snapshot,
    check_segment,
    open_segment,
    parse_segment,
    pread_segment,
    read_consistent,
    read_path,
    removable,
    segment_path,
)


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------

def read_segment(name: str) -> Snapshot:
    """A consistent snapshot of instance ``name``'s segment. O(1); four system calls.

    Raises:
        KVCachedError: no segment of that name (the message lists how to see the names), or the
            file is not a kvcached segment of this layout version.
    """
    path = segment_path(name)
    try:
        return read_path(path)
    except FileNotFoundError:
        raise KVCachedError(
            f"no kvcached instance named {name!r} ({path} does not exist); "
            "`kvctl list` shows the names") from None


def scan_segments() -> Iterator[tuple[str, Snapshot | Exception]]:
    """(name, snapshot or the error reading it) for every ``kvcached.*`` entry, sorted by name.
    An entry that is no regular file of this user yields a ShmFileError (never opened
    blocking, never followed: Note [Files in /dev/shm] in files)."""
    try:
        entries = sorted(e for e in os.listdir(SHM_DIR) if e.startswith(SEGMENT_PREFIX))
    except FileNotFoundError:
        return
    for entry in entries:
        name = entry[len(SEGMENT_PREFIX):]
        try:
            yield name, read_path(os.path.join(SHM_DIR, entry))
        except FileNotFoundError:
            continue  # removed while listing
        except (OSError, KVCachedError, ValueError) as exc:
            yield name, exc


def list_segments() -> list[Snapshot]:
    """Snapshots of every readable kvcached segment on this machine, sorted by name."""
    return [snap for _, snap in scan_segments() if isinstance(snap, Snapshot)]


# --------------------------------------------------------------------------------------------
# Operators: limit requests, deletion, garbage collection
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class LimitRequest:
    """A request written into a segment; ``request_seq`` is matched by ``ack_request_seq``."""

    name: str
    limit_bytes: int
    revision: int
    request_seq: int


def request_limit(name: str, limit_bytes: int, revision: int | None = None) -> LimitRequest:
    """Ask instance ``name`` to change its limit to ``limit_bytes`` (0 allowed; NO_LIMIT removes
    the limit).

    ``revision`` None takes the next free revision (one above both the instance's current
    revision and the last requested one), so concurrent operators never reuse one. The instance
    notices the request within its poll interval (5 ms); ``wait_for_ack`` waits for its answer.
    A later request supersedes one the instance has not handled yet. See Note [Limit requests] in
    segment.

    Raises:
        KVCachedConfigError: ``limit_bytes`` outside [NO_LIMIT, I64_MAX] or ``revision`` outside
            [0, I64_MAX] (what the segment's fields hold), or either not an int (numpy integers
            are accepted; bools and floats are not).
        KVCachedError: no such instance, its file is not a segment of this version (or not a
            regular file of this user: ShmFileError), its revision is already I64_MAX, or its
            request sequence is corrupt.
        In every case nothing was written.
    """
    limit_bytes = as_int(limit_bytes, "limit_bytes", minimum=NO_LIMIT, maximum=I64_MAX,
                         hint=f"give bytes (0 releases everything), or NO_LIMIT ({NO_LIMIT}) to "
                              "remove the limit")
    if revision is not None:
        revision = as_int(revision, "revision", minimum=0, maximum=I64_MAX,
                          hint="or None for the next one")
    path = segment_path(name)
    try:
        fd = open_segment(path, writable=True)
    except FileNotFoundError:
        raise KVCachedError(
            f"no kvcached instance named {name!r} ({path} does not exist); "
            "`kvctl list` shows the names") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        raw = pread_segment(fd, path)
        check_segment(raw, path)
        words = memoryview(raw).cast("q")
        if revision is None:
            current = max(words[WORDS["limit_revision"]], words[WORDS["request_revision"]])
            if current >= I64_MAX:
                raise KVCachedError(
                    f"instance {name!r} is at revision {current}, the largest a segment "
                    "holds: there is no next revision; restart the instance")
            revision = max(current, -1) + 1
        seq = words[W_REQUEST_SEQ]
        seq += seq & 1  # a requester that died mid-write left it odd
        if not 0 <= seq <= I64_MAX - 2:
            raise KVCachedError(
                f"{path}: request sequence {seq} is corrupt (another program wrote it); "
                "restart the instance")
        # Everything is validated: from here on no write can fail for a bad value, so the
        # sequence is never left odd. See Note [Limit requests] in segment.
        fence = segment.FENCE
        os.pwrite(fd, WORD.pack(seq + 1), OFFSETS["request_seq"])
        if fence is not None:
            fence()  # odd before the fields
        os.pwrite(fd, struct.pack("=4q", limit_bytes, revision, os.getpid(), time.time_ns()),
                  OFFSETS["request_limit_bytes"])
        if fence is not None:
            fence()  # the fields before even
        os.pwrite(fd, WORD.pack(seq + 2), OFFSETS["request_seq"])
        return LimitRequest(name, limit_bytes, revision, seq + 2)
    finally:
        os.close(fd)


def wait_for_ack(request: LimitRequest, timeout_s: float = 1.0,
                 poll_s: float = 0.002) -> Snapshot | None:
    """Poll until the instance has handled ``request`` (or a later one); its snapshot then.

    Returns None if ``timeout_s`` passed first, or earlier if the owner died or its file stopped
    being a segment. Compare ``snapshot.ack_request_seq`` with ``request.request_seq``: greater
    means a later request superseded this one and ``ack_status`` is that request's outcome.
    """
    path = segment_path(request.name)
    deadline = time.monotonic() + timeout_s
    try:
        fd = open_segment(path)
    except (FileNotFoundError, KVCachedError):
        return None
    try:
        while True:
            try:
                raw, consistent = read_consistent(fd, path)
                snap = parse_segment(raw, path, consistent)
            except KVCachedError:
                return None  # truncated or overwritten by another program
            if snap.ack_request_seq >= request.request_seq:
                return snap
            if not snap.alive or time.monotonic() >= deadline:
                return None
            time.sleep(poll_s)
    finally:
        os.close(fd)


def delete_segment(name: str, force: bool = False) -> None:
    """Remove instance ``name``'s segment; with ``force``, whatever has its name (an empty
    directory too; see Note [Files in /dev/shm] in files).

    Raises:
        KVCachedError: no such segment; or its owner is alive and ``force`` is False (the owner
            would go on writing into a segment nobody can see); or, without ``force``, the entry
            is no regular file of this user (ShmFileError, naming the fix); with ``force``, a
            directory that is not empty or an entry this user may not remove. Nothing was
            removed.
    """
    path = segment_path(name)
    if not os.path.lexists(path):
        raise KVCachedError(
            f"no kvcached instance named {name!r}; `kvctl list` shows the names")
    if force:
        try:
            remove_entry(path)
        except FileNotFoundError:
            pass
        return
    if not replace_if_dead(path, SEGMENT_FILES, removable):
        snap = read_path(path)
        raise KVCachedError(
            f"instance {name!r} is alive (pid {snap.pid}); stop it first, or force the removal "
            "(kvctl delete --force), after which it publishes into a segment nobody sees")


def gc_segments(force: bool = False) -> Sweep:
    """Remove the segments whose owner is dead, the files of this user at segment names that are
    not segments (truncated, overwritten, a field out of range), and leftover temporary files;
    with ``force``, also this user's entries that are no regular file (FIFO, empty directory,
    link, socket). What was removed and what was kept for an operator, by name, with why.

    Owners in another pid namespace count as dead only when their heartbeat is older than
    STALE_AFTER_S. A live owner's valid segment is never removed, nor another user's entry. See
    Note [Telling a dead owner] and Note [Files in /dev/shm] in files. O(number of segments).
    """
    sweep = Sweep()
    for name, snap in scan_segments():
        if isinstance(snap, ShmFileError):
            sweep.unusable(name, snap, force)
            continue
        if isinstance(snap, Snapshot):
            if snap.alive:
                continue
            why = "owner dead"
        elif isinstance(snap, KVCachedError):
            why = "not a valid segment"
        else:
            sweep.kept[name] = str(snap)   # an error reading it
            continue
        path = os.path.join(SHM_DIR, SEGMENT_PREFIX + name)
        try:  # judged again under the file's lock: it may have been replaced meanwhile
            if os.path.lexists(path) and replace_if_dead(path, SEGMENT_FILES, removable):
                sweep.removed[name] = why
        except (OSError, KVCachedError):
            continue  # replaced meanwhile by something else: the next gc judges it
    for entry in os.listdir(SHM_DIR):
        if entry.startswith(TMP_PREFIX):
            pid = entry[len(TMP_PREFIX):].split(".")[0]
            if pid.isdigit() and process_start_time(int(pid)) is None:
                try:
                    os.unlink(os.path.join(SHM_DIR, entry))
                except OSError:
                    pass  # gone meanwhile, or a directory: not a file kvcached made
    return sweep

