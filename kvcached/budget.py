"""Global budget: instances naming the same budget never map more than it, in sum.

Opt-in (KVCACHED_GLOBAL_BUDGET names it). Per-instance limits cap each instance; a budget caps a
group of them (e.g. every model on one GPU) without an operator dividing the memory in advance:
whoever needs pages takes them from the common budget and gives them back when they are unmapped.

Why a file under /dev/shm with flock, and not a lock-free counter: Python has no atomic
compare-and-swap on shared memory, and the budget is consulted once per *batch* of page maps (a
page map costs ~30 µs on the GPU), so two flock calls (~2 µs) per acquisition are cheap enough.
Why per-holder slots and not one counter: a holder killed by SIGKILL cannot give its share back;
its slot names it (pid, start time, pid namespace), so the next acquirer that finds the budget
short, or ``kvctl gc``, sees the process is gone and takes the slot's bytes back.

Protocol (every process follows it; readers included):

* Every read-modify-write of the segment happens under ``flock(fd, LOCK_EX)`` of the budget file;
  consistent reads (``read_budget``) take ``LOCK_SH``. Within a process, a handle's
  ``threading.Lock`` is taken first (flock does not exclude threads sharing a file description).
* ``held_bytes`` always equals the sum of the slots' ``held_bytes`` and, at every unlock, an
  acquisition has left it <= ``budget_bytes``. Lowering ``budget_bytes`` below ``held_bytes``
  takes nothing back: acquisitions fail until holders release enough.
* A slot is free when its pid is 0. A handle claims one at ``Budget.open`` and frees it at
  ``close`` (releasing what it holds). A slot whose process is dead (see Note [Telling a dead
  owner] in mem_info_tracker) is reclaimed: its bytes are subtracted from ``held_bytes`` and added
  to ``recovered_bytes``. Slots of processes in another pid namespace are never reclaimed.
* The file persists while no one holds it (the operator's setting); ``kvctl budget NAME
  --delete`` removes it.

Segment layout, version 1 (native byte order)

====== ======= ================= ============================================================
offset type    field             meaning
====== ======= ================= ============================================================
0      char[4] magic             ``b"KVCB"``
4      u32     version           layout version, 1
8      i64     segment_bytes     size of the segment
16     i64     budget_bytes      most bytes all holders together may hold
24     i64     held_bytes        sum of the slots' held_bytes
32     i64     num_slots         number of slots, 256
40     i64     created_ns        CLOCK_REALTIME ns at creation
48     i64     recovered_bytes   bytes taken back from dead holders, cumulative
56     i64     (reserved)        zero
64     char[]  name              budget name, UTF-8, NUL-padded to 256 bytes
320    slot[]  slots             num_slots slots of 48 bytes:
                                 +0 pid (0: free), +8 start_time, +16 pid_ns, +24 held_bytes,
                                 +32 token (random, identifies the handle), +40 updated_ns
====== ======= ================= ============================================================
"""

from __future__ import annotations

import atexit
import fcntl
import mmap
import os
import struct
import threading
import time
from dataclasses import dataclass

from .errors import KVCachedConfigError, KVCachedError
from .mem_info_tracker import (
    SHM_DIR,
    create_exclusive,
    owner_alive,
    own_identity,
    validate_name,
)

BUDGET_PREFIX = "kvcached-budget."
MAGIC = b"KVCB"
VERSION = 1
NUM_SLOTS = 256
SLOTS_OFFSET = 320
SLOT_BYTES = 48
SEGMENT_BYTES = SLOTS_OFFSET + NUM_SLOTS * SLOT_BYTES
# A failed acquisition scans the holders for dead ones at most this often per handle (each scan
# reads /proc once per holder).
RECLAIM_EVERY_S = 0.05

