"""Global budget: instances naming the same budget never map more than it, in sum.

Opt-in (KVCACHED_GLOBAL_BUDGET names it). Per-instance limits cap each instance; a budget caps a
group of them (e.g. every model on one GPU) without an operator dividing the memory in advance:
whoever needs pages takes them from the common budget and gives them back when they are unmapped.

Why a file under /dev/shm with flock, and not a lock-free counter: Python has no atomic
compare-and-swap on shared memory, and the budget is consulted once per *batch* of page maps (a
page map costs ~30 µs on the GPU), so two flock calls, two preads and two pwrites per acquisition
are cheap enough. Why pread/pwrite and not a mapping: a holder of a mapping dies of SIGBUS once
another program truncates the file; with pread it reports a broken budget instead.
Why per-holder slots and not one counter: a holder killed by SIGKILL cannot give its share back;
its slot names it (pid, start time, pid namespace, heartbeat), so the next acquirer that finds the
budget short, or ``kvctl gc``, sees the process is gone and takes the slot's bytes back.

Protocol (every process follows it; readers included):

* Every read-modify-write of the segment happens under ``flock(fd, LOCK_EX)`` of the budget file;
  consistent reads (``read_budget``) take ``LOCK_SH`` just to copy it. Within a process, a
  handle's ``threading.Lock`` is taken first (flock does not exclude threads sharing a file
  description). Nobody reads ``/proc`` while holding the flock (Note [No /proc under the flock]).
* ``held_bytes`` is derived from the slots: a holder writes its slot first and the total second,
  and whoever reclaims a slot (and every ``Budget.open``) recounts the total from the slots, so a
  holder killed between the two writes leaks nothing (Note [The total is the sum of the slots]).
  At every unlock by a live holder, an acquisition has left it <= ``budget_bytes``. Lowering
  ``budget_bytes`` below ``held_bytes`` takes nothing back: acquisitions fail until holders
  release enough.
* A slot is free when its pid is 0. A handle claims one at ``Budget.open`` and frees it at
  ``close`` (releasing what it holds). The process's poller refreshes the heartbeat of each of
  its slots every ``stale_after_s / 8``. A slot is dead when its process is (see Note
  [Telling a dead owner] in files) or, for a process of another pid namespace (another
  container), whose life cannot be checked, when its heartbeat is older than the budget's
  ``stale_after_s`` (Note [Slot heartbeats]). A dead slot is reclaimed: its bytes are taken back
  and added to ``recovered_bytes``. A live process of this namespace is never reclaimed, however
  old its heartbeat.
* The file persists while no one holds it (the operator's setting); ``kvctl budget NAME
  --delete`` removes it (``--force``: whatever has its name). A file at a budget's name that no
  kvcached can read as a budget (truncated or overwritten by another program, or holding an
  accounting field out of range) is shown by ``kvctl budget`` and removed by ``kvctl gc``; a
  budget of another layout version is left alone; an entry that is no regular file of this user
  is never opened as one (Note [Files in /dev/shm] in files).

Sharing (Note [Fair shares] and Note [Caps that conserve work] in fairness): under the
``fair`` policy (the default of a new budget) every holder publishes its weight, minimum and
demand (bytes it waits for beyond what it holds) in its slot, and computes from one copy of the
segment the weighted max-min fair share of every live holder, and its own cap: its share while
another holder is below its own share with demand waiting, else none. A holder whose heartbeat
is older than ``stale_after_s`` (stopped, or frozen) keeps what it holds but its demand counts as
0 (Note [Demand of a stopped holder]). ``try_acquire`` refuses what would take the holder past
its cap. Under ``first_come`` nobody is capped (version 2's behaviour). Share values a slot or
the header holds that no kvcached writes (a weight <= 0, a negative minimum or demand, a policy
of neither value, a stale_after outside its bounds) are read as the default (weight 1,
minimum 0, demand 0, the fair policy, STALE_AFTER_S); they never make a holder fail. The
accounting fields are another matter: a header size, total or slot (pid, start time, pid
namespace, held bytes, heartbeat) out of range, a free slot holding bytes, or slots summing past
an i64 make the file no budget (Note [Budget fields another program wrote]).

Segment layout, version 3 (native byte order)

====== ======= ================= ============================================================
offset type    field             meaning
====== ======= ================= ============================================================
0      char[4] magic             ``b"KVCB"``
4      u32     version           layout version, 3
8      i64     segment_bytes     size of the segment
16     i64     budget_bytes      most bytes all holders together may hold
24     i64     held_bytes        sum of the slots' held_bytes
32     i64     num_slots         number of slots, 256
40     i64     created_ns        CLOCK_REALTIME ns at creation
48     i64     recovered_bytes   bytes taken back from dead holders, cumulative
56     i64     stale_after_ns    a holder of another pid namespace whose heartbeat is older is dead
64     i64     policy            0: first_come, 1: fair
72     char[]  name              budget name, UTF-8, NUL-padded to 248 bytes
320    slot[]  slots             num_slots slots of 80 bytes:
                                 +0 pid (0: free), +8 start_time, +16 pid_ns, +24 held_bytes,
                                 +32 token (random, identifies the handle), +40 heartbeat_ns,
                                 +48 demand_bytes (wanted beyond held), +56 weight_milli (weight
                                 x 1000), +64 min_bytes (guaranteed minimum), +72 cap_bytes (the
                                 cap the holder computed last; I64_MAX: uncapped)
====== ======= ================= ============================================================
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import math
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from ..checks import as_int
from ..errors import KVCachedClosedError, KVCachedConfigError, KVCachedError
from ..limits import I64_MAX
from .fairness import UNCAPPED, Claim, caps, fair_shares
from .files import (
    MAX_PID,
    SHM_DIR,
    ShmFileError,
    ShmKind,
    Sweep,
    create_exclusive,
    open_checked,
    own_identity,
    owner_alive,
    pid_now,
    remove_entry,
    replace_if_dead,
    validate_name,
)
from .poller import POLLER

log = logging.getLogger("kvcached")

BUDGET_PREFIX = "kvcached-budget."
MAGIC = b"KVCB"
VERSION = 3
NUM_SLOTS = 256
SLOTS_OFFSET = 320
SLOT_BYTES = 80
POLICIES = ("first_come", "fair")   # the header's policy field is the index
DEFAULT_POLICY = "fair"
MAX_WEIGHT = 1e6                    # weight_milli then fits an i64 many times over
SEGMENT_BYTES = SLOTS_OFFSET + NUM_SLOTS * SLOT_BYTES
# A failed acquisition scans the holders for dead ones at most this often per handle (each scan
# reads /proc once per holder).
RECLAIM_EVERY_S = 0.05
# Default bound on a heartbeat's age beyond which a holder of another pid namespace is dead;
# holders beat eight times within it. See Note [Slot heartbeats].
STALE_AFTER_S = 10.0
MIN_STALE_AFTER_S = 0.5

_HEADER = struct.Struct("=4sI8q248s")
_HEADER_WORDS = struct.Struct("=9q")  # word 0 is magic and version; 1 segment_bytes ... 8 policy
_SLOT = struct.Struct("=10q")
_WORD = struct.Struct("=q")
(_W_SEGMENT, _W_BUDGET, _W_HELD, _W_NUM_SLOTS, _W_CREATED, _W_RECOVERED, _W_STALE,
 _W_POLICY) = range(1, 9)
(_SLOT_PID, _SLOT_START, _SLOT_NS, _SLOT_HELD, _SLOT_TOKEN, _SLOT_HEARTBEAT, _SLOT_DEMAND,
 _SLOT_WEIGHT, _SLOT_MIN, _SLOT_CAP) = range(10)
_SLOT_WORDS = 10

assert _HEADER.size == SLOTS_OFFSET and _SLOT.size == SLOT_BYTES

BUDGET_FILES = ShmKind(
    "kvcached budget", BUDGET_PREFIX, 8,
    fix="remove it (`kvctl gc`, or `kvctl budget {name} --delete --force`)",
    force_fix="`kvctl budget {name} --delete --force` or `kvctl gc --force` removes it")

# (field, word, low, high) of every accounting word kvcached writes; a value outside makes the
# file no budget. See Note [Budget fields another program wrote].
_ANY = (0, I64_MAX)
_HEADER_BOUNDS = (("segment_bytes", _W_SEGMENT, SEGMENT_BYTES, SEGMENT_BYTES),
                  ("budget_bytes", _W_BUDGET, *_ANY), ("held_bytes", _W_HELD, *_ANY),
                  ("num_slots", _W_NUM_SLOTS, NUM_SLOTS, NUM_SLOTS),
                  ("created_ns", _W_CREATED, *_ANY), ("recovered_bytes", _W_RECOVERED, *_ANY))
_SLOT_BOUNDS = (("pid", _SLOT_PID, 0, MAX_PID), ("start_time", _SLOT_START, *_ANY),
                ("pid_ns", _SLOT_NS, *_ANY), ("held_bytes", _SLOT_HELD, *_ANY),
                ("heartbeat_ns", _SLOT_HEARTBEAT, *_ANY))

# Test hook: called by Budget._add between the slot's write and the total's (tests SIGKILL the
# process there to check that nothing leaks). See Note [The total is the sum of the slots].
_between_slot_and_total: Callable[[], None] | None = None


def budget_path(name: str) -> str:
    """Path of the segment of budget ``name``."""
    return os.path.join(SHM_DIR, BUDGET_PREFIX + validate_name(name))


def _slot_word(slot: int, field: int) -> int:
    return (SLOTS_OFFSET + slot * SLOT_BYTES) // 8 + field


def _check_size(field: str, value: object) -> int:
    return as_int(value, field, minimum=0, maximum=I64_MAX, hint="bytes")


def _out_of_range(words: Sequence[int], bounds: tuple, where: str) -> str | None:
    for field, index, low, high in bounds:
        if not low <= words[index] <= high:
            return f"{where}{field} is {words[index]}, outside [{low}, {high}]"
    return None


def _header_problem(raw: bytes) -> str | None:
    """Why the header at the start of ``raw`` (of this layout version) is none kvcached wrote,
    or None."""
    return _out_of_range(_HEADER_WORDS.unpack_from(raw), _HEADER_BOUNDS, "")


def _slots_problem(slots: Sequence[_Slot], first: int = 0, together: bool = True) -> str | None:
    """Why ``slots`` (slot ``first`` on) are none kvcached wrote, or None: a word out of range;
    and if ``together`` (the whole table, copied under the flock, where no write of a pid or
    held is half done) a free slot holding bytes or slots summing past an i64. O(slots)."""
    for index, slot in enumerate(slots, first):
        why = _out_of_range(slot, _SLOT_BOUNDS, f"slot {index}'s ")
        if why is not None:
            return why
        if together and not slot[_SLOT_PID] and slot[_SLOT_HELD]:
            return f"slot {index} is free but its held_bytes is {slot[_SLOT_HELD]}, outside [0, 0]"
    total = sum(slot[_SLOT_HELD] for slot in slots) if together else 0
    if total > I64_MAX:
        return f"slots' held_bytes sum to {total}, outside [0, {I64_MAX}]"
    return None


def _stale_ns(value: int) -> int:
    """The header's stale_after_ns as used: one outside what ``set_budget`` accepts (no kvcached
    writes it) is the default."""
    low, high = int(MIN_STALE_AFTER_S * 1e9), 86400 * 10**9
    return value if low <= value <= high else int(STALE_AFTER_S * 1e9)


def _check_stale_after(stale_after_s: float) -> int:
    """``stale_after_s`` in ns, or KVCachedConfigError."""
    if (isinstance(stale_after_s, bool) or not isinstance(stale_after_s, (int, float))
            or not math.isfinite(stale_after_s)
            or not MIN_STALE_AFTER_S <= stale_after_s <= 86400):
        raise KVCachedConfigError(
            f"stale_after_s={stale_after_s!r} is invalid: give seconds in [{MIN_STALE_AFTER_S}, "
            f"86400] (default {STALE_AFTER_S}); holders beat eight times within it")
    return int(stale_after_s * 1e9)


def _slot_dead(pid: int, start: int, pid_ns: int, heartbeat_ns: int, stale_after_ns: int,
               now_ns: int) -> bool:
    """Whether a slot's holder is dead: by /proc in this pid namespace, by its heartbeat in
    another. Reads /proc: never call it under the flock."""
    alive = owner_alive(pid, start, pid_ns)
    if alive is None:
        return now_ns - heartbeat_ns > stale_after_ns
    return not alive


class _BrokenBudget(KVCachedError):
    """The file is no budget of this version (any more): truncated or overwritten."""


_Slot = tuple[int, ...]  # pid, start_time, pid_ns, held, token, heartbeat, demand, weight, min, cap
_Identity = tuple[int, int, int, int]  # token, pid, start_time, pid_ns: who holds a slot


def _identity(slot: _Slot) -> _Identity:
    return slot[_SLOT_TOKEN], slot[_SLOT_PID], slot[_SLOT_START], slot[_SLOT_NS]


class _Segment:
    """An open budget file, read with pread and written with pwrite (never mapped: a mapping of a
    file another program truncates faults, see Note [A segment changed by another process] in
    segment). Callers hold its flock to change it. Every word it reads is range-checked where it
    is read (``head``, ``slot``, ``slots``): See Note [Budget fields another program wrote]."""

    def __init__(self, name: str, path: str, fd: int | None = None) -> None:
        """Open the budget file at ``path`` (``files.open_checked``), or take ``fd``.

        Raises:
            KVCachedError: nothing there (the message says how to create it), an entry that is
                no regular file of this user (ShmFileError), or a file that is no budget of this
                layout version. Nothing is left open.
        """
        self.name, self.path = name, path
        if fd is None:
            try:
                fd = open_checked(path, BUDGET_FILES, writable=True)
            except FileNotFoundError:
                raise KVCachedError(
                    f"no budget named {name!r} ({path} does not exist); create it with "
                    f"`kvctl budget {name} SIZE` or Budget.open({name!r}, budget_bytes=...)"
                ) from None
        self.fd = fd
        try:
            self.head()
        except BaseException:
            os.close(self.fd)
            raise

    def lock(self, exclusive: bool = True) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _pread(self, nbytes: int, offset: int, whole: bool = True) -> bytes:
        raw = os.pread(self.fd, nbytes, offset)
        if whole and len(raw) < nbytes:
            raise self._truncated()
        return raw

    def _truncated(self) -> _BrokenBudget:
        return _BrokenBudget(
            f"{self.path} is no budget any more: another program truncated it; remove it "
            f"(`kvctl gc`, or `kvctl budget {self.name} --delete --force`), create it again "
            "and restart its holders")

    def broken(self, why: str) -> _BrokenBudget:
        """The error for a word (``why``) no kvcached writes."""
        return _BrokenBudget(
            f"{self.path}: {why}: no kvcached writes that, another program changed the file; "
            f"remove it (`kvctl gc`, or `kvctl budget {self.name} --delete --force`), create it "
            "again and restart its holders")

    def head(self) -> tuple[int, int]:
        """(budget_bytes, held_bytes), after checking the file still is a budget of this
        layout version with its header words in range. One pread."""
        return self._header(self._pread(SLOTS_OFFSET, 0, whole=False))

    def _header(self, raw: bytes) -> tuple[int, int]:
        """(budget_bytes, held_bytes) of the header at the start of ``raw`` (a copy of the file's
        start, maybe short), checked: magic and version first, then length and words."""
        if len(raw) < 8:
            raise self._truncated()
        magic, version = struct.unpack_from("=4sI", raw)
        if magic != MAGIC:
            raise _BrokenBudget(
                f"{self.path} is not a kvcached budget (magic {magic!r}); remove it (`kvctl gc`, "
                f"or `kvctl budget {self.name} --delete --force`) and create it again")
        if version != VERSION:
            raise _BrokenBudget(
                f"{self.path} is a kvcached budget of layout version {version}; this kvcached "
                f"reads version {VERSION}: use the kvctl of the kvcached that created it, or "
                f"remove it (`kvctl budget {self.name} --delete --force`) and create it again")
        if len(raw) < SLOTS_OFFSET:
            raise self._truncated()
        why = _header_problem(raw)
        if why is not None:
            raise self.broken(why)
        _, _, _, budget, held, *_ = _HEADER.unpack_from(raw)
        return budget, held

    def word(self, index: int) -> int:
        return _WORD.unpack(self._pread(8, index * 8))[0]

    def write(self, index: int, *values: int) -> None:
        """Store ``values`` from word ``index`` on: one pwrite."""
        os.pwrite(self.fd, struct.pack(f"={len(values)}q", *values), index * 8)

    def slot(self, slot: int) -> _Slot:
        """Slot ``slot``, its words checked: one pread."""
        fields = _SLOT.unpack(self._pread(SLOT_BYTES, SLOTS_OFFSET + slot * SLOT_BYTES))
        why = _slots_problem([fields], slot, together=False)
        if why is not None:
            raise self.broken(why)
        return fields

    def slots(self, together: bool = True) -> list[_Slot]:
        """Every slot, checked (``together``: as a table, which only a copy taken under the
        flock can be; see ``_slots_problem``): one pread of the table."""
        return self._slots(self._pread(NUM_SLOTS * SLOT_BYTES, SLOTS_OFFSET), together)

    def _slots(self, raw: bytes, together: bool) -> list[_Slot]:
        slots = [_SLOT.unpack_from(raw, i * SLOT_BYTES) for i in range(NUM_SLOTS)]
        why = _slots_problem(slots, together=together)
        if why is not None:
            raise self.broken(why)
        return slots

    def stale_after_ns(self) -> int:
        return _stale_ns(self.word(_W_STALE))

    def find_dead(self) -> list[tuple[int, _Identity, bool]]:
        """(slot, identity, judged by heartbeat) of every holder found dead. Reads /proc, so it
        runs without the flock; ``reclaim`` checks each again under the lock. O(slots). See
        Note [No /proc under the flock]."""
        now, stale, dead = time.time_ns(), self.stale_after_ns(), []
        for index, slot in enumerate(self.slots(together=False)):
            pid, start, pid_ns = slot[_SLOT_PID], slot[_SLOT_START], slot[_SLOT_NS]
            if not pid:
                continue
            alive = owner_alive(pid, start, pid_ns)
            if alive is None:  # another pid namespace: judged by the heartbeat
                if now - slot[_SLOT_HEARTBEAT] > stale:
                    dead.append((index, _identity(slot), True))
            elif not alive:
                dead.append((index, _identity(slot), False))
        return dead

    def reclaim(self, dead: list[tuple[int, _Identity, bool]]) -> int:
        """Free the slots ``find_dead`` found that still hold the same handle (and, judged by
        heartbeat, still have not beaten); recount the total. Assumes LOCK_EX. The bytes taken
        back (recovered_bytes, a running total, stops at I64_MAX)."""
        self.head()  # still a budget: only then free slots in it
        now, stale, recovered = time.time_ns(), self.stale_after_ns(), 0
        slots = self.slots()
        for index, ident, by_heartbeat in dead:
            slot = slots[index]
            if _identity(slot) != ident:
                continue  # freed or claimed anew since the scan
            if by_heartbeat and now - slot[_SLOT_HEARTBEAT] <= stale:
                continue  # it beat since the scan
            recovered += slot[_SLOT_HELD]
            self.clear_slot(index)
            slots[index] = (0,) * _SLOT_WORDS
        self.write(_W_RECOVERED, min(I64_MAX, self.word(_W_RECOVERED) + recovered))
        self.recount(slots)
        return recovered

    def recount(self, slots: list[_Slot] | None = None) -> None:
        """Set the total to the sum of the slots (as checked by ``slots``: it fits an i64).
        Assumes LOCK_EX. O(slots). See Note [The total is the sum of the slots]."""
        self.write(_W_HELD, sum(slot[_SLOT_HELD] for slot in (slots or self.slots())))

    def clear_slot(self, slot: int) -> None:
        self.write(_slot_word(slot, 0), *(0,) * _SLOT_WORDS)

    def snapshot(self) -> BudgetSnapshot:
        """The budget, copied under LOCK_SH and judged (/proc) after the unlock."""
        self.lock(exclusive=False)
        try:
            raw = self._pread(SEGMENT_BYTES, 0, whole=False)
        finally:
            self.unlock()
        self._header(raw)
        if len(raw) < SEGMENT_BYTES:
            raise self._truncated()
        return _parse(self.name, self.path, raw, self._slots(raw[SLOTS_OFFSET:], together=True))

    def reopen(self) -> _Segment:
        """The same file (not the file now at its path) in a new open file description, whose
        flock excludes this one's as another process's would. See Note [Shares without the
        flock]. Opened through /proc's link to this fd, which O_NOFOLLOW would refuse: it can
        only name the file already checked."""
        fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDWR | os.O_CLOEXEC)
        return _Segment(self.name, self.path, fd)

    def close(self) -> None:
        os.close(self.fd)


def _parse(name: str, path: str, raw: bytes, slots: list[_Slot]) -> BudgetSnapshot:
    """The snapshot of a copy ``raw`` whose header and ``slots`` are checked; judges the holders
    (/proc: never under the flock)."""
    _, _, _, budget, held, _, created, recovered, stale_ns, policy, _ = _HEADER.unpack_from(raw)
    stale_ns = _stale_ns(stale_ns)
    now, found = time.time_ns(), []
    for slot, fields in enumerate(slots):
        pid, start, pid_ns = fields[_SLOT_PID], fields[_SLOT_START], fields[_SLOT_NS]
        if pid:
            heartbeat = fields[_SLOT_HEARTBEAT]
            alive = not _slot_dead(pid, start, pid_ns, heartbeat, stale_ns, now)
            found.append(Holder(
                slot, pid, fields[_SLOT_HELD], alive, heartbeat,
                _weight_milli(fields[_SLOT_WEIGHT]) / 1000, max(0, fields[_SLOT_MIN]),
                max(0, fields[_SLOT_DEMAND]), fields[_SLOT_CAP], 0,
                stale=alive and now - heartbeat > stale_ns))
    live = [h for h in found if h.alive]
    shares = dict(zip((h.slot for h in live), fair_shares(budget, [_claim(h) for h in live])))
    holders = tuple(replace(h, share_bytes=shares.get(h.slot, 0)) for h in found)
    return BudgetSnapshot(name, path, budget, held, recovered, created, stale_ns / 1e9, holders,
                          _policy_name(policy))


def _weight_milli(value: int) -> int:
    """A slot's weight_milli as the computation uses it: one out of range (no kvcached writes
    it) is the default weight."""
    return value if 0 < value <= MAX_WEIGHT * 1000 else 1000


def _policy_name(value: int) -> str:
    """The header's policy field by name: a value no kvcached writes is the default policy."""
    return POLICIES[value] if 0 <= value < len(POLICIES) else DEFAULT_POLICY


