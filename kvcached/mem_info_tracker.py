"""Shared-memory segment per instance: usage, limit, and the operator's limit requests.

Why a segment and not a socket or a file: operators (``kvctl``, ``kvtop``) must see every instance
on a machine at once, even instances that hang, and an instance publishes its usage many times a
second (the manager's publisher thread) without waiting on anyone. A small POSIX shared-memory file
per instance (``/dev/shm/kvcached.<name>``), created once and kept open for the life of the
instance, gives both: the owner writes its fields with ``pwrite`` (~3 µs a publish, no lock shared
with any other process), readers copy the file with ``pread`` under sequence counters. Nobody maps
it: a mapping faults once another program truncates the file (Note [A segment changed by another
process]). The reference project opened, locked, mapped and closed its segment on every page
alloc/free; this module never does.

Pure Python, imports neither torch nor the compiled core: ``kvctl list`` must start in well under
200 ms. Linux only (``/dev/shm``, ``/proc``). Process identity and the file helpers it shares with
``budget`` live in ``_shm``.

The module reads in three parts, each under its banner: Part 1, the segment format (the layout
below, the seqlock fences, names); Part 2, the reader used by ``kvctl`` and ``kvtop``
(``read_segment``, ``list_segments``, ``request_limit``, ``wait_for_ack``, ``delete_segment``,
``gc_segments``) and the limit arithmetic shared with the runtime (``classify_limit_request``,
``split_limit``); Part 3, the owner's publisher and request watcher (``MemInfoTracker``) with its
clean-up at exit (atexit; signal handlers only when the application calls ``close_on_signals``).
One module, not three: the layout, the readers' seqlock and the writers' seqlock are one protocol,
checked together (Note [Seqlock over pread and pwrite]).

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
48     i64     heartbeat_ns          CLOCK_REALTIME ns, refreshed by the owner's background thread
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
requests]); ``heartbeat_ns`` by the owner's background thread, as one aligned 8-byte pwrite.

Revision semantics (the manager's ``apply`` callback implements them; ``classify_limit_request``
spells them out): a request whose revision is lower than the current revision is ``stale`` and
changes nothing; the same revision with a different limit is a ``conflict`` and changes nothing; the
same revision and limit is idempotent; a higher revision is applied now (``applied``) or recorded
and applied once usage has fallen below it (``deferred``).
"""

from __future__ import annotations

import atexit
import fcntl
import itertools
import logging
import os
import signal
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass

from ._shm import (  # noqa: F401  (MAX_NAME_BYTES: re-exported)
    I64_MAX,
    MAX_NAME_BYTES,
    SHM_DIR,
    TMP_PREFIX,
    create_exclusive,
    own_identity,
    owner_alive,
    pid_now,
    process_start_time,
    replace_if_dead,
    validate_name,
)
from .checks import as_int
from .errors import KVCachedConfigError, KVCachedError

SEGMENT_PREFIX = "kvcached."
MAGIC = b"KVCT"
VERSION = 1
SEGMENT_BYTES = 512
NAME_BYTES = 256
NO_LIMIT = -1
STALE_AFTER_S = 3.0
HEARTBEAT_INTERVAL_S = 0.1

STATUS_NAMES = ("none", "applied", "deferred", "stale", "conflict", "error")
_STATUS_CODE = {name: code for code, name in enumerate(STATUS_NAMES)}