_HEADER = struct.Struct("=4sI6q8x256s")
_SLOT = struct.Struct("=6q")
_W_BUDGET, _W_HELD, _W_NUM_SLOTS, _W_RECOVERED = 2, 3, 4, 6
_SLOT_PID, _SLOT_START, _SLOT_NS, _SLOT_HELD, _SLOT_TOKEN, _SLOT_UPDATED = range(6)

assert _HEADER.size == SLOTS_OFFSET and _SLOT.size == SLOT_BYTES

# This process's pid, kept current across fork without a getpid() call per acquisition.
_pid_now = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _pid_now.__setitem__(0, os.getpid()))


def budget_path(name: str) -> str:
    """Path of the segment of budget ``name``."""
    return os.path.join(SHM_DIR, BUDGET_PREFIX + validate_name(name))


def _slot_word(slot: int, field: int) -> int:
    return (SLOTS_OFFSET + slot * SLOT_BYTES) // 8 + field


def _check_size(field: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise KVCachedConfigError(f"{field}={value!r} is invalid: give an int >= 0 (bytes)")
    return value


class _Segment:
    """An open budget file: fd, mapping, int64 view. Callers hold its flock to touch it."""

    def __init__(self, name: str, path: str) -> None:
        self.name, self.path = name, path
        try:
            self.fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise KVCachedError(
                f"no budget named {name!r} ({path} does not exist); create it with "
                f"`kvctl budget {name} SIZE` or Budget.open({name!r}, budget_bytes=...)") from None
        try:
            size = os.fstat(self.fd).st_size
            if size < SEGMENT_BYTES:
                raise KVCachedError(f"{path} is {size} bytes: not a kvcached budget of version "
                                    f"{VERSION} ({SEGMENT_BYTES} bytes)")
            self.mm = mmap.mmap(self.fd, SEGMENT_BYTES)
            if self.mm[:4] != MAGIC or struct.unpack_from("=I", self.mm, 4)[0] != VERSION:
                self.mm.close()
                raise KVCachedError(f"{path} is not a kvcached budget of layout version {VERSION}")
        except BaseException:
            os.close(self.fd)
            raise
        self.words = memoryview(self.mm).cast("q")

    def lock(self, exclusive: bool = True) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def reclaim_dead(self) -> int:
        """Free the slots of dead processes; the bytes taken back. Assumes LOCK_EX."""
        words, recovered = self.words, 0
        for slot in range(NUM_SLOTS):
            pid = words[_slot_word(slot, _SLOT_PID)]
            if pid and owner_alive(pid, words[_slot_word(slot, _SLOT_START)],
                                   words[_slot_word(slot, _SLOT_NS)]) is False:
                recovered += words[_slot_word(slot, _SLOT_HELD)]
                self.clear_slot(slot)
        words[_W_HELD] -= recovered
        words[_W_RECOVERED] += recovered
        return recovered

    def clear_slot(self, slot: int) -> None:
        base = _slot_word(slot, 0)
        for field in range(6):
            self.words[base + field] = 0

    def snapshot(self) -> BudgetSnapshot:
        """Assumes LOCK_SH or LOCK_EX."""
        raw = self.mm[:SEGMENT_BYTES]
        _, _, _, budget, held, _, created, recovered, _ = _HEADER.unpack_from(raw)
        holders = []
        for slot in range(NUM_SLOTS):
            pid, start, pid_ns, slot_held, _, updated = _SLOT.unpack_from(
                raw, SLOTS_OFFSET + slot * SLOT_BYTES)
            if pid:
                alive = owner_alive(pid, start, pid_ns)
                holders.append(Holder(slot, pid, slot_held, alive is not False, updated))
        return BudgetSnapshot(self.name, self.path, budget, held, recovered, created,
                              tuple(holders))

    def close(self) -> None:
        self.words.release()
        self.mm.close()
        os.close(self.fd)


@dataclass(frozen=True, slots=True)
class Holder:
    """One claimed slot. ``alive`` is False only when the process is known to be dead."""

    slot: int
    pid: int
    held_bytes: int
    alive: bool
    updated_ns: int


@dataclass(frozen=True, slots=True)
class BudgetSnapshot:
    """A budget as read under its shared lock (bytes; ns)."""

    name: str
    path: str
    budget_bytes: int
    held_bytes: int
    recovered_bytes: int
    created_ns: int
    holders: tuple[Holder, ...]

    def to_dict(self) -> dict:
        return {
            "name": self.name, "path": self.path, "budget_bytes": self.budget_bytes,
            "held_bytes": self.held_bytes, "recovered_bytes": self.recovered_bytes,
            "created_ns": self.created_ns,
            "holders": [{"slot": h.slot, "pid": h.pid, "held_bytes": h.held_bytes,
                         "alive": h.alive, "updated_ns": h.updated_ns} for h in self.holders],
        }


def _create(name: str, budget_bytes: int) -> None:
    """Create budget ``name`` unless it exists (then nothing changes)."""
    content = _HEADER.pack(MAGIC, VERSION, SEGMENT_BYTES, budget_bytes, 0, NUM_SLOTS,
                           time.time_ns(), 0, name.encode()) + bytes(NUM_SLOTS * SLOT_BYTES)
    fd = create_exclusive(budget_path(name), content)
    if fd is not None:
        os.close(fd)


def set_budget(name: str, budget_bytes: int) -> BudgetSnapshot:
    """Create budget ``name`` of ``budget_bytes``, or change the size of the existing one.

    Lowering it below what is held takes nothing back; acquisitions fail until enough is
    released. Returns the budget after the change.

    Raises:
        KVCachedConfigError: invalid name or negative size. Nothing changed.
    """
    _check_size("budget_bytes", budget_bytes)
    path = budget_path(name)
    if not os.path.exists(path):
        _create(name, budget_bytes)
    seg = _Segment(name, path)
    try:
        seg.lock()
        try:
            seg.words[_W_BUDGET] = budget_bytes
            return seg.snapshot()
        finally:
            seg.unlock()
    finally:
        seg.close()


def read_budget(name: str) -> BudgetSnapshot:
    """Budget ``name`` as read under its shared lock. O(slots).

    Raises:
        KVCachedError: no such budget, or the file is not a budget of this layout version.
    """
    seg = _Segment(validate_name(name), budget_path(name))
    try:
        seg.lock(exclusive=False)
        try:
            return seg.snapshot()
        finally:
            seg.unlock()
    finally:
        seg.close()


def list_budgets() -> list[BudgetSnapshot]:
    """Every readable budget on this machine, sorted by name."""
    try:
        entries = sorted(e for e in os.listdir(SHM_DIR) if e.startswith(BUDGET_PREFIX))
    except FileNotFoundError:
        return []
    budgets = []
    for entry in entries:
        try:
            budgets.append(read_budget(entry[len(BUDGET_PREFIX):]))
        except (OSError, KVCachedError):
            continue  # removed meanwhile, unreadable, or another version
    return budgets


def gc_budgets() -> dict[str, int]:
    """Reclaim the slots of dead holders in every budget; bytes recovered, by budget name."""
    recovered = {}
    for snap in list_budgets():
        if all(h.alive for h in snap.holders):
            continue
        seg = _Segment(snap.name, snap.path)
        try:
            seg.lock()
            try:
                recovered[snap.name] = seg.reclaim_dead()
            finally:
                seg.unlock()
        finally:
            seg.close()
    return recovered


def delete_budget(name: str, force: bool = False) -> None:
    """Remove budget ``name``.

    Raises:
        KVCachedError: no such budget; or live processes hold slots in it and ``force`` is False
            (they would go on counting against a budget nobody else sees). Nothing removed.
    """
    snap = read_budget(name)
    live = [h.pid for h in snap.holders if h.alive]
    if live and not force:
        raise KVCachedError(
            f"budget {name!r} is in use by pid(s) {', '.join(map(str, live))}; stop them first "
            "or force the removal (kvctl budget NAME --delete --force)")
    try:
        os.unlink(snap.path)
    except FileNotFoundError:
        pass


class Budget:
    """This process's handle on a shared budget: acquire and release bytes against it.

    Lock contract: public methods take ``self._lock`` (threads of this process) and then the
    segment's flock (other processes); private ones assume both.

    Use ``Budget.open``; acquire in batches (several pages per call) on the allocator's path.
    A handle belongs to the process that opened it: a forked child must open its own (it would
    share the parent's flock, which then excludes nothing).
    """

    def __init__(self, segment: _Segment, slot: int, token: int) -> None:
        self.name, self.path = segment.name, segment.path
        self._seg = segment
        self._slot = slot
        self._token = token
        self._held = 0
        self._lock = threading.Lock()
        self._next_reclaim = 0.0
        self._closed = False
        self._pid = _pid_now[0]
        atexit.register(self.close)

    @classmethod
    def open(cls, name: str, budget_bytes: int | None = None) -> Budget:
        """Open budget ``name`` (creating it with ``budget_bytes`` if it does not exist; an
        existing budget keeps its size, which operators set) and claim a slot in it.

        Raises:
            KVCachedConfigError: invalid name or size; or the budget does not exist and
                ``budget_bytes`` is None (the message says how to create it).
            KVCachedError: all NUM_SLOTS slots are held by live processes.
        """
        path = budget_path(name)
        if budget_bytes is not None:
            _check_size("budget_bytes", budget_bytes)
            if not os.path.exists(path):
                _create(name, budget_bytes)
        elif not os.path.exists(path):
            raise KVCachedConfigError(
                f"no budget named {name!r}: create it (`kvctl budget {name} 40G`) or pass "
                "budget_bytes to create it on first use")
        seg = _Segment(name, path)
        pid, start, pid_ns = own_identity()
        token = int.from_bytes(os.urandom(7), "little") + 1
        seg.lock()
        try:
            slot = cls._free_slot(seg)
            if slot is None:
                seg.reclaim_dead()
                slot = cls._free_slot(seg)
            if slot is not None:
                base = _slot_word(slot, 0)
                for field, value in ((_SLOT_PID, pid), (_SLOT_START, start), (_SLOT_NS, pid_ns),
                                     (_SLOT_HELD, 0), (_SLOT_TOKEN, token),
                                     (_SLOT_UPDATED, time.time_ns())):
                    seg.words[base + field] = value
        finally:
            seg.unlock()
        if slot is None:
            seg.close()
            raise KVCachedError(
                f"budget {name!r} has no free slot: {NUM_SLOTS} handles of live processes hold "
                "one each; close unused handles (Budget.close)")
        return cls(seg, slot, token)

    @staticmethod
    def _free_slot(seg: _Segment) -> int | None:
        for slot in range(NUM_SLOTS):
            if seg.words[_slot_word(slot, _SLOT_PID)] == 0:
                return slot
        return None

    @property
    def held_bytes(self) -> int:
        """Bytes this handle holds."""
        return self._held

    def try_acquire(self, nbytes: int) -> bool:
        """Take ``nbytes`` from the budget if that keeps the total within it; True if taken.

        Never raises for "not enough": returns False and changes nothing. When short, first
        reclaims the shares of dead holders (at most every RECLAIM_EVERY_S per handle).
        Cost: two flock calls (~2 µs) plus a /proc read per holder when it scans.

        Raises:
            ValueError: ``nbytes`` negative or not an int.
            KVCachedError: the handle is closed, or its slot was taken away (budget deleted and
                recreated, or forcibly reset).
        """
        self._check_amount(nbytes)
        if nbytes == 0:
            return True
        with self._lock:
            self._check_open()
            seg = self._seg
            seg.lock()
            try:
                words = seg.words
                self._check_slot()
                if words[_W_HELD] + nbytes > words[_W_BUDGET]:
                    now = time.monotonic()
                    if now < self._next_reclaim:
                        return False
                    self._next_reclaim = now + RECLAIM_EVERY_S
                    seg.reclaim_dead()
                    if words[_W_HELD] + nbytes > words[_W_BUDGET]:
                        return False
                self._add(nbytes)
                return True
            finally:
                seg.unlock()

    def release(self, nbytes: int) -> None:
        """Give ``nbytes`` back to the budget.

        Raises:
            ValueError: ``nbytes`` negative, not an int, or more than this handle holds
                (nothing released).
            KVCachedError: the handle is closed or lost its slot.
        """
        self._check_amount(nbytes)
        if nbytes > self._held:
            raise ValueError(f"release({nbytes}) exceeds the {self._held} bytes this handle of "
                             f"budget {self.name!r} holds; nothing was released")
        if nbytes == 0:
            return
        with self._lock:
            self._check_open()
            self._seg.lock()
            try:
                self._check_slot()
                self._add(-nbytes)
            finally:
                self._seg.unlock()

    def _add(self, nbytes: int) -> None:
        """Assumes both locks."""
        words = self._seg.words
        words[_W_HELD] += nbytes
        words[_slot_word(self._slot, _SLOT_HELD)] += nbytes
        words[_slot_word(self._slot, _SLOT_UPDATED)] = time.time_ns()
        self._held += nbytes

    @staticmethod
    def _check_amount(nbytes: int) -> None:
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes={nbytes!r} is invalid: give an int >= 0")

    def _check_open(self) -> None:
        if self._closed:
            raise KVCachedError(f"budget handle {self.name!r} is closed; open a new one")
        if _pid_now[0] != self._pid:
            raise KVCachedError(
                f"budget handle {self.name!r} was opened in pid {self._pid} and used in its "
                f"forked child {_pid_now[0]}, which shares its file lock; open the budget again "
                "in the child")

    def _check_slot(self) -> None:
        if self._seg.words[_slot_word(self._slot, _SLOT_TOKEN)] != self._token:
            raise KVCachedError(
                f"budget {self.name!r}: this handle's slot {self._slot} was taken away (the "
                "budget was deleted or reset while in use); open the budget again")

    def snapshot(self) -> BudgetSnapshot:
        """The budget as read under its shared lock."""
        with self._lock:
            self._check_open()
            self._seg.lock(exclusive=False)
            try:
                return self._seg.snapshot()
            finally:
                self._seg.unlock()

    def check_invariants(self) -> None:
        """Raise AssertionError if the budget breaks the protocol's invariants. O(slots)."""
        snap = self.snapshot()
        problems = []
        total = sum(h.held_bytes for h in snap.holders)
        if total != snap.held_bytes:
            problems.append(f"held_bytes {snap.held_bytes} != sum of slots {total}")
        if any(h.held_bytes < 0 for h in snap.holders):
            problems.append("a slot holds a negative amount")
        mine = [h for h in snap.holders if h.slot == self._slot]
        if not mine or mine[0].held_bytes != self._held:
            problems.append(f"this handle holds {self._held} but its slot says "
                            f"{mine[0].held_bytes if mine else 'nothing (slot free)'}")
        if problems:
            raise AssertionError(f"budget {self.name!r}: " + "; ".join(problems))

    def close(self) -> None:
        """Release everything this handle holds and free its slot. Idempotent.

        A forked child that inherited the handle leaves its parent's slot alone.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            atexit.unregister(self.close)
            seg = self._seg
            if _pid_now[0] == self._pid:
                seg.lock()
                try:
                    if seg.words[_slot_word(self._slot, _SLOT_TOKEN)] == self._token:
                        seg.words[_W_HELD] -= seg.words[_slot_word(self._slot, _SLOT_HELD)]
                        seg.clear_slot(self._slot)
                finally:
                    seg.unlock()
            self._held = 0
            seg.close()

    def __enter__(self) -> Budget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Budget(name={self.name!r}, slot={self._slot}, held_bytes={self._held}, "
                f"closed={self._closed})")
