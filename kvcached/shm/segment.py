"""The instance segment: its format, the seqlock both sides follow, and a reader's snapshot of it.

Why a segment and not a socket or a file: operators (``kvctl``, ``kvtop``) must see every instance
on a machine at once, even instances that hang, and an instance publishes its usage many times a
second (the manager's publishing job) without waiting on anyone. A small POSIX shared-memory file
per instance (``/dev/shm/kvcached.<name>``), created once and kept open for the life of the
instance, gives both: the owner writes its fields with ``pwrite`` (~3 µs a publish, no lock shared
with any other process), readers copy the file with ``pread`` under sequence counters. Nobody maps
it: a mapping faults once another program truncates the file (Note [A segment changed by another
process]). The reference project opened, locked, mapped and closed its segment on every page
alloc/free; kvcached never does.

This module is the format both sides share: the layout below, the seqlock fences, the names, the
consistent copy a reader takes (``read_consistent``) and what it says (``Snapshot``). The owner
writes with ``owner.MemInfoTracker``; operators read and request with ``client``. Pure Python,
imports neither torch nor the compiled core: ``kvctl list`` must start in well under 200 ms.
Linux only (``/dev/shm``, ``/proc``).

Segment layout, version 1 (512 bytes, native byte order: little-endian on every CUDA host)

====== ======= ===================== ==========================================================
offset type    field                 meaning
====== ======= ===================== ==========================================================
0      char[4] magic                 ``b"KVCT"``
4      u32     version               layout version, 1
8      i64     segment_bytes         size of the segment, 512
16     i64     pid                   owner process id
24     i64     start_time            owner start time (clock ticks after boot; tells pid reuse)
32     i64     pid_ns                inode of the owner's pid namespace (0: unknown)
40     i64     created_ns            CLOCK_REALTIME ns when the segment was created
48     i64     heartbeat_ns          CLOCK_REALTIME ns, refreshed by the owner's heartbeat job
56     i64     page_size_bytes       physical page size of the instance (0: unknown)
64     u64     usage_seq             seqlock of the usage block (odd while being written)
72     i64     used_bytes            bytes in pages holding live blocks
80     i64     reserved_bytes        bytes mapped but holding no live block (reserved pool)
88     u64     limit_seq             seqlock of the limit block (odd while being written)
96     i64     limit_bytes           current limit; -1 = no limit (capacity bounds the instance)
104    i64     limit_revision        revision of the current limit
112    i64     limit_status          code of STATUS_NAMES: state of the current limit
120    i64     capacity_bytes        most bytes this instance could ever map
128    i64     ack_request_seq       request_seq of the last request the instance handled
136    i64     ack_status            code of STATUS_NAMES: outcome of that request
144    i64     ack_ns                CLOCK_REALTIME ns when that outcome was recorded
152    u64     request_seq           seqlock of the request block; its even value names a request
160    i64     request_limit_bytes   limit requested by an operator
168    i64     request_revision      revision of that request
176    i64     request_pid           pid of the requester
184    i64     request_ns            CLOCK_REALTIME ns when the request was written
192    byte[]  (reserved)            zero, 64 bytes
256    char[]  name                  instance name, UTF-8, NUL-padded to 256 bytes
====== ======= ===================== ==========================================================


Writers: the usage block is written only by ``MemInfoTracker.publish`` (one thread at a time, see
Note [Seqlock over pread and pwrite]); the limit block by the owner under its limit lock; the
request block by operators under ``flock(LOCK_EX)`` of the segment file (see Note [Limit
requests]); ``heartbeat_ns`` by the owner's heartbeat job, as one aligned 8-byte pwrite. What a
limit request's revision means: ``kvcached.limits``.
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ..errors import KVCachedConfigError, KVCachedError
from ..limits import I64_MAX, NO_LIMIT
from .files import MAX_PID, SHM_DIR, ShmKind, open_checked, owner_alive, validate_name

SEGMENT_PREFIX = "kvcached."
MAGIC = b"KVCT"
VERSION = 1
SEGMENT_BYTES = 512
NAME_BYTES = 256
STALE_AFTER_S = 3.0             # a heartbeat older than this makes its instance stale

STATUS_NAMES = ("none", "applied", "deferred", "stale", "conflict", "error")
_STATUS_CODE = {name: code for code, name in enumerate(STATUS_NAMES)}

LAYOUT = struct.Struct("=4sI" + "q" * 23 + "64x" + f"{NAME_BYTES}s")
FIELDS = (
    "magic", "version", "segment_bytes", "pid", "start_time", "pid_ns", "created_ns",
    "heartbeat_ns", "page_size_bytes", "usage_seq", "used_bytes", "reserved_bytes", "limit_seq",
    "limit_bytes", "limit_revision", "limit_status", "capacity_bytes", "ack_request_seq",
    "ack_status", "ack_ns", "request_seq", "request_limit_bytes", "request_revision",
    "request_pid", "request_ns", "name",
)
# Byte offset of every field, in layout order (the module docstring's table, checked by a test).
OFFSETS = dict(zip(FIELDS, (0, 4) + tuple(range(8, 192, 8)) + (256,)))
# Index of each i64 field in the segment viewed as an array of int64 ("words").
WORDS = {field: offset // 8 for field, offset in OFFSETS.items() if offset >= 8 and field != "name"}
W_HEARTBEAT = WORDS["heartbeat_ns"]
W_USAGE_SEQ, W_USED, W_RESERVED = WORDS["usage_seq"], WORDS["used_bytes"], WORDS["reserved_bytes"]
W_LIMIT_SEQ, W_REQUEST_SEQ = WORDS["limit_seq"], WORDS["request_seq"]
_READ_ATTEMPTS = 10_000
WORD = struct.Struct("=q")

assert LAYOUT.size == SEGMENT_BYTES and OFFSETS["request_ns"] == 184

# What an owner writes into each field: a version-1 segment holding a value outside is another
# program's doing, and no reader uses it (Note [Files in /dev/shm] in files). Not here: the
# status codes (decoded by status_name, "unknown(<code>)" for others) and the request's limit,
# revision, pid and time, which operators write and the owner judges itself (it answers a request
# no operator could make with "error": Note [Limit requests]).
_ANY = (0, I64_MAX)
FIELD_BOUNDS = {
    "segment_bytes": (SEGMENT_BYTES, SEGMENT_BYTES), "pid": (1, MAX_PID), "start_time": _ANY,
    "pid_ns": _ANY, "created_ns": _ANY, "heartbeat_ns": _ANY, "page_size_bytes": _ANY,
    "usage_seq": _ANY, "used_bytes": _ANY, "reserved_bytes": _ANY, "limit_seq": _ANY,
    "limit_bytes": (NO_LIMIT, I64_MAX), "limit_revision": _ANY, "capacity_bytes": _ANY,
    "ack_request_seq": _ANY, "ack_ns": _ANY, "request_seq": _ANY,
}

SEGMENT_FILES = ShmKind(
    "kvcached segment", SEGMENT_PREFIX, SEGMENT_BYTES, fix="`kvctl gc` removes it",
    force_fix="`kvctl delete {name} --force` or `kvctl gc --force` removes it")

log = logging.getLogger("kvcached")


# --------------------------------------------------------------------------------------------
# Memory ordering of the seqlocks. See Note [Seqlock ordering on weakly ordered CPUs].
# --------------------------------------------------------------------------------------------

# CPUs whose stores become visible in program order and whose loads are not reordered with
# older loads (total store order): no fence is needed there.
TSO_MACHINES = frozenset({"x86_64", "amd64", "i386", "i486", "i586", "i686"})


def fence_for(machine: str) -> Callable[[], None] | None:
    """The full memory fence the seqlocks need on CPU ``machine`` (``os.uname().machine``), or
    None where program order is already the order other cores see (TSO).

    Elsewhere it is libatomic's ``atomic_thread_fence(memory_order_seq_cst)`` called through
    ctypes (``dmb ish`` on aarch64, ~0.3 µs a call); without libatomic it warns once and returns
    None. See Note [Seqlock ordering on weakly ordered CPUs].
    """
    if machine.lower() in TSO_MACHINES:
        return None
    import ctypes

    try:
        thread_fence = ctypes.CDLL("libatomic.so.1").atomic_thread_fence
    except (OSError, AttributeError):
        log.warning(
            "kvcached: libatomic.so.1 (atomic_thread_fence) is missing on this %s machine: the "
            "shared-memory segments are read and written without memory fences, so a reader may, "
            "rarely, see a torn usage figure or limit request; install libatomic1", machine)
        return None
    thread_fence.argtypes, thread_fence.restype = (ctypes.c_int,), None
    seq_cst = 5  # memory_order_seq_cst in <stdatomic.h>
    return lambda: thread_fence(seq_cst)


# Read at each use as ``segment.FENCE`` (owner and client too), so that a test can count fences.
FENCE = fence_for(os.uname().machine)


# --------------------------------------------------------------------------------------------
# Names (process identity and the file helpers: files)
# --------------------------------------------------------------------------------------------

def segment_path(name: str) -> str:
    """Path of the segment file of instance ``name``."""
    return os.path.join(SHM_DIR, SEGMENT_PREFIX + validate_name(name))


_default_names = itertools.count()


def default_name() -> str:
    """A name unique within this machine while this process lives: ``kvcached_<pid>_<n>``."""
    return f"kvcached_{os.getpid()}_{next(_default_names)}"


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Snapshot:
    """One consistent copy of a segment, as a reader saw it (sizes in bytes, times in ns)."""

    name: str
    path: str
    version: int
    pid: int
    start_time: int
    pid_ns: int
    created_ns: int
    heartbeat_ns: int
    page_size_bytes: int
    used_bytes: int
    reserved_bytes: int
    limit_bytes: int
    limit_revision: int
    limit_status: str
    capacity_bytes: int
    ack_request_seq: int
    ack_status: str
    ack_ns: int
    request_seq: int
    request_limit_bytes: int
    request_revision: int
    request_pid: int
    request_ns: int
    usage_seq: int
    heartbeat_age_s: float
    alive: bool
    stale: bool
    consistent: bool

    @property
    def mapped_bytes(self) -> int:
        """used + reserved: what the instance has mapped now."""
        return self.used_bytes + self.reserved_bytes

    def to_dict(self) -> dict:
        return asdict(self)


# Fields a Snapshot holds as the segment stores them (the others are decoded or derived).
_SNAPSHOT_COPIES = tuple(field for field in FIELDS if field not in (
    "magic", "segment_bytes", "limit_seq", "name", "limit_status", "ack_status"))


def status_name(code: int) -> str:
    """The name of a status code as the segment stores it (``unknown(<code>)`` for others)."""
    return STATUS_NAMES[code] if 0 <= code < len(STATUS_NAMES) else f"unknown({code})"


def check_segment(raw: bytes, path: str) -> dict[str, object]:
    """The fields of ``raw`` (a copy of the file at ``path``) by name, once they are checked to be
    a segment of this layout version with every field in range (FIELD_BOUNDS).

    Raises:
        KVCachedError: not a segment, a field out of range (the message names it, its value and
            the range), or a segment of another layout version.
    """
    why = invalid_segment(raw)
    if why is not None:
        raise KVCachedError(f"{path}: {why}; `kvctl gc` removes it")
    values = dict(zip(FIELDS, LAYOUT.unpack_from(raw)))
    if values["version"] != VERSION:
        raise KVCachedError(
            f"{path} has layout version {values['version']}; this kvcached reads version "
            f"{VERSION}: use the kvctl of the kvcached that created it")
    return values


def parse_segment(raw: bytes, path: str, consistent: bool) -> Snapshot:
    """The snapshot ``raw`` (a copy of the file at ``path``) holds; judges its owner by /proc.

    Raises:
        KVCachedError: see ``check_segment``.
    """
    values = check_segment(raw, path)
    age_s = max(0.0, (time.time_ns() - values["heartbeat_ns"]) / 1e9)
    alive = owner_alive(values["pid"], values["start_time"], values["pid_ns"])
    if alive is None:
        alive = age_s <= STALE_AFTER_S
    return Snapshot(
        name=values["name"].rstrip(b"\0").decode(errors="replace"),
        path=path,
        limit_status=status_name(values["limit_status"]),
        ack_status=status_name(values["ack_status"]),
        heartbeat_age_s=age_s,
        alive=alive,
        stale=not alive or age_s > STALE_AFTER_S,
        consistent=consistent,
        **{field: values[field] for field in _SNAPSHOT_COPIES},
    )


def _seqs(raw: bytes) -> tuple[int, int, int]:
    return (WORD.unpack_from(raw, OFFSETS["usage_seq"])[0],
            WORD.unpack_from(raw, OFFSETS["limit_seq"])[0],
            WORD.unpack_from(raw, OFFSETS["request_seq"])[0])


def pread_segment(fd: int, path: str) -> bytes:
    """The whole segment, one pread; KVCachedError if the file is shorter."""
    raw = os.pread(fd, SEGMENT_BYTES, 0)
    if len(raw) < SEGMENT_BYTES:
        raise KVCachedError(f"{path} is {len(raw)} bytes, not a kvcached segment "
                            f"({SEGMENT_BYTES} bytes); `kvctl gc` removes it")
    return raw


def read_consistent(fd: int, path: str) -> tuple[bytes, bool]:
    """Copy the segment while no seqlock writer is inside (Note [Seqlock over pread and pwrite]):
    the copy in the middle of three reads counts if the counters of the first and the third are
    even and equal. Reads with pread, so a truncated file is an error, never a fault.

    Returns (bytes, consistent); consistent is False only if a writer stayed inside for all
    attempts (it died mid-write, or was descheduled): the copy is then the last one read.

    Raises:
        KVCachedError: the file is shorter than a segment.
    """
    fence = FENCE
    before = pread_segment(fd, path)
    raw = before
    for attempt in range(_READ_ATTEMPTS):
        if fence is not None:
            fence()  # the copy is read after the counters ...
        raw = pread_segment(fd, path)
        if fence is not None:
            fence()  # ... and before they are read again
        after = pread_segment(fd, path)
        seqs = _seqs(before)
        if not (seqs[0] | seqs[1] | seqs[2]) & 1 and seqs == _seqs(after):
            return raw, True
        before = after
        if attempt % 64 == 63:
            time.sleep(0)
    return raw, False


def open_segment(path: str, writable: bool = False) -> int:
    """An fd of the segment file at ``path``: a regular file of this user, at least a segment
    long (``files.open_checked``; FileNotFoundError, ShmFileError or KVCachedError if not)."""
    return open_checked(path, SEGMENT_FILES, writable=writable)


def read_path(path: str) -> Snapshot:
    """A consistent snapshot of the segment file at ``path``."""
    fd = open_segment(path)
    try:
        raw, consistent = read_consistent(fd, path)
    finally:
        os.close(fd)
    return parse_segment(raw, path, consistent)


# --------------------------------------------------------------------------------------------
# Judging a file at a segment's name
# --------------------------------------------------------------------------------------------

def invalid_segment(raw: bytes) -> str | None:
    """Why ``raw`` (a file's first bytes) cannot be a kvcached segment of any layout version, or
    None if it may be one: too short, another magic, or (this version only) a field outside
    FIELD_BOUNDS. Never says so of a file another kvcached version wrote. O(fields)."""
    if len(raw) < SEGMENT_BYTES:
        return f"{len(raw)} bytes, not a kvcached segment"
    if raw[:4] != MAGIC:
        return f"magic {raw[:4]!r}, not a kvcached segment"
    values = dict(zip(FIELDS, LAYOUT.unpack_from(raw)))
    if values["version"] != VERSION:
        return None
    for field, (low, high) in FIELD_BOUNDS.items():
        if not low <= values[field] <= high:
            return (f"{field} is {values[field]}, outside [{low}, {high}]: no kvcached writes "
                    "that, another program changed the file")
    return None


def _dead_segment(raw: bytes) -> bool:
    if invalid_segment(raw) is not None or struct.unpack_from("=I", raw, 4)[0] != VERSION:
        return False  # not ours to judge (and every field is in range below)
    pid, start, pid_ns = struct.unpack_from("=qqq", raw, OFFSETS["pid"])
    alive = owner_alive(pid, start, pid_ns)
    if alive is None:
        heartbeat_ns = struct.unpack_from("=q", raw, OFFSETS["heartbeat_ns"])[0]
        return time.time_ns() - heartbeat_ns > STALE_AFTER_S * 1e9
    return not alive


def removable(raw: bytes) -> bool:
    """A dead owner's segment, or a file at a segment's name that cannot be a segment (truncated
    or overwritten by another program: no instance writes to it any more, see
    Note [A segment changed by another process])."""
    return invalid_segment(raw) is not None or _dead_segment(raw)


def status_code(status: str) -> int:
    """The code of status name ``status``; KVCachedConfigError for a name not in STATUS_NAMES."""
    code = _STATUS_CODE.get(status)
    if code is None:
        raise KVCachedConfigError(f"status={status!r} is invalid: use one of {STATUS_NAMES}")
    return code


# Note [Seqlock over pread and pwrite]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Each block has a sequence counter. Its single writer writes it odd, then the fields, then even,
# each with its own pwrite; a reader copies the segment three times with pread and keeps the
# middle copy only if the counters of the first and the third were all even and equal (retrying
# otherwise): then no writer was inside a block during the middle copy. The writer never waits
# for a reader. Single writer per block: within the owner every write goes through
# MemInfoTracker._write_block (owner) under one lock (publish from the manager's publishing job,
# the limit block from set_limit and the limit-request job), and the owner keeps a shadow of what it wrote, so it never
# reads its own fields back; the request block is written by other processes, serialised by
# flock. Every value is validated before the first write, so no failing write leaves a counter
# odd. The order in which other cores see the writes and reads: Note [Seqlock ordering on weakly
# ordered CPUs].
#
# Note [Seqlock ordering on weakly ordered CPUs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A seqlock needs two orders: the writer's odd counter visible before the fields and the fields
# before the even counter; the reader's field loads after its first counter load and before its
# last. Each step here is its own pread or pwrite, whose kernel copy has finished when the call
# returns, and a counter is one aligned 8-byte word. What remains is the CPU:
# - x86-64 (TSO) keeps both orders itself: stores become visible in program order, and loads are
#   not reordered with older loads. Nothing more is needed.
# - aarch64 (Grace, GB10) and other weakly ordered CPUs may make two stores visible out of order
#   and satisfy two loads out of order, across system calls too (entering and leaving the kernel
#   is no memory barrier). Nothing in CPython 3.11 orders them either: the eval loop's own atomics
#   are relaxed, reference counts are plain, and the GIL changes hands only every switch
#   interval; a lock (GIL, threading.Lock) is an acquire/release pair, which orders accesses
#   against the lock word, not an access before it against one after it. Python alone cannot
#   order two accesses; a fence instruction must run between them.
# So on any machine not known to be TSO, fence_for() supplies a full fence, libatomic's
# atomic_thread_fence(memory_order_seq_cst) called through ctypes (`dmb ish` on aarch64, ~0.3 µs
# a call), and every seqlock writer (owner's _write_block, client's request_limit) and reader
# (read_consistent, owner's _handle_request) calls it at the two points above. Without libatomic it warns once and runs
# unfenced. A compiled helper would drop that dependency, but not in the compiled core: importing
# it loads the CUDA bindings (~80 ms) and kvctl must start fast. Requesters need no fence among
# themselves: flock is a kernel lock, and its hand-over orders everything before it.
#
# Note [A segment changed by another process]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Once another program shrinks a file (`truncate -s 0`), the next access to a mapping of it
# raises SIGBUS, which Python cannot catch; nothing stops a named tmpfs file from shrinking (only
# memfd seals can, and readers need a file to open), and a size check before each access leaves a
# window in which a busy writer still faults. So no process maps a segment: the owner writes with
# pwrite and readers read with pread, which report a short file as a short read instead. The owner
# fstats the file before each write and reads the magic at each heartbeat; once the file is
# shorter than a segment or holds another magic (truncated and extended again, or scribbled on),
# it stops writing to it, logs one warning, and publishes and takes requests no more until it
# restarts. Unlinking or replacing the file is harmless: the owner's fd keeps the old file alive
# and it writes into a segment nobody sees, as after `kvctl delete --force`. A file at a segment's
# name that is too short, holds another magic or a field no owner writes (FIELD_BOUNDS) is no
# instance's live segment (segments appear complete, by link()), so gc_segments() removes it and
# a new instance of that name takes over. Entries that are no regular file of this user: Note
# [Files in /dev/shm] in files.
#
# Note [Limit requests]
# ~~~~~~~~~~~~~~~~~~~~~
# kvctl (client.request_limit) takes flock(LOCK_EX) on the segment file, validates everything
# (limit and revision within what an i64 field holds, the next revision and sequence too), then
# writes the request block under its seqlock and releases the lock: requesters are serialised,
# never see each other's half-written request, and a refused request leaves the block untouched.
# The instance's limit-request job (on the process's poller) polls request_seq, one 8-byte pread
# per poll, refuses a request no operator could have written (answered "error", the callback not
# called), calls the manager's callback outside any lock of the segment, then records the
# outcome and ack_request_seq in the limit block. An exception anywhere in a poll is logged and
# the job polls on. Requests are idempotent by revision, so a request that is superseded before
# the instance saw it is simply never acknowledged by its own sequence number (wait_for_ack
# reports the later one's outcome).