_LAYOUT = struct.Struct("=4sI" + "q" * 23 + "64x" + f"{NAME_BYTES}s")
_FIELDS = (
    "magic", "version", "segment_bytes", "pid", "start_time", "pid_ns", "created_ns",
    "heartbeat_ns", "page_size_bytes", "usage_seq", "used_bytes", "reserved_bytes", "limit_seq",
    "limit_bytes", "limit_revision", "limit_status", "capacity_bytes", "ack_request_seq",
    "ack_status", "ack_ns", "request_seq", "request_limit_bytes", "request_revision",
    "request_pid", "request_ns", "name",
)
# Byte offset of every field, in layout order (the module docstring's table, checked by a test).
OFFSETS = dict(zip(_FIELDS, (0, 4) + tuple(range(8, 192, 8)) + (256,)))
# Index of each i64 field in the segment viewed as an array of int64 ("words").
_W = {field: offset // 8 for field, offset in OFFSETS.items() if offset >= 8 and field != "name"}
_W_HEARTBEAT = _W["heartbeat_ns"]
_W_USAGE_SEQ, _W_USED, _W_RESERVED = _W["usage_seq"], _W["used_bytes"], _W["reserved_bytes"]
_W_LIMIT_SEQ, _W_REQUEST_SEQ = _W["limit_seq"], _W["request_seq"]
_READ_ATTEMPTS = 10_000
_WORD = struct.Struct("=q")

assert _LAYOUT.size == SEGMENT_BYTES and OFFSETS["request_ns"] == 184
assert (_W_USAGE_SEQ, _W_USED, _W_RESERVED) == (8, 9, 10)  # literals in publish()

log = logging.getLogger("kvcached")


# ============================================================================================
# Part 1. The segment format: layout (the table above), seqlock fences, names
# ============================================================================================

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


_FENCE = fence_for(os.uname().machine)


# --------------------------------------------------------------------------------------------
# Names (process identity and the file helpers: _shm)
# --------------------------------------------------------------------------------------------

def segment_path(name: str) -> str:
    """Path of the segment file of instance ``name``."""
    return os.path.join(SHM_DIR, SEGMENT_PREFIX + validate_name(name))


_default_names = itertools.count()


def default_name() -> str:
    """A name unique within this machine while this process lives: ``kvcached_<pid>_<n>``."""
    return f"kvcached_{os.getpid()}_{next(_default_names)}"


# ============================================================================================
# Part 2. The reader: what kvctl and kvtop use (read, list, limit requests, delete, gc)
# ============================================================================================

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
_SNAPSHOT_COPIES = tuple(field for field in _FIELDS if field not in (
    "magic", "segment_bytes", "limit_seq", "name", "limit_status", "ack_status"))


def _status_name(code: int) -> str:
    return STATUS_NAMES[code] if 0 <= code < len(STATUS_NAMES) else f"unknown({code})"


def _parse(raw: bytes, path: str, consistent: bool) -> Snapshot:
    values = dict(zip(_FIELDS, _LAYOUT.unpack(raw)))
    if values["magic"] != MAGIC:
        raise KVCachedError(f"{path} is not a kvcached segment (magic {values['magic']!r})")
    if values["version"] != VERSION:
        raise KVCachedError(
            f"{path} has layout version {values['version']}; this kvcached reads version "
            f"{VERSION}: use the kvctl of the kvcached that created it")
    age_s = max(0.0, (time.time_ns() - values["heartbeat_ns"]) / 1e9)
    alive = owner_alive(values["pid"], values["start_time"], values["pid_ns"])
    if alive is None:
        alive = age_s <= STALE_AFTER_S
    return Snapshot(
        name=values["name"].rstrip(b"\0").decode(errors="replace"),
        path=path,
        limit_status=_status_name(values["limit_status"]),
        ack_status=_status_name(values["ack_status"]),
        heartbeat_age_s=age_s,
        alive=alive,
        stale=not alive or age_s > STALE_AFTER_S,
        consistent=consistent,
        **{field: values[field] for field in _SNAPSHOT_COPIES},
    )


def _seqs(raw: bytes) -> tuple[int, int, int]:
    return (_WORD.unpack_from(raw, OFFSETS["usage_seq"])[0],
            _WORD.unpack_from(raw, OFFSETS["limit_seq"])[0],
            _WORD.unpack_from(raw, OFFSETS["request_seq"])[0])


def _pread_segment(fd: int, path: str) -> bytes:
    raw = os.pread(fd, SEGMENT_BYTES, 0)
    if len(raw) < SEGMENT_BYTES:
        raise KVCachedError(f"{path} is {len(raw)} bytes, not a kvcached segment "
                            f"({SEGMENT_BYTES} bytes); `kvctl gc` removes it")
    return raw


def _read_consistent(fd: int, path: str) -> tuple[bytes, bool]:
    """Copy the segment while no seqlock writer is inside (Note [Seqlock over pread and pwrite]):
    the copy in the middle of three reads counts if the counters of the first and the third are
    even and equal. Reads with pread, so a truncated file is an error, never a fault.

    Returns (bytes, consistent); consistent is False only if a writer stayed inside for all
    attempts (it died mid-write, or was descheduled): the copy is then the last one read.

    Raises:
        KVCachedError: the file is shorter than a segment.
    """
    fence = _FENCE
    before = _pread_segment(fd, path)
    raw = before
    for attempt in range(_READ_ATTEMPTS):
        if fence is not None:
            fence()  # the copy is read after the counters ...
        raw = _pread_segment(fd, path)
        if fence is not None:
            fence()  # ... and before they are read again
        after = _pread_segment(fd, path)
        seqs = _seqs(before)
        if not (seqs[0] | seqs[1] | seqs[2]) & 1 and seqs == _seqs(after):
            return raw, True
        before = after
        if attempt % 64 == 63:
            time.sleep(0)
    return raw, False


def _open_segment(path: str, writable: bool = False) -> int:
    """An fd of the segment file at ``path``, checked to be at least a segment long."""
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < SEGMENT_BYTES:
            raise KVCachedError(
                f"{path} is {size} bytes, not a kvcached segment ({SEGMENT_BYTES} bytes); "
                "`kvctl gc` removes it")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _read_path(path: str) -> Snapshot:
    fd = _open_segment(path)
    try:
        raw, consistent = _read_consistent(fd, path)
    finally:
        os.close(fd)
    return _parse(raw, path, consistent)


def read_segment(name: str) -> Snapshot:
    """A consistent snapshot of instance ``name``'s segment. O(1); four system calls.

    Raises:
        KVCachedError: no segment of that name (the message lists how to see the names), or the
            file is not a kvcached segment of this layout version.
    """
    path = segment_path(name)
    try:
        return _read_path(path)
    except FileNotFoundError:
        raise KVCachedError(
            f"no kvcached instance named {name!r} ({path} does not exist); "
            "`kvctl list` shows the names") from None


def scan_segments() -> Iterator[tuple[str, Snapshot | Exception]]:
    """(name, snapshot or the error reading it) for every ``kvcached.*`` file, sorted by name."""
    try:
        entries = sorted(e for e in os.listdir(SHM_DIR) if e.startswith(SEGMENT_PREFIX))
    except FileNotFoundError:
        return
    for entry in entries:
        name = entry[len(SEGMENT_PREFIX):]
        try:
            yield name, _read_path(os.path.join(SHM_DIR, entry))
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
    revision and the last requested one), so concurrent operators never reuse one. The instance's
    watcher notices the request within its poll interval; ``wait_for_ack`` waits for its answer.
    A later request supersedes one the instance has not handled yet. See Note [Limit requests].

    Raises:
        KVCachedConfigError: ``limit_bytes`` outside [NO_LIMIT, I64_MAX] or ``revision`` outside
            [0, I64_MAX] (what the segment's fields hold), or either not an int (numpy integers
            are accepted; bools and floats are not).
        KVCachedError: no such instance, its file is not a segment, its revision is already
            I64_MAX, or its request sequence is corrupt.
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
        fd = _open_segment(path, writable=True)
    except FileNotFoundError:
        raise KVCachedError(
            f"no kvcached instance named {name!r} ({path} does not exist); "
            "`kvctl list` shows the names") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        raw = _pread_segment(fd, path)
        if raw[:4] != MAGIC:
            raise KVCachedError(f"{path} is not a kvcached segment; `kvctl gc` removes it")
        words = memoryview(raw).cast("q")
        if revision is None:
            current = max(words[_W["limit_revision"]], words[_W["request_revision"]])
            if current >= I64_MAX:
                raise KVCachedError(
                    f"instance {name!r} is at revision {current}, the largest a segment "
                    "holds: there is no next revision; restart the instance")
            revision = max(current, -1) + 1
        seq = words[_W_REQUEST_SEQ]
        seq += seq & 1  # a requester that died mid-write left it odd
        if not 0 <= seq <= I64_MAX - 2:
            raise KVCachedError(
                f"{path}: request sequence {seq} is corrupt (another program wrote it); "
                "restart the instance")
        # Everything is validated: from here on no write can fail for a bad value, so the
        # sequence is never left odd. See Note [Limit requests].
        fence = _FENCE
        os.pwrite(fd, _WORD.pack(seq + 1), OFFSETS["request_seq"])
        if fence is not None:
            fence()  # odd before the fields
        os.pwrite(fd, struct.pack("=4q", limit_bytes, revision, os.getpid(), time.time_ns()),
                  OFFSETS["request_limit_bytes"])
        if fence is not None:
            fence()  # the fields before even
        os.pwrite(fd, _WORD.pack(seq + 2), OFFSETS["request_seq"])
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
        fd = _open_segment(path)
    except (FileNotFoundError, KVCachedError):
        return None
    try:
        while True:
            try:
                raw, consistent = _read_consistent(fd, path)
                snap = _parse(raw, path, consistent)
            except KVCachedError:
                return None  # truncated or overwritten by another program
            if snap.ack_request_seq >= request.request_seq:
                return snap
            if not snap.alive or time.monotonic() >= deadline:
                return None
            time.sleep(poll_s)
    finally:
        os.close(fd)


