"""The holder's side of a budget: ``Budget``, a process's handle to take and release bytes.

An instance's manager opens one per budget it names (KVCACHED_GLOBAL_BUDGET) and consults it on
every batch of page maps. The handle claims a slot at ``open`` and keeps it for its life; it
takes and releases bytes under the flock ``format`` defines, reclaiming dead holders' slots when
short; it publishes its demand and share and computes its cap; its heartbeat (and a capped
handle's cap) runs as a job on the process's poller (``poller``); ``close`` (atexit too) gives
back what it holds and frees the slot. It is the one part of a budget that keeps state in a
process (two locks, the slot's token, what it holds, its cap): that is why it stands apart from
the operator's stateless ``client``, which it never imports; it imports only ``format``.
"""

from __future__ import annotations

import atexit
import logging
import os
import struct
import threading
import time
from collections.abc import Callable

from ...checks import as_int
from ...errors import KVCachedClosedError, KVCachedConfigError, KVCachedError
from ...limits import I64_MAX
from ..fairness import UNCAPPED
from ..files import own_identity, pid_now
from ..poller import POLLER
from .format import (
    _SLOT_CAP,
    _SLOT_HEARTBEAT,
    _SLOT_HELD,
    _SLOT_PID,
    _SLOT_START,
    _SLOT_TOKEN,
    _SLOT_WEIGHT,
    _W_BUDGET,
    _W_HELD,
    DEFAULT_POLICY,
    NUM_SLOTS,
    STALE_AFTER_S,
    BudgetSnapshot,
    _BrokenBudget,
    _check_policy,
    _check_size,
    _check_stale_after,
    _create,
    _Segment,
    _Slot,
    _slot_word,
    budget_path,
    check_weight,
)

log = logging.getLogger("kvcached")

# A failed acquisition scans the holders for dead ones at most this often per handle (each scan
# reads /proc once per holder).
RECLAIM_EVERY_S = 0.05

# Test hook: called by Budget._add between the slot's write and the total's (tests SIGKILL the
# process there to check that nothing leaks). See Note [The total is the sum of the slots].
_between_slot_and_total: Callable[[], None] | None = None


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