def _claim(holder: Holder) -> Claim:
    """What a live holder claims in the fair-share computation: its weight, minimum and held
    bytes, and its demand unless its heartbeat is stale. See Note [Demand of a stopped holder]."""
    return Claim(round(holder.weight * 1000), holder.min_bytes, holder.held_bytes,
                 0 if holder.stale else holder.demand_bytes)


def _check_policy(policy: object) -> int:
    """The policy's header value, or KVCachedConfigError."""
    if policy not in POLICIES:
        raise KVCachedConfigError(f"policy={policy!r} is unknown: give one of "
                                  f"{', '.join(POLICIES)} (default {DEFAULT_POLICY})")
    return POLICIES.index(policy)  # type: ignore[arg-type]


def check_weight(weight: object) -> int:
    """A share weight as weight_milli, or KVCachedConfigError."""
    if (isinstance(weight, bool) or not isinstance(weight, (int, float))
            or not math.isfinite(weight) or not 0 < weight <= MAX_WEIGHT
            or round(weight * 1000) < 1):
        raise KVCachedConfigError(
            f"weight={weight!r} is invalid: give a number in [0.001, {MAX_WEIGHT:g}] (default 1); "
            "holders with unmet demand share the budget in proportion to their weights")
    return round(weight * 1000)


@dataclass(frozen=True, slots=True)
class Holder:
    """One claimed slot. ``alive`` is False only when the holder is known to be dead (Note [Slot
    heartbeats]); ``stale`` is True for a live holder whose heartbeat is older than the budget's
    stale_after_s (stopped or frozen): its demand does not count (Note [Demand of a stopped
    holder]). ``share_bytes`` is its fair share as computed from this copy (0 for a dead
    holder); ``cap_bytes`` the cap it computed and published last (I64_MAX: uncapped)."""

    slot: int
    pid: int
    held_bytes: int
    alive: bool
    heartbeat_ns: int
    weight: float
    min_bytes: int
    demand_bytes: int
    cap_bytes: int
    share_bytes: int
    stale: bool = False