def invalid_segment(raw: bytes) -> str | None:
    """Why ``raw`` (a file's first bytes) cannot be a kvcached segment of any layout version, or
    None if it may be one. Never says so of a file another kvcached version wrote."""
    if len(raw) < SEGMENT_BYTES:
        return f"{len(raw)} bytes, not a kvcached segment"
    if raw[:4] != MAGIC:
        return f"magic {raw[:4]!r}, not a kvcached segment"
    return None


def _dead_segment(raw: bytes) -> bool:
    if invalid_segment(raw) is not None or struct.unpack_from("=I", raw, 4)[0] != VERSION:
        return False  # not ours to judge
    pid, start, pid_ns = struct.unpack_from("=qqq", raw, OFFSETS["pid"])
    alive = owner_alive(pid, start, pid_ns)
    if alive is None:
        heartbeat_ns = struct.unpack_from("=q", raw, OFFSETS["heartbeat_ns"])[0]
        return time.time_ns() - heartbeat_ns > STALE_AFTER_S * 1e9
    return not alive


def _removable(raw: bytes) -> bool:
    """A dead owner's segment, or a file at a segment's name that cannot be a segment (truncated
    or overwritten by another program: no instance writes to it any more, see
    Note [A segment changed by another process])."""
    return invalid_segment(raw) is not None or _dead_segment(raw)


