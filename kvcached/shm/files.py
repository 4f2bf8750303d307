"""Shared-memory files and process identity, shared by the instance segments and the budgets.

Both keep one small file per object under ``/dev/shm``, name it after the object, create it
complete (never half-initialised), open it only as a regular file of this user
(``open_checked``: Note [Files in /dev/shm]), and tell a dead owner from a live one by pid, start
time and pid namespace. This module is the one place those rules live (``segment``, ``owner``,
``client`` and ``budget`` import them; nothing here imports any of them).

Pure Python, imports neither torch nor the compiled core (``kvctl`` must start fast). Linux only
(``/dev/shm``, ``/proc``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import MAX_NAME_BYTES
from ..errors import KVCachedConfigError, KVCachedError

SHM_DIR = "/dev/shm"
TMP_PREFIX = ".kvcached-tmp."
# Linux's PID_MAX_LIMIT on 64-bit machines: /proc/sys/kernel/pid_max is at most this, in every pid
# namespace, so a pid field above it names no process (and would overflow pid_t in os.kill).
MAX_PID = 1 << 22
# Every open of a file under SHM_DIR: a link is not followed, a FIFO does not block the open, and
# the fd is not inherited across exec. See Note [Files in /dev/shm].
OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


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
    if not 0 < pid <= MAX_PID:
        return False  # no process has that pid
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


@dataclass(frozen=True, slots=True)
class ShmKind:
    """One kind of file kvcached keeps under SHM_DIR: what ``open_checked`` accepts as one, and
    the fixes its messages name (``{name}``: the object's name)."""

    what: str          # "kvcached segment"
    prefix: str        # file name = prefix + object name
    min_bytes: int     # a shorter regular file cannot be one
    fix: str           # how a file of this user that is not one is removed
    force_fix: str     # how an entry that is no regular file is removed

    def name_of(self, path: str) -> str:
        return os.path.basename(path)[len(self.prefix):]


class ShmFileError(KVCachedError):
    """The entry at a kvcached name is no regular file of this user (a FIFO, a directory, a
    symbolic link, a socket, a file this user cannot open, another user's file): kvcached reads
    nothing from it. ``removable`` is False for another user's entry, which ``kvctl gc --force``
    leaves alone. See Note [Files in /dev/shm]."""

    def __init__(self, message: str, path: str, what: str, removable: bool) -> None:
        super().__init__(message)
        self.path, self.what, self.removable = path, what, removable


_TYPE_NAMES = {stat.S_IFIFO: "FIFO", stat.S_IFDIR: "directory", stat.S_IFLNK: "symbolic link",
               stat.S_IFSOCK: "socket", stat.S_IFCHR: "character device",
               stat.S_IFBLK: "block device", stat.S_IFREG: "regular file"}


def open_checked(path: str, kind: ShmKind, *, writable: bool = False, whole: bool = True) -> int:
    """An fd of ``path``, opened without following a link or blocking (``OPEN_FLAGS``), once
    fstat says it is a regular file owned by this user and, if ``whole``, at least
    ``kind.min_bytes`` long. Three system calls. See Note [Files in /dev/shm].

    Raises:
        FileNotFoundError: nothing is at ``path``.
        ShmFileError: something else than a regular file of this user is there; the message
            names the path, what it is and the fix.
        KVCachedError: a regular file shorter than ``kind.min_bytes`` (``whole`` only).
        Nothing is left open.
    """
    try:
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | OPEN_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:   # ELOOP: a link; EISDIR, ENXIO (a socket); EACCES: mode or owner
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise exc from None
        raise _not_usable(path, kind, st, exc.strerror) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise _not_usable(path, kind, st)
        if whole and st.st_size < kind.min_bytes:
            raise KVCachedError(
                f"{path} is {st.st_size} bytes, not a {kind.what} (at least {kind.min_bytes} "
                f"bytes); {kind.fix.format(name=kind.name_of(path))}")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _not_usable(path: str, kind: ShmKind, st: os.stat_result,
                strerror: str | None = None) -> ShmFileError:
    what = _TYPE_NAMES.get(stat.S_IFMT(st.st_mode), "special file")
    me = os.geteuid()
    if st.st_uid != me:
        return ShmFileError(
            f"{path} is a {what} owned by uid {st.st_uid}, not by this user (uid {me}): kvcached "
            f"uses only its own user's files under {SHM_DIR}; run this as uid {st.st_uid}, or "
            "have that user (or root) remove it", path, f"{what} of uid {st.st_uid}", False)
    fix = kind.force_fix.format(name=kind.name_of(path))
    if stat.S_ISREG(st.st_mode):   # ours, but the open failed (mode 000, say)
        return ShmFileError(f"{path} cannot be opened ({strerror}), so it is no {kind.what} "
                            f"kvcached wrote; {fix}", path, what, True)
    return ShmFileError(f"{path} is a {what}, not a {kind.what} (kvcached makes only regular "
                        f"files); {fix}", path, what, True)


def remove_entry(path: str, keep_regular: bool = False) -> str | None:
    """Remove whatever is at ``path``: unlink it, or rmdir an empty directory; never a
    directory's contents. What it was (``"FIFO"``, ``"directory"``, ...), or None if
    ``keep_regular`` and a regular file is there now (left for gc to judge by its content).

    Raises:
        FileNotFoundError: nothing is there.
        KVCachedError: a directory that is not empty, or the removal is not permitted (the
            message names the path and why). Nothing removed.
    """
    mode = os.lstat(path).st_mode
    if keep_regular and stat.S_ISREG(mode):
        return None
    what = _TYPE_NAMES.get(stat.S_IFMT(mode), "special file")
    try:
        if what == "directory":
            os.rmdir(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ENOTEMPTY:
            raise KVCachedError(
                f"{path} is a directory that is not empty: kvcached never removes a directory's "
                f"contents; look at them and remove it by hand (rm -r {path})") from None
        raise KVCachedError(f"cannot remove {path}: {exc.strerror}") from None
    return what


@dataclass
class Sweep:
    """What one gc pass did: {name: why} of the entries it removed, and of the entries it left
    for an operator (each why names the fix)."""

    removed: dict[str, str] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)

    def unusable(self, name: str, exc: ShmFileError, force: bool) -> None:
        """gc's answer to an entry that is no regular file of this user: removed with ``force``
        if this user's (Note [Files in /dev/shm]), else kept and reported."""
        if not (force and exc.removable):
            self.kept[name] = str(exc)
            return
        try:   # (a regular file now, where a FIFO was: judged by its content next time)
            what = remove_entry(exc.path, keep_regular=exc.what != "regular file")
        except FileNotFoundError:
            return
        except KVCachedError as err:
            self.kept[name] = str(err)
            return
        if what is not None:
            self.removed[name] = (f"a {what}, not a regular file" if what != "regular file"
                                  else "a file this user cannot open")


def create_exclusive(path: str, content: bytes) -> int | None:
    """Create ``path`` holding ``content``, fully written before any reader can open it.

    Writes a hidden temporary file and hard-links it into place, so a reader never sees a
    half-initialised segment. Returns an O_RDWR fd of the new file, or None if ``path`` exists.
    Complexity: O(len(content)); three system calls beyond the write.
    """
    tmp = os.path.join(SHM_DIR, f"{TMP_PREFIX}{os.getpid()}.{os.urandom(6).hex()}")
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, 0o600)
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