@dataclass(frozen=True, slots=True)
class BudgetSnapshot:
    """A budget as copied under its shared lock (bytes; ns; s)."""

    name: str
    path: str
    budget_bytes: int
    held_bytes: int
    recovered_bytes: int
    created_ns: int
    stale_after_s: float
    holders: tuple[Holder, ...]
    policy: str

    def caps(self) -> dict[int, int]:
        """{slot: the cap its holder has now} for every live holder, as every holder computes
        it (I64_MAX: uncapped; everyone under first_come). O(holders)."""
        live = [h for h in self.holders if h.alive]
        if self.policy != "fair":
            return {h.slot: UNCAPPED for h in live}
        return dict(zip((h.slot for h in live), caps(self.budget_bytes, [_claim(h) for h in live],
                                                     [h.share_bytes for h in live])))

    def to_dict(self) -> dict:
        return {
            "name": self.name, "path": self.path, "budget_bytes": self.budget_bytes,
            "held_bytes": self.held_bytes, "recovered_bytes": self.recovered_bytes,
            "created_ns": self.created_ns, "stale_after_s": self.stale_after_s,
            "policy": self.policy,
            "holders": [{"slot": h.slot, "pid": h.pid, "held_bytes": h.held_bytes,
                         "alive": h.alive, "stale": h.stale, "heartbeat_ns": h.heartbeat_ns,
                         "weight": h.weight,
                         "min_bytes": h.min_bytes, "demand_bytes": h.demand_bytes,
                         "share_bytes": h.share_bytes, "cap_bytes": h.cap_bytes}
                        for h in self.holders],
        }


