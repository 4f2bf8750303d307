"""Shared-memory files and process identity, shared by the instance segments and the budgets.

Both keep one small file per object under ``/dev/shm``, name it after the object, create it
complete (never half-initialised), and tell a dead owner from a live one by pid, start time and
pid namespace. This module is the one place those rules live (``segment``, ``owner``, ``client``
and ``budget`` import them; nothing here imports any of them).

Pure Python, imports neither torch nor the compiled core (``kvctl`` must start fast). Linux only
(``/dev/shm``, ``/proc``).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable

from ..config import MAX_NAME_BYTES
from ..errors import KVCachedConfigError, KVCachedError

SHM_DIR = "/dev/shm"
TMP_PREFIX = ".kvcached-tmp."


# --------------------------------------------------------------------------------------------
# Process identity: pid + start time + pid namespace. See Note [Telling a dead owner].
# --------------------------------------------------------------------------------------------

def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks after boot, or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def _own_pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


PID_NS = _own_pid_ns()
# This process's pid, kept current across fork without a getpid() call per write.
pid_now = [os.getpid()]
os.register_at_fork(after_in_child=lambda: pid_now.__setitem__(0, os.getpid()))
_START_TIME: dict[int, int] = {}


def own_identity() -> tuple[int, int, int]:
    """(pid, start_time, pid_ns) of this process, as written into segments."""
    pid = os.getpid()
    start = _START_TIME.get(pid)
    if start is None:
        start = _START_TIME[pid] = process_start_time(pid) or 0
    return pid, start, PID_NS


def owner_alive(pid: int, start_time: int, pid_ns: int) -> bool | None:
    """True if that process still runs, False if it is gone, None if this process cannot tell
    (the owner lives in another pid namespace)."""
    if pid <= 0:
        return False
    if pid_ns and PID_NS and pid_ns != PID_NS:
        return None
    current = process_start_time(pid)
    if current is not None:
        return start_time == 0 or current == start_time
    try:  # /proc may hide other users' processes (hidepid): ask the kernel
        os.kill(pid, 0)
    except PermissionError:
        return True  # exists, owned by another user; its start time cannot be checked
    except ProcessLookupError:
        return False
    return False  # a zombie


# --------------------------------------------------------------------------------------------
# Names and files
# --------------------------------------------------------------------------------------------

def validate_name(name: str) -> str:
    """Return ``name`` if it can name a segment, else raise KVCachedConfigError."""
    if not isinstance(name, str) or not name or name in (".", ".."):
        raise KVCachedConfigError(f"segment name {name!r} is invalid: give a non-empty string")
    if "/" in name or not name.isprintable():
        raise KVCachedConfigError(
            f"segment name {name!r} is invalid: '/' and control characters are not allowed; "
            "use letters, digits, '_', '-' or '.'")
    if len(name.encode()) > MAX_NAME_BYTES:
        raise KVCachedConfigError(
            f"segment name {name[:40]!r}... is {len(name.encode())} bytes in UTF-8; "
            f"the most is {MAX_NAME_BYTES}")
    return name


def create_exclusive(path: str, content: bytes) -> int | None:
    """Create ``path`` holding ``content``, fully written before any reader can open it.

    Writes a hidden temporary file and hard-links it into place, so a reader never sees a
    half-initialised segment. Returns an O_RDWR fd of the new file, or None if ``path`` exists.
    Complexity: O(len(content)); three system calls beyond the write.
    """
    tmp = os.path.join(SHM_DIR, f"{TMP_PREFIX}{os.getpid()}.{os.urandom(6).hex()}")
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileNotFoundError:
        raise KVCachedError(
            f"{SHM_DIR} does not exist: kvcached needs Linux POSIX shared memory (tmpfs on "
            f"{SHM_DIR}); mount one or run on Linux") from None
    except PermissionError:
        raise KVCachedError(
            f"{SHM_DIR} is not writable by this user; make it world-writable with the sticky "
            "bit (mode 1777), as Linux sets it up") from None
    try:
        os.write(fd, content)
        try:
            os.link(tmp, path)
        except FileExistsError:
            os.close(fd)
            return None
        return fd
    finally:
        os.unlink(tmp)


def replace_if_dead(path: str, is_dead: Callable[[bytes], bool], nbytes: int = 4096) -> bool:
    """Unlink ``path`` if ``is_dead(its first nbytes bytes)``, under its flock so that two
    processes taking over the same dead name cannot unlink each other's fresh file. True if it
    is gone now."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino != os.fstat(fd).st_ino:
                return False  # replaced meanwhile: look again
        except FileNotFoundError:
            return True
        if not is_dead(os.pread(fd, nbytes, 0)):
            return False
        os.unlink(path)
        return True
    finally:
        os.close(fd)


# Note [Telling a dead owner]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A pid alone is not an identity: pids are reused. A segment keeps its owner's start time from
# /proc/<pid>/stat; the owner is dead when /proc/<pid> is gone, is a zombie, or started at another
# time. Containers sharing /dev/shm may have separate pid namespaces, where a pid means another
# process; a segment keeps its owner's pid-namespace inode, and owner_alive() answers None to a
# reader in another namespace, who judges only by the heartbeat (the tracker: dead once it is
# older than its STALE_AFTER_S; the budget: older than the budget's stale_after_s). In the
# tracker, "stale" in a snapshot means dead *or* a heartbeat older than STALE_AFTER_S (a hung
# owner); gc removes only the dead.