def replace_if_dead(path: str, kind: ShmKind, is_dead: Callable[[bytes], bool],
                    nbytes: int = 4096) -> bool:
    """Unlink ``path`` if ``is_dead(its first nbytes bytes)``, under its flock so that two
    processes taking over the same dead name cannot unlink each other's fresh file. True if it
    is gone now.

    Raises:
        ShmFileError: no regular file of this user is there (``open_checked``); nothing removed.
    """
    try:
        fd = open_checked(path, kind, whole=False)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.lstat(path).st_ino != os.fstat(fd).st_ino:
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
#
# Note [Files in /dev/shm]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# /dev/shm is writable by every local user, and its entries at kvcached's names are input like
# any other. A plain open() of a FIFO waits for a writer forever (kvctl list, kvtop and an
# instance starting under the name hung); a link would let whoever made it point our reads and
# writes (an operator's `kvctl budget NAME SIZE`, a limit request) at any file we may write. So
# every open goes through open_checked(): O_NOFOLLOW (a link fails with ELOOP), O_NONBLOCK (a
# FIFO opens at once), O_CLOEXEC, then fstat: only a regular file is read, and only one of this
# effective uid. Another user's file is reported, never read or joined: kvcached makes its files
# mode 0600, so another user's file at our name was not written by our instances, and a
# world-writable budget someone else made would let them set our caps and watch our usage. Root
# is no exception (its kvctl sees root's instances; run kvctl as the user that runs them). What
# the file holds is range-checked once, where it is parsed (segment.invalid_segment; budget's
# _header_problem and _slots_problem): a pid above MAX_PID overflowed os.kill, a usage of -2**63
# overflowed kvtop's bar, slots summing past an i64 made struct.pack fail in every new holder
# and in gc.
# What is done with each: a regular file of ours that is no segment or budget of any version
# (truncated, scribbled on, fields out of range) is no instance's (ours appear complete, by
# link()), and `kvctl gc` removes it, as before. A FIFO, directory, link or socket is nothing
# kvcached ever makes, so no crash left it: gc reports it with the fix, `gc --force` removes it
# (unlink; rmdir for an empty directory, never a directory's contents), as do
# `kvctl delete NAME --force` and `kvctl budget NAME --delete --force`. An instance starting
# under such a name, or a holder joining such a budget, is refused with the same message.
# Another user's entry is never removed by gc, --force included (bulk clean-up must not act on
# what another user made); `delete --force`, which names the one entry, removes it where this
# user may. gc --force looks at the entry again just before removing it and leaves a regular
# file that appeared there meanwhile (a new instance's segment) for gc to judge by its content.