def _create(name: str, budget_bytes: int, stale_after_ns: int, policy: int) -> None:
    """Create budget ``name`` unless it exists (then nothing changes)."""
    content = _HEADER.pack(MAGIC, VERSION, SEGMENT_BYTES, budget_bytes, 0, NUM_SLOTS,
                           time.time_ns(), 0, stale_after_ns, policy, name.encode()) + bytes(
                               NUM_SLOTS * SLOT_BYTES)
    fd = create_exclusive(budget_path(name), content)
    if fd is not None:
        os.close(fd)


def set_budget(name: str, budget_bytes: int, stale_after_s: float | None = None,
               policy: str | None = None) -> BudgetSnapshot:
    """Create budget ``name`` of ``budget_bytes``, or change the size of the existing one.

    ``stale_after_s`` (default STALE_AFTER_S when creating; unchanged otherwise): how old a
    heartbeat makes a holder of another pid namespace dead (Note [Slot heartbeats]). ``policy``
    ("fair" or "first_come"; default DEFAULT_POLICY when creating, unchanged otherwise): how
    holders share it (see ``set_policy``). Lowering the budget below what is held takes nothing
    back; acquisitions fail until enough is released. Returns the budget after the change.

    Raises:
        KVCachedConfigError: invalid name, a size outside [0, I64_MAX] or not an int,
            ``stale_after_s`` outside [MIN_STALE_AFTER_S, 86400], or an unknown policy. Nothing
            changed.
    """
    budget_bytes = _check_size("budget_bytes", budget_bytes)
    stale_ns = None if stale_after_s is None else _check_stale_after(stale_after_s)
    policy_value = None if policy is None else _check_policy(policy)
    path = budget_path(name)
    if not os.path.lexists(path):
        _create(name, budget_bytes, stale_ns or int(STALE_AFTER_S * 1e9),
                _check_policy(DEFAULT_POLICY) if policy_value is None else policy_value)
    words = {_W_BUDGET: budget_bytes, _W_STALE: stale_ns, _W_POLICY: policy_value}
    return _write_header(_Segment(name, path), {w: v for w, v in words.items() if v is not None})


def _write_header(seg: _Segment, words: dict[int, int]) -> BudgetSnapshot:
    """Write header ``words`` ({word index: value}) of a budget under its exclusive lock, after
    checking it is one; the budget after the change. Closes ``seg``."""
    try:
        seg.lock()
        try:
            seg.head()
            for index, value in words.items():
                seg.write(index, value)
        finally:
            seg.unlock()
        return seg.snapshot()
    finally:
        seg.close()


def set_policy(name: str, policy: str) -> BudgetSnapshot:
    """Make the holders of budget ``name`` share it by ``policy``: "fair" (weighted max-min
    shares, enforced by caps while someone waits: Note [Caps that conserve work] in fairness) or
    "first_come" (no caps: what a holder maps it keeps while it needs it). The holders follow
    at their next cap computation (the manager's share job: SHARE_INTERVAL_S). Returns the
    budget after the change.

    Raises:
        KVCachedConfigError: unknown policy or invalid name. KVCachedError: no such budget, or
            the file is no budget of this version. Nothing changed.
    """
    value = _check_policy(policy)
    return _write_header(_Segment(validate_name(name), budget_path(name)), {_W_POLICY: value})


