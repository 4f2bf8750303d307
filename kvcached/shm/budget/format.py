"""The budget segment's format: its layout, the checks of every word read, and a reader's snapshot.

This module owns what every process that opens a budget file must agree on, whatever its role:
the layout below and the file's name (``budget_path``); the range checks of every word read
(Note [Budget fields another program wrote]); the open file (``_Segment``: the flock, pread and
pwrite, the scan for dead holders and the reclaim of their slots, which holders and ``kvctl gc``
both do); what a copy says (``BudgetSnapshot``, ``Holder``, with every holder's fair share and
cap); the creation of a new file; and the validators of the values written into it, which the
operator's ``client`` and the ``holder`` both write. Those two never import each other: each
imports this, as the instance side's ``client`` and ``owner`` import ``segment``. Pure Python,
imports neither torch nor the compiled core: ``kvctl`` must start fast.

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

import fcntl
import math
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ...checks import as_int
from ...errors import KVCachedConfigError, KVCachedError
from ...limits import I64_MAX
from ..fairness import UNCAPPED, Claim, caps, fair_shares
from ..files import (
    MAX_PID,
    SHM_DIR,
    ShmKind,
    create_exclusive,
    open_checked,
    owner_alive,
    validate_name,
)

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
        Assumes LOCK_EX. O(slots). See Note [The total is the sum of the slots] in
        holder."""
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
        flock] in holder. Opened through /proc's link to this fd, which O_NOFOLLOW would refuse:
        it can only name the file already checked."""
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