def delete_segment(name: str, force: bool = False) -> None:
    """Remove instance ``name``'s segment.

    Raises:
        KVCachedError: no such segment; or its owner is alive and ``force`` is False (the owner
            would go on writing into a segment nobody can see). Nothing was removed.
    """
    path = segment_path(name)
    if not os.path.exists(path):
        raise KVCachedError(
            f"no kvcached instance named {name!r}; `kvctl list` shows the names")
    if force:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    if not replace_if_dead(path, _removable):
        snap = _read_path(path)
        raise KVCachedError(
            f"instance {name!r} is alive (pid {snap.pid}); stop it first, or force the removal "
            "(kvctl delete --force), after which it publishes into a segment nobody sees")


def gc_segments() -> dict[str, str]:
    """Remove the segments whose owner is dead, the files at segment names that are not segments
    (truncated or overwritten), and leftover temporary files; {name: why it was removed}.

    Owners in another pid namespace count as dead only when their heartbeat is older than
    STALE_AFTER_S. A live owner's valid segment is never removed. See Note [Telling a dead
    owner]. O(number of segments).
    """
    removed = {}
    for name, snap in scan_segments():
        if isinstance(snap, Snapshot):
            if snap.alive:
                continue
            why = "owner dead"
        elif isinstance(snap, KVCachedError):
            why = "not a valid segment"
        else:
            continue  # unreadable by this user: not ours to judge
        path = os.path.join(SHM_DIR, SEGMENT_PREFIX + name)
        try:  # judged again under the file's lock: it may have been replaced meanwhile
            if os.path.exists(path) and replace_if_dead(path, _removable):
                removed[name] = why
        except OSError:
            continue
    for entry in os.listdir(SHM_DIR):
        if entry.startswith(TMP_PREFIX):
            pid = entry[len(TMP_PREFIX):].split(".")[0]
            if pid.isdigit() and process_start_time(int(pid)) is None:
                try:
                    os.unlink(os.path.join(SHM_DIR, entry))
                except FileNotFoundError:
                    pass
    return removed