def set_holder_share(name: str, pid: int, *, weight: float | None = None,
                     min_bytes: int | None = None) -> BudgetSnapshot:
    """Set the weight and/or the guaranteed minimum of every live slot process ``pid`` holds in
    budget ``name`` (an operator overriding what the instance set at start). The instance keeps
    them until it sets its own again (``Budget.set_share``) or ends. Returns the budget after
    the change.

    Raises:
        KVCachedConfigError: invalid weight (see ``check_weight``) or minimum, or neither given.
        KVCachedError: no such budget, or no live holder of it has pid ``pid``. Nothing changed.
    """
    if weight is None and min_bytes is None:
        raise KVCachedConfigError("set_holder_share: give weight, min_bytes or both")
    weight_milli = None if weight is None else check_weight(weight)
    min_bytes = None if min_bytes is None else _check_size("min_bytes", min_bytes)
    seg = _Segment(validate_name(name), budget_path(name))
    try:
        snap = seg.snapshot()                      # judged (/proc) after its unlock
        targets = {h.slot for h in snap.holders if h.pid == pid and h.alive}
        if not targets:
            raise KVCachedError(
                f"budget {name!r} has no live holder with pid {pid}; `kvctl budget {name}` "
                "lists its holders")
        seg.lock()
        try:
            seg.head()
            slots = seg.slots()
            for index in targets:
                if slots[index][_SLOT_PID] != pid:
                    continue                       # gone since the snapshot
                if weight_milli is not None:
                    seg.write(_slot_word(index, _SLOT_WEIGHT), weight_milli)
                if min_bytes is not None:
                    seg.write(_slot_word(index, _SLOT_MIN), min_bytes)
        finally:
            seg.unlock()
        return seg.snapshot()
    finally:
        seg.close()


def read_budget(name: str) -> BudgetSnapshot:
    """Budget ``name`` as copied under its shared lock. O(slots).

    Raises:
        KVCachedError: no such budget, or the file is not a budget of this layout version.
    """
    seg = _Segment(validate_name(name), budget_path(name))
    try:
        return seg.snapshot()
    finally:
        seg.close()


def _budget_entries() -> list[str]:
    """The ``kvcached-budget.*`` file names under SHM_DIR, sorted."""
    try:
        return sorted(e for e in os.listdir(SHM_DIR) if e.startswith(BUDGET_PREFIX))
    except FileNotFoundError:
        return []


def scan_budgets() -> Iterator[tuple[str, BudgetSnapshot | Exception]]:
    """(name, snapshot or the error reading it) for every budget file, sorted by name. The error
    of a file that is no budget (KVCachedError) says how to remove it. O(files x slots)."""
    for entry in _budget_entries():
        name, path = entry[len(BUDGET_PREFIX):], os.path.join(SHM_DIR, entry)
        try:
            seg = _Segment(name, path)
        except FileNotFoundError:
            continue  # removed while listing
        except (OSError, KVCachedError) as exc:
            yield name, exc
            continue
        try:
            yield name, seg.snapshot()
        except (OSError, KVCachedError) as exc:
            yield name, exc
        finally:
            seg.close()


def list_budgets() -> list[BudgetSnapshot]:
    """Every readable budget on this machine, sorted by name (``scan_budgets`` also names the
    unreadable ones)."""
    return [snap for _, snap in scan_budgets() if isinstance(snap, BudgetSnapshot)]


def invalid_budget(raw: bytes) -> str | None:
    """Why ``raw`` (a file's first SEGMENT_BYTES bytes or fewer) cannot be a budget of any layout
    version, or None if it may be one: too short, another magic, or (this version only)
    truncated or holding an accounting word no kvcached writes (Note [Budget fields another
    program wrote]). Never says so of a budget another kvcached version wrote. O(slots)."""
    if len(raw) < 8:
        return f"{len(raw)} bytes, not a kvcached budget"
    if raw[:4] != MAGIC:
        return f"magic {raw[:4]!r}, not a kvcached budget"
    if struct.unpack_from("=I", raw, 4)[0] != VERSION:
        return None
    if len(raw) < SEGMENT_BYTES:
        return (f"{len(raw)} bytes, not a kvcached budget any more (truncated; a budget is "
                f"{SEGMENT_BYTES} bytes)")
    return _header_problem(raw) or _slots_problem(
        [_SLOT.unpack_from(raw, SLOTS_OFFSET + i * SLOT_BYTES) for i in range(NUM_SLOTS)])


def remove_broken_budgets(force: bool = False) -> Sweep:
    """Remove the files of this user at budget names that cannot be budgets (truncated or
    overwritten by another program: their holders already stopped counting against them, see
    ``release``); with ``force``, also this user's entries that are no regular file (Note
    [Files in /dev/shm] in files). What was removed and what was kept, by name, with why. A
    budget of another layout version is kept. Each file is judged again under its flock just
    before the unlink, so a budget created anew at the name meanwhile stays. O(files)."""
    def broken(raw: bytes) -> bool:
        return invalid_budget(raw) is not None

    sweep = Sweep()
    for entry in _budget_entries():
        name, path = entry[len(BUDGET_PREFIX):], os.path.join(SHM_DIR, entry)
        try:
            fd = open_checked(path, BUDGET_FILES, whole=False)
        except FileNotFoundError:
            continue  # removed meanwhile
        except ShmFileError as exc:
            sweep.unusable(name, exc, force)
            continue
        try:
            why = invalid_budget(os.pread(fd, SEGMENT_BYTES, 0))
        finally:
            os.close(fd)
        try:
            if why is not None and replace_if_dead(path, BUDGET_FILES, broken, SEGMENT_BYTES):
                sweep.removed[name] = why
        except (OSError, KVCachedError):
            continue  # replaced meanwhile by something else: the next gc judges it
    return sweep


def gc_budgets() -> dict[str, int]:
    """Reclaim the slots of dead holders in every budget; bytes recovered, by budget name. A
    budget that changed meanwhile (removed, replaced, broken) is left to the next gc."""
    recovered = {}
    for snap in list_budgets():
        if all(h.alive for h in snap.holders):
            continue
        try:
            seg = _Segment(snap.name, snap.path)
        except (OSError, KVCachedError):
            continue
        try:
            dead = seg.find_dead()  # /proc, outside the flock
            seg.lock()
            try:
                recovered[snap.name] = seg.reclaim(dead)
            finally:
                seg.unlock()
        except (OSError, KVCachedError):
            continue
        finally:
            seg.close()
    return recovered


def delete_budget(name: str, force: bool = False) -> None:
    """Remove budget ``name``; with ``force``, whatever has its name: a budget in use, a file
    another program truncated or overwrote, a budget of another layout version, a FIFO, a link,
    an empty directory (``files.remove_entry``).

    Raises:
        KVCachedError: no file of that name; the name is invalid; without ``force``: the file is
            not a budget of this version, or live processes hold slots in it (they would go on
            counting against a budget nobody else sees); or the entry cannot be removed (a
            directory that is not empty, no permission: the message says why). Nothing removed.
    """
    path = budget_path(name)
    if not force:
        live = [h.pid for h in read_budget(name).holders if h.alive]
        if live:
            raise KVCachedError(
                f"budget {name!r} is in use by pid(s) {', '.join(map(str, live))}; stop them "
                f"first or force the removal (kvctl budget {name} --delete --force)")
    try:
        remove_entry(path)
    except FileNotFoundError:
        if force:  # (without it, read_budget said so; a removal since then is no error)
            raise KVCachedError(
                f"no budget named {name!r} ({path} does not exist); `kvctl budget` lists the "
                "budgets") from None


class Budget:
    """This process's handle on a shared budget: acquire and release bytes against it.

    Lock contract: public methods take ``self._lock`` (threads of this process) and then the
    segment's flock (other processes); private ones assume both, except ``_beat`` (the heartbeat
    job's one pwrite; a capped handle's beat then calls ``cap_bytes``) and ``free_bytes`` (one
    pread), which take neither. The share side (``set_demand``, ``set_share``, ``cap_bytes``)
    takes ``self._share_lock`` instead, and the flock of its own open file description
    (``_share_seg``), so it never waits for an acquisition of another thread (Note [Shares
    without the flock]); ``close`` takes ``_share_lock`` and then ``_lock``, and nothing takes
    them the other way round.

    Use ``Budget.open``; acquire in batches (several pages per call) on the allocator's path.
    A handle belongs to the process that opened it: a forked child must open its own (it would
    share the parent's flock, which then excludes nothing).
    """

    def __init__(self, segment: _Segment, share_segment: _Segment, slot: int, token: int) -> None:
        self.name, self.path = segment.name, segment.path
        self._seg = segment
        self._share_seg = share_segment   # set_demand, set_share, cap_bytes: under _share_lock
        self._share_lock = threading.Lock()
        self._slot = slot
        self._token = token
        self._held = 0
        self._lock = threading.Lock()
        self._next_reclaim = 0.0
        self._closed = False
        self._pid = pid_now[0]
        self._broken = False  # the file stopped being a budget (warned once)
        self._cap = UNCAPPED  # as cap_bytes() last computed it; try_acquire enforces it
        self._beat_every_s = segment.stale_after_ns() / 8e9
        atexit.register(self.close)
        self._heartbeat = POLLER.every(self._beat_every_s, self._beat,
                                       f"budget {self.name}: slot {slot}'s heartbeat")

    @classmethod
    def open(cls, name: str, budget_bytes: int | None = None, *,
             stale_after_s: float | None = None, policy: str | None = None,
             weight: float = 1.0, min_bytes: int = 0) -> Budget:
        """Open budget ``name`` (creating it with ``budget_bytes``, ``stale_after_s`` and
        ``policy`` if it does not exist; an existing budget keeps them, which operators set) and
        claim a slot with this holder's share ``weight`` and guaranteed ``min_bytes`` (see
        ``set_share``).

        Raises:
            KVCachedConfigError: invalid name, size, ``stale_after_s``, policy, weight or
                minimum; or the budget does not exist and ``budget_bytes`` is None (the message
                says how to create it).
            KVCachedError: all NUM_SLOTS slots are held by live processes; the entry at its name
                is no regular file of this user (ShmFileError) or no budget of this version,
                or holds a word no kvcached writes (the message names it and the fix).
        """
        path = budget_path(name)
        stale_ns = (int(STALE_AFTER_S * 1e9) if stale_after_s is None
                    else _check_stale_after(stale_after_s))
        policy_value = _check_policy(DEFAULT_POLICY if policy is None else policy)
        share = check_weight(weight), _check_size("min_bytes", min_bytes)
        if budget_bytes is not None:
            budget_bytes = _check_size("budget_bytes", budget_bytes)
            if not os.path.lexists(path):
                _create(name, budget_bytes, stale_ns, policy_value)
        elif not os.path.lexists(path):
            raise KVCachedConfigError(
                f"no budget named {name!r}: create it (`kvctl budget {name} 40G`) or pass "
                "budget_bytes to create it on first use")
        seg = _Segment(name, path)
        try:
            share_seg = seg.reopen()
        except BaseException:
            seg.close()
            raise
        token = int.from_bytes(os.urandom(7), "little") + 1
        try:
            slot = cls._claim(seg, token, share)
            if slot is None:
                slot = cls._claim(seg, token, share, dead=seg.find_dead())  # /proc, no flock
        except BaseException:
            seg.close()
            share_seg.close()
            raise
        if slot is None:
            seg.close()
            share_seg.close()
            raise KVCachedError(
                f"budget {name!r} has no free slot: {NUM_SLOTS} handles of live processes hold "
                "one each; close unused handles (Budget.close)")
        return cls(seg, share_seg, slot, token)

    @staticmethod
    def _claim(seg: _Segment, token: int, share: tuple[int, int],
               dead: list | None = None) -> int | None:
        """Under LOCK_EX: reclaim ``dead``, recount the total, claim a free slot (or None) with
        ``share`` (weight_milli, min_bytes)."""
        pid, start, pid_ns = own_identity()
        seg.lock()
        try:
            seg.head()
            if dead:
                seg.reclaim(dead)
            slots = seg.slots()
            seg.recount(slots)  # heals a total left by a holder killed mid-update
            for index, slot in enumerate(slots):
                if slot[_SLOT_PID] == 0:
                    base = _slot_word(index, 0)
                    seg.write(base + _SLOT_START, start, pid_ns, 0, token, time.time_ns(), 0,
                              *share, UNCAPPED)
                    seg.write(base + _SLOT_PID, pid)  # last: a lock-free reader that sees it
                    return index                      # sees the rest
            return None
        finally:
            seg.unlock()

    @property
    def held_bytes(self) -> int:
        """Bytes this handle holds."""
        return self._held

    @property
    def slot(self) -> int:
        """The index of this handle's slot (``Holder.slot`` in snapshots)."""
        return self._slot

    def free_bytes(self) -> int:
        """Bytes the budget has left now (``budget_bytes - held_bytes``, 0 when over it), for
        every holder together.

        A lock-free read: one 16-byte pread of the shared segment, no flock (~1 µs), so a
        scheduler can consult it on every ``available_size()``. It is a snapshot: another holder
        may take or give back bytes right after; a holder killed between its two writes may make
        it low until the next reclaim (Note [The total is the sum of the slots]). 0 if another
        program truncated the file (``try_acquire`` then says so).

        Raises:
            KVCachedClosedError: the handle is closed.
        """
        if not self._closed:
            try:
                raw = os.pread(self._seg.fd, 16, _W_BUDGET * 8)
            except OSError:  # closed meanwhile
                raw = b""
            if not self._closed:
                if len(raw) < 16:
                    return 0
                budget, held = struct.unpack("=2q", raw)
                return max(0, budget - held)
        raise KVCachedClosedError(f"budget handle {self.name!r} is closed; open a new one")

    def try_acquire(self, nbytes: int) -> bool:
        """Take ``nbytes`` from the budget if that keeps the total within it, and this holder
        within its cap (as ``cap_bytes`` last computed it; none under first_come); True if taken.

        Never raises for "not enough": returns False and changes nothing. When short, first
        reclaims the shares of dead holders (at most every RECLAIM_EVERY_S per handle), reading
        /proc with no flock held. Cost: two flock calls, two preads and two pwrites (~5 µs); a
        scan adds a /proc read per holder and two more flock calls.

        Raises:
            ValueError: ``nbytes`` outside [0, I64_MAX] or not an int.
            KVCachedError: the handle is closed, its slot was taken away (budget deleted and
                recreated, or forcibly reset), or another program truncated or overwrote the
                budget file. Nothing was taken.
        """
        nbytes = self._check_amount(nbytes)
        if nbytes == 0:
            return True
        with self._lock:
            self._check_open()
            if self._held + nbytes > self._cap:
                return False  # See Note [Caps that conserve work] in fairness
            if self._take(nbytes):
                return True
            now = time.monotonic()
            if now < self._next_reclaim:
                return False
            self._next_reclaim = now + RECLAIM_EVERY_S
            dead = self._seg.find_dead()  # /proc, outside the flock
            return bool(dead) and self._take(nbytes, dead)

    def _take(self, nbytes: int, dead: list | None = None) -> bool:
        """Assumes ``self._lock``; takes the flock. Reclaims ``dead`` first."""
        seg = self._seg
        seg.lock()
        try:
            if dead:
                seg.reclaim(dead)
            budget, held = seg.head()
            slot = seg.slot(self._slot)
            self._check_slot(slot)
            if held + nbytes > budget:
                return False
            self._add(nbytes, slot, held)
            return True
        finally:
            seg.unlock()

    def release(self, nbytes: int) -> None:
        """Give ``nbytes`` back to the budget.

        If another program truncated or overwrote the budget file, there is no budget to give
        back to: the bytes are dropped from this handle with one warning, and nothing raises
        (the caller is unmapping memory, which must not fail for it).

        Raises:
            ValueError: ``nbytes`` outside [0, I64_MAX], not an int, or more than this handle
                holds (nothing released).
            KVCachedError: the handle is closed or lost its slot.
        """
        nbytes = self._check_amount(nbytes)
        if nbytes > self._held:
            raise ValueError(f"release({nbytes}) exceeds the {self._held} bytes this handle of "
                             f"budget {self.name!r} holds; nothing was released")
        if nbytes == 0:
            return
        with self._lock:
            self._check_open()
            seg = self._seg
            seg.lock()
            try:
                _, held = seg.head()
                slot = seg.slot(self._slot)
                self._check_slot(slot)
                self._add(-nbytes, slot, held)
            except _BrokenBudget as exc:
                if not self._broken:
                    log.warning("kvcached: %s; this process stops counting against it", exc)
                self._broken = True
                self._held -= nbytes
            finally:
                seg.unlock()

    def _add(self, nbytes: int, slot: _Slot, held: int) -> None:
        """Assumes both locks; ``slot`` and ``held`` as just read under them. The slot first,
        the total second: See Note [The total is the sum of the slots]. _BrokenBudget, before
        any write, if either would leave [0, I64_MAX] (only a file another program changed
        gets there)."""
        seg = self._seg
        mine, total = slot[_SLOT_HELD] + nbytes, held + nbytes
        for field, value in ((f"slot {self._slot}'s held_bytes", mine), ("held_bytes", total)):
            if not 0 <= value <= I64_MAX:
                raise seg.broken(f"{field} would be {value}, outside [0, {I64_MAX}]")
        seg.write(_slot_word(self._slot, _SLOT_HELD), mine, self._token,
                  time.time_ns())  # held, token, heartbeat
        if _between_slot_and_total is not None:
            _between_slot_and_total()
        seg.write(_W_HELD, total)
        self._held += nbytes

    def _beat(self) -> None:
        """The heartbeat job's pwrite into this handle's slot (while it is still ours); a capped
        handle also computes its cap again, so that no cap outlives its reason by more than a
        beat when nobody calls ``cap_bytes`` (a manager calls it every SHARE_INTERVAL_S)."""
        base = _slot_word(self._slot, 0)
        try:
            if self._seg.word(base + _SLOT_TOKEN) == self._token:
                self._seg.write(base + _SLOT_HEARTBEAT, time.time_ns())
            if self._cap != UNCAPPED:
                self.cap_bytes()
        except (OSError, KVCachedError):
            pass  # a broken file: its holder hears of it at its next acquire

    def set_demand(self, nbytes: int) -> None:
        """Publish the bytes this holder waits for beyond what it holds (0: none), with a
        heartbeat. Kept until the next call; the other holders' caps depend on it (Note [Caps
        that conserve work] in fairness). Like the heartbeat, one pwrite without the flock
        (Note [Shares without the flock]).

        Raises:
            ValueError: ``nbytes`` outside [0, I64_MAX] or not an int.
            KVCachedError: the handle is closed or lost its slot, or the file is no budget.
        """
        nbytes = self._check_amount(nbytes)
        with self._share_lock:
            self._check_open()
            self._store_own(_SLOT_HEARTBEAT, time.time_ns(), nbytes)

    def set_share(self, weight: float, min_bytes: int) -> None:
        """Set this holder's weight (holders with unmet demand split what is left after the
        minimums in proportion to their weights) and guaranteed minimum (bytes it gets before
        any weighted sharing, as far as it wants them and the budget has them).

        Raises:
            KVCachedConfigError: ``weight`` not a finite number in [0.001, MAX_WEIGHT], or
                ``min_bytes`` not an int in [0, I64_MAX]. Nothing changed.
            KVCachedError: the handle is closed or lost its slot, or the file is no budget.
        """
        share = check_weight(weight), _check_size("min_bytes", min_bytes)
        with self._share_lock:
            self._check_open()
            self._write_own(_SLOT_WEIGHT, *share)

    def _store_own(self, field: int, *values: int) -> None:
        """Store ``values`` from this slot's ``field`` on without the flock, if the slot is
        still this handle's (checked by its token, as the heartbeat does). Assumes
        ``self._share_lock``."""
        seg = self._share_seg
        seg.head()
        self._check_slot(seg.slot(self._slot))
        seg.write(_slot_word(self._slot, field), *values)

    def _write_own(self, field: int, *values: int) -> None:
        """Store ``values`` from this slot's ``field`` on, under the flock, if the slot is still
        this handle's. Assumes ``self._share_lock``."""
        seg = self._share_seg
        seg.lock()
        try:
            seg.head()
            self._check_slot(seg.slot(self._slot))
            seg.write(_slot_word(self._slot, field), *values)
        finally:
            seg.unlock()

    def cap_bytes(self) -> int:
        """This holder's cap now: its fair share while another holder is below its own share
        with demand waiting, else I64_MAX (uncapped; always under first_come). Computed from
        one copy of the segment taken under the shared flock (O(slots), a /proc read per holder
        after the unlock); stored in the handle, where ``try_acquire`` enforces it, and into the
        slot's cap field when it changed, for kvctl and kvtop (one pwrite without the flock: Note
        [Shares without the flock]).

        Raises:
            KVCachedError: the handle is closed or lost its slot, or the file is no budget.
        """
        with self._share_lock:
            self._check_open()
            snap = self._share_seg.snapshot()
            self._check_slot(self._share_seg.slot(self._slot))   # still ours: its figures are ours
            cap = snap.caps().get(self._slot, UNCAPPED)
            mine = next((h for h in snap.holders if h.slot == self._slot), None)
            if mine is not None and mine.cap_bytes != cap:
                self._store_own(_SLOT_CAP, cap)
            self._cap = cap
            return cap

    @staticmethod
    def _check_amount(nbytes: object) -> int:
        return as_int(nbytes, "nbytes", minimum=0, maximum=I64_MAX, error=ValueError)

    def _check_open(self) -> None:
        if self._closed:
            raise KVCachedClosedError(f"budget handle {self.name!r} is closed; open a new one")
        if pid_now[0] != self._pid:
            raise KVCachedError(
                f"budget handle {self.name!r} was opened in pid {self._pid} and used in its "
                f"forked child {pid_now[0]}, which shares its file lock; open the budget again "
                "in the child")

    def _check_slot(self, slot: _Slot) -> None:
        if slot[_SLOT_TOKEN] != self._token:
            raise KVCachedError(
                f"budget {self.name!r}: this handle's slot {self._slot} was taken away (the "
                "budget was deleted or reset while in use, or this process's heartbeat stopped "
                "for longer than the budget's stale_after_s); open the budget again")

    def snapshot(self) -> BudgetSnapshot:
        """The budget as copied under its shared lock."""
        with self._lock:
            self._check_open()
            return self._seg.snapshot()

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
        """Release everything this handle holds and free its slot, after taking its heartbeat job
        off the poller. Idempotent.

        A forked child that inherited the handle leaves its parent's slot alone.
        """
        if pid_now[0] == self._pid:
            self._heartbeat.cancel()  # after this no heartbeat touches the handle
        with self._share_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            atexit.unregister(self.close)
            seg = self._seg
            if pid_now[0] == self._pid:
                seg.lock()
                try:
                    _, held = seg.head()
                    slot = seg.slot(self._slot)
                    if slot[_SLOT_TOKEN] == self._token:
                        # The total first: a kill between the two leaves a slot to reclaim.
                        seg.write(_W_HELD, max(0, held - slot[_SLOT_HELD]))
                        seg.clear_slot(self._slot)
                except _BrokenBudget:
                    pass  # nothing left to give back to
                finally:
                    seg.unlock()
            self._held = 0
            seg.close()
            self._share_seg.close()

    def __enter__(self) -> Budget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Budget(name={self.name!r}, slot={self._slot}, held_bytes={self._held}, "
                f"closed={self._closed})")