def classify_limit_request(current_limit_bytes: int, current_revision: int, limit_bytes: int,
                           revision: int) -> str:
    """How an instance must treat a limit request, by the module's revision semantics.

    Returns ``"stale"`` (revision below the current one: reject), ``"conflict"`` (same revision,
    other limit: reject), ``"same"`` (same revision and limit: answer with the current state) or
    ``"new"`` (higher revision: apply now, or defer until usage allows).
    """
    if revision < current_revision:
        return "stale"
    if revision == current_revision:
        return "same" if limit_bytes == current_limit_bytes else "conflict"
    return "new"


def split_limit(limit_bytes: int, capacities: list[int], page_size_bytes: int = 0) -> list[int]:
    """Divide an instance-wide limit across its pools in proportion to their capacities.

    Largest-remainder rounding: the shares sum exactly to ``limit_bytes`` (or to it rounded down to
    a whole number of pages when ``page_size_bytes`` > 0, every share then being page-aligned).
    Pools of capacity 0 get 0, unless all capacities are 0 (then equal shares). NO_LIMIT gives
    NO_LIMIT to every pool. O(n log n).

    Example: ``split_limit(10, [1, 1, 1]) == [4, 3, 3]``.

    Raises:
        KVCachedConfigError: negative limit (other than NO_LIMIT), capacity or page size.
    """
    if limit_bytes == NO_LIMIT:
        return [NO_LIMIT] * len(capacities)
    if limit_bytes < 0:
        raise KVCachedConfigError(
            f"limit_bytes={limit_bytes} is invalid: give an int >= 0, or NO_LIMIT (-1)")
    if any(c < 0 for c in capacities):
        raise KVCachedConfigError(f"capacities={capacities} must all be >= 0")
    if page_size_bytes < 0:
        raise KVCachedConfigError(f"page_size_bytes={page_size_bytes} must be >= 0")
    if not capacities:
        return []
    unit = page_size_bytes or 1
    units = limit_bytes // unit
    weights = capacities if sum(capacities) else [1] * len(capacities)
    total = sum(weights)
    shares = [units * w // total for w in weights]
    remainders = sorted(range(len(weights)), key=lambda i: (-(units * weights[i] % total), i))
    for i in remainders[: units - sum(shares)]:
        shares[i] += 1
    return [s * unit for s in shares]


# ============================================================================================
# Part 3. The publisher and watcher: the owner's side (MemInfoTracker)
# ============================================================================================

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
        _close_all(join=False)  # the thread interrupted may hold a lock its watcher waits for
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
    manager calls it from its one publisher thread); the limit block is written under
    ``self._limit_lock`` (``set_limit``, ``set_capacity``, the watcher); the heartbeat word is
    written only by the background thread. ``close`` is idempotent and may run in any thread but
    the background thread itself (from a limit callback); it returns once that thread has ended.

    Why not ``multiprocessing.shared_memory``: before Python 3.13 it registers every segment with
    the resource tracker, which unlinks segments that *other* processes created when this one
    exits. Why pread/pwrite and not a mapping: a mapping of a file another program truncates
    faults (SIGBUS) on the next access; see Note [A segment changed by another process].
    """

    def __init__(self, name: str | None = None, *, capacity_bytes: int = 0,
                 page_size_bytes: int = 0, limit_bytes: int = NO_LIMIT,
                 heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        """Create and map the segment; start the heartbeat thread.

        ``name``: the instance's name (the caller passes KVCACHED_IPC_NAME, suffixed per pool
        where it has several); None picks ``kvcached_<pid>_<n>``. A segment of that name left by
        a dead process, or a file there that is not a segment, is taken over.

        Raises:
            KVCachedConfigError: invalid name or sizes, or a live process owns that name (the
                message names its pid, or says it is this process).
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
        content = _LAYOUT.pack(
            MAGIC, VERSION, SEGMENT_BYTES, pid, start_time, pid_ns, now, now, page_size_bytes,
            0, 0, 0,                                                      # usage block
            0, limit_bytes, 0, _STATUS_CODE["none"], capacity_bytes, 0, 0, 0,  # limit block
            0, 0, 0, 0, 0,                                                # request block
            self.name.encode())
        self._fd = self._create(content)
        self._ino = os.fstat(self._fd).st_ino
        # What this process wrote: the owner reads its own fields here, never from the file.
        self._shadow_raw = bytearray(content)
        self._shadow = memoryview(self._shadow_raw).cast("q")
        self._detached: str | None = None  # why the file no longer holds the segment
        # Every write of the file by this process. Re-entrant: a signal handler may close the
        # tracker while its thread is inside a write (See Note [Signals and clean-up]).
        self._write_lock = threading.RLock()
        self._limit_lock = threading.Lock()
        self._close_lock = threading.RLock()  # re-entered by a signal handler
        self._apply: ApplyLimit | None = None
        self._poll_s = heartbeat_interval_s
        self._heartbeat_ns = int(heartbeat_interval_s * 1e9)
        self._closed = False
        self._wake = threading.Event()
        close_at_exit(self)
        self._thread = threading.Thread(target=self._run, name=f"kvcached-tracker-{self.name}",
                                        daemon=True)
        self._thread.start()

    def _create(self, content: bytes) -> int:
        for _ in range(16):
            fd = create_exclusive(self.path, content)
            if fd is not None:
                return fd
            if not replace_if_dead(self.path, _removable) and os.path.exists(self.path):
                raise KVCachedConfigError(self._name_taken())
        raise KVCachedError(f"could not create {self.path}: other processes keep replacing it")

    def _name_taken(self) -> str:
        try:
            snap = _read_path(self.path)
        except (OSError, KVCachedError):
            owner = "a file that is not a segment this kvcached can read"
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
        ``self._write_lock``. See Note [A segment changed by another process]."""
        if self._closed or self._detached is not None or pid_now[0] != self._identity[0]:
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

    def _write_block(self, seq_index: int, stores: list[tuple[int, int]]) -> None:
        """Write ``stores`` ((word index, checked value), one block's fields) under the block's
        sequence counter ``seq_index``: into the shadow, then with pwrite into the file."""
        with self._write_lock:
            shadow = self._shadow
            seq = shadow[seq_index] + 1
            for index, value in stores:
                shadow[index] = value
            shadow[seq_index] = seq + 1
            if not self._file_ok():
                return
            fd, fence = self._fd, _FENCE
            first = min(index for index, _ in stores)
            last = max(index for index, _ in stores) + 1
            os.pwrite(fd, _WORD.pack(seq), seq_index * 8)
            if fence is not None:
                fence()  # odd before the fields
            os.pwrite(fd, self._shadow_raw[first * 8:last * 8], first * 8)
            if fence is not None:
                fence()  # the fields before even
            os.pwrite(fd, _WORD.pack(seq + 1), seq_index * 8)

    # -- usage --------------------------------------------------------------------------------

    def publish(self, used_bytes: int, reserved_bytes: int) -> None:
        """Record the instance's usage: an fstat and three pwrites, no waiting (~3 µs).

        Not thread-safe against itself: call it from one thread at a time (the manager's
        publisher thread). After ``close`` it writes nowhere. See Note [Seqlock over pread and
        pwrite].

        Raises:
            KVCachedConfigError: a figure outside [0, I64_MAX] or not an int. Nothing written.
        """
        used_bytes = as_int(used_bytes, "used_bytes", minimum=0, maximum=I64_MAX)
        reserved_bytes = as_int(reserved_bytes, "reserved_bytes", minimum=0, maximum=I64_MAX)
        self._write_block(_W_USAGE_SEQ, [(_W_USED, used_bytes), (_W_RESERVED, reserved_bytes)])

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
        code = _status_code(status)
        with self._limit_lock:
            self._write_limit_block(limit_bytes=limit_bytes, limit_revision=revision,
                                    limit_status=code)

    def recorded_limit(self) -> tuple[int, int, str]:
        """(limit_bytes, revision, status) as this owner last wrote them into the segment. O(1),
        no system call."""
        with self._limit_lock:
            words = self._shadow
            return (words[_W["limit_bytes"]], words[_W["limit_revision"]],
                    _status_name(words[_W["limit_status"]]))

    def set_capacity(self, capacity_bytes: int) -> None:
        """Record the most bytes the instance could ever map (after its tensors were sized).

        Raises:
            KVCachedConfigError: outside [0, I64_MAX] or not an int. Nothing was written.
        """
        capacity_bytes = as_int(capacity_bytes, "capacity_bytes", minimum=0, maximum=I64_MAX)
        with self._limit_lock:
            self._write_limit_block(capacity_bytes=capacity_bytes)

    def _write_limit_block(self, **fields: int) -> None:
        """Assumes ``self._limit_lock``. Every value is checked before the first write, so a
        failure never leaves the sequence odd."""
        self._write_block(_W_LIMIT_SEQ, [
            (_W[field], as_int(value, field, minimum=-I64_MAX - 1, maximum=I64_MAX))
            for field, value in fields.items()])

    # -- background thread: heartbeat and limit requests --------------------------------------

    def start_watcher(self, apply: ApplyLimit, interval_s: float = 0.005) -> None:
        """Poll for operators' limit requests every ``interval_s`` and hand each to ``apply``.

        ``apply(limit_bytes, revision)`` runs in the tracker's thread and returns a dict
        ``{"status": "applied"|"deferred"|"stale"|"conflict", "limit_bytes": int,
        "revision": int}``. For applied/deferred the tracker records limit_bytes and revision
        (default: the requested ones) as the current limit; for stale/conflict it changes only the
        acknowledgement. An exception or a malformed answer is logged and acknowledged as
        ``error``; so is a request the segment holds that no operator could have made (a limit
        below NO_LIMIT, a negative revision: another program wrote it), without calling
        ``apply``. A request already pending when the watcher starts is handled at once.

        Raises:
            KVCachedConfigError: ``interval_s`` not in (0, 1].
        """
        if not 0 < interval_s <= 1:
            raise KVCachedConfigError(
                f"interval_s={interval_s!r} is invalid: give a poll interval in (0, 1] seconds")
        self._apply = apply
        self._poll_s = min(interval_s, self._heartbeat_ns / 1e9)
        self._wake.set()

    def stop_watcher(self) -> None:
        """Stop handing requests to the callback (they stay pending in the segment)."""
        self._apply = None
        self._poll_s = self._heartbeat_ns / 1e9

    def _run(self) -> None:
        next_beat, failing = 0, False
        while not self._closed:
            try:
                now = time.time_ns()
                if now >= next_beat:
                    self._beat(now)
                    next_beat = now + self._heartbeat_ns
                apply = self._apply
                if apply is not None:
                    self._handle_request(apply)
                failing = False
            except Exception:  # a dead thread would leave the instance looking hung for good
                if not failing:
                    log.exception("kvcached: tracker %s: heartbeat or limit request failed; "
                                  "retrying every poll", self.name)
                failing = True
            self._wake.wait(self._poll_s)
            self._wake.clear()

    def _beat(self, now_ns: int) -> None:
        with self._write_lock:
            self._shadow[_W_HEARTBEAT] = now_ns
            if not self._file_ok():
                return
            if os.pread(self._fd, len(MAGIC), 0) != MAGIC:
                self._detach("was overwritten by another program")
                return
            os.pwrite(self._fd, _WORD.pack(now_ns), OFFSETS["heartbeat_ns"])

    def _handle_request(self, apply: ApplyLimit) -> None:
        if self._detached is not None:
            return
        fd, fence = self._fd, _FENCE
        head = os.pread(fd, 8, OFFSETS["request_seq"])
        if len(head) < 8:
            return  # truncated: the next heartbeat detaches
        seq = _WORD.unpack(head)[0]
        if seq & 1 or seq == self._shadow[_W["ack_request_seq"]]:
            return
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
            status, code = "error", _STATUS_CODE["error"]
        else:
            try:
                result = apply(limit_bytes, revision)
                status = result["status"]
                code = _status_code(status)
                if status in ("applied", "deferred"):
                    limit_bytes = _check_limit(result.get("limit_bytes", limit_bytes))
                    revision = as_int(result.get("revision", revision), "revision", minimum=0,
                                      maximum=I64_MAX)
            except Exception:
                log.exception("kvcached: limit callback failed for %s (limit %r, revision %r)",
                              self.name, limit_bytes, revision)
                status, code = "error", _STATUS_CODE["error"]
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
        raw, consistent = _read_consistent(self._fd, self.path)
        return _parse(raw, self.path, consistent)

    def check_invariants(self) -> None:
        """Raise AssertionError if the segment is inconsistent with this owner. O(1).

        Call it when no other thread of this process publishes.
        """
        snap = self.snapshot()
        problems = []
        if not snap.consistent:
            problems.append("a seqlock stayed odd")
        if (snap.pid, snap.start_time, snap.pid_ns) != self._identity:
            problems.append(f"owner {snap.pid} is not this process {self._identity[0]}")
        if snap.name != self.name:
            problems.append(f"name {snap.name!r} != {self.name!r}")
        if snap.used_bytes < 0 or snap.reserved_bytes < 0:
            problems.append(f"negative usage {snap.used_bytes}/{snap.reserved_bytes}")
        if snap.limit_bytes < NO_LIMIT or snap.capacity_bytes < 0:
            problems.append(f"bad limit {snap.limit_bytes} or capacity {snap.capacity_bytes}")
        if snap.ack_request_seq > snap.request_seq or snap.ack_request_seq & 1:
            problems.append(f"ack {snap.ack_request_seq} beyond request {snap.request_seq}")
        if problems:
            raise AssertionError(f"tracker {self.name!r}: " + "; ".join(problems))

    # -- life cycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the background thread, wait for it to end, and unlink the segment (if it is
        still ours). Idempotent; safe from any thread but the background thread itself (a limit
        callback that closes its tracker returns before that thread has ended).

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
            self._wake.set()
            if join and threading.current_thread() is not self._thread:
                self._thread.join()
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


def _status_code(status: str) -> int:
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
# _write_block under one threading.Lock (publish from the manager's publisher thread, the limit
# block from set_limit and the watcher), and the owner keeps a shadow of what it wrote, so it never
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
# a call), and every seqlock writer (_write_block, request_limit) and reader (_read_consistent,
# _handle_request) calls it at the two points above. Without libatomic it warns once and runs
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
# name that is too short or holds another magic is no instance's live segment (segments appear
# complete, by link()), so gc_segments() removes it and a new instance of that name takes over.
#
# Note [Limit requests]
# ~~~~~~~~~~~~~~~~~~~~~
# kvctl takes flock(LOCK_EX) on the segment file, validates everything (limit and revision within
# what an i64 field holds, the next revision and sequence too), then writes the request block
# under its seqlock and releases the lock: requesters are serialised, never see each other's
# half-written request, and a refused request leaves the block untouched. The instance's
# background thread polls request_seq (one 8-byte pread per poll), refuses a request no operator
# could have written (answered "error", the callback not called), calls the manager's callback
# outside any lock of the segment, then records the outcome and ack_request_seq in the limit
# block. An exception anywhere in a poll is logged and the thread polls on. Requests are idempotent by revision, so a request that is
# superseded before the instance saw it is simply never acknowledged by its own sequence number
# (wait_for_ack reports the later one's outcome).
#
# Note [Signals and clean-up]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# close() unlinks the segment; atexit runs it at a normal exit, including one by an uncaught
# KeyboardInterrupt (SIGINT's default) or by a SystemExit an application's SIGTERM handler
# raises. kvcached installs no signal handler unless the application calls close_on_signals():
# making a tracker used to wrap the SIGTERM and SIGINT handlers of the main thread, and whether an
# engine's own handler was then wrapped (installed before) or silently replaced kvcached's
# (installed after) depended on import order. A process killed by SIGTERM with no handler leaves
# its segment, as a SIGKILLed one does: readers see its owner dead (Note [Telling a dead owner]),
# gc_segments() removes it, and an instance of the same name takes it over; a budget slot it held
# is reclaimed the same way (Note [Slot heartbeats] in budget).
# With close_on_signals(), a signal whose previous disposition is SIG_DFL would kill the process
# without atexit, so the handler closes every tracker (without joining its thread: the main
# thread the handler interrupted may hold the write lock the thread waits for, and the process
# dies next anyway; the write lock is re-entrant for the same reason), restores SIG_DFL and
# re-sends the signal: the process still dies of it, with the usual exit status. A previous
# Python handler (SIGINT's default_int_handler, a server's own) is called instead and clean-up is
# left to the exit it leads to: unlinking then would hide a process that catches the signal and
# keeps running. SIG_IGN stays ignored. Handlers can only be installed from the main thread.