# Note [The total is the sum of the slots]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# held_bytes is a cache of the sum of the slots' held_bytes: acquisitions compare against one word
# instead of adding 256. A holder changes its slot and then the total, both under LOCK_EX, so no
# live process ever sees them disagree; only a holder killed between the two writes leaves them
# apart, and a killed holder always leaves its slot behind (close() lowers the total before it
# frees the slot, for the same reason). That slot is dead, and whoever reclaims a dead slot
# recounts the total from the slots (so does every Budget.open, under the lock it already takes):
# the difference lasts until the next reclaim, and is never lost. Before the recount the total
# can only err towards the dead holder's share, whose memory the kernel gave back when it died:
# the live holders' sum stays within the budget. free_bytes() reads budget and total without the
# lock, with one 16-byte pread: the pair may straddle an acquisition by another holder, which a
# scheduler's admission check tolerates anyway (the acquisition itself is checked under the
# lock).
#
# Note [Slot heartbeats]
# ~~~~~~~~~~~~~~~~~~~~~~
# In this pid namespace a slot's pid and start time tell exactly whether its holder lives (Note
# [Telling a dead owner] in files): a live holder is never reclaimed, even a stopped or hung one, whose
# memory is still mapped. A holder in another pid namespace (another container sharing /dev/shm)
# cannot be checked that way: its pid means another process here. So every process beats: its
# poller stores the time into each of its slots every stale_after_s / 8 (1.25 s by default), and
# a foreign holder whose heartbeat is older than the budget's stale_after_s (10 s by default, set
# at creation, at least MIN_STALE_AFTER_S) is dead. Staleness bound: a crashed foreign holder's
# share comes back at the first reclaim after stale_after_s; a live foreign holder is reclaimed
# only if its poller cannot run for stale_after_s (the process frozen that long), and
# then its next acquire or release fails loudly (its slot token changed) instead of counting
# twice. The beat is one aligned store without the flock; it checks the slot's token first, so it
# never refreshes a slot that was reclaimed and handed to another holder (but for the instant
# between that check and the store).
#
# Note [Shares without the flock]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A holder's demand and its published cap are stored like its heartbeat: one pwrite into its own
# slot, after checking the slot's token, without the flock. They are each one word that only
# their holder writes, and nothing sums them (a cap computation reads each as one aligned word:
# it sees the old value or the new one). Taking LOCK_EX for them would make the share job of
# every manager, which runs on its process's poller with the publishing and heartbeat jobs, wait
# for whoever holds the budget's shared lock (a kvctl snapshot), and the process's publishing
# with it. The weight and minimum, set rarely, by the holder or an operator, take LOCK_EX.
# For the same reason the share side has its own threading lock and its own open file
# description of the budget (reopened through /proc/self/fd: the same file, even if the path
# was replaced since): with the handle's one lock, the share job would wait behind an
# allocation thread that holds it while it waits for LOCK_EX, itself waiting for a reader's
# LOCK_SH to end; a flock taken on a second description excludes the first as another
# process's would (on one description, a second thread's flock would convert the first's).
#
# Note [No /proc under the flock]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Judging a holder reads /proc/<pid>/stat (~10 µs each, more on a loaded machine): under the
# flock, 256 holders would stall every other acquirer for milliseconds. So find_dead() scans the
# slots with plain reads and no lock, and reclaim() then, under LOCK_EX, frees only the slots
# that still hold the same handle (token, pid, start time, pid namespace: a dead process never
# comes back, so the verdict still holds) and, for heartbeat verdicts, have not beaten since.
# Snapshots copy the segment under LOCK_SH and judge the holders after the unlock.
#
# Note [Budget fields another program wrote]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Two kinds of word, two answers. The accounting words (header sizes, budget, total and
# recovered bytes; each slot's pid, start time, pid namespace, held bytes and heartbeat) decide
# who holds what and whether a holder is dead: a value no kvcached writes there (a pid of 2**32,
# a negative held, slots summing past an i64, which made struct.pack fail in every new holder and
# in gc) means the file is no budget any more, exactly as if it were truncated: holders hear it at
# their next acquire, release drops the bytes with one warning, and `kvctl gc` removes the file.
# Each read checks the words it copies (head, slot, slots), and what only the whole table can
# show (a free slot holding bytes, a sum past an i64) is checked on copies taken under the flock,
# where no write of a pid or held is half done; the lock-free readers (find_dead, the share
# side's own slot) check word by word. Arithmetic on checked words that could still leave an i64
# (an acquisition on a slot holding nearly I64_MAX) is refused before the first write;
# recovered_bytes, a running statistic, stops at I64_MAX. The share words (weight, minimum,
# demand, cap, policy, stale_after) only steer the sharing: a value out of range is read as its
# default, so that an operator's typo or a stray write never stops a holder from allocating.
#
# Note [Demand of a stopped holder]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A holder's demand caps the others while it waits below its share (Note [Caps that conserve
# work] in fairness). A SIGSTOPped (or otherwise frozen) holder of this pid namespace is alive,
# so it is never reclaimed (Note [Slot heartbeats]): its memory is still mapped. But it waits for
# nothing: its last demand kept every other holder capped for as long as it stayed stopped. So a
# live holder whose heartbeat is older than the budget's stale_after_s keeps its held bytes in the
# computation and claims a demand of 0: it gets a share of what it holds, and nobody is capped
# for it. Its poller beats every stale_after_s / 8, so a running holder loses its demand only if
# its process cannot run for eight beats; once it runs again its next beat (or set_demand)
# makes the demand count at the next computation. Holders of another pid namespace are judged
# the same way by the same heartbeat, and are dead (reclaimed) past it anyway.
