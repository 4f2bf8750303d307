"""What operators use on budgets: set, read, list, reclaim, remove (``kvctl``, ``kvtop``, the demo).

Create or resize a budget, set its policy or a holder's share, read, list and scan budgets,
reclaim dead holders' slots, remove the files at budget names that are no budget, delete one; an
application setting up budgets before its instances start calls the same functions. Each call
opens the file, does its part under the flock ``format`` defines, and closes it again: an
operator holds no slot, no heartbeat and nothing between two calls, which is what sets this
module apart from ``holder``, whose state lives as long as its handle; it never imports it. Pure
Python over ``format``: ``kvctl`` must start fast.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from ...errors import KVCachedConfigError, KVCachedError
from ..files import (
    SHM_DIR,
    ShmFileError,
    Sweep,
    open_checked,
    remove_entry,
    replace_if_dead,
    validate_name,
)
from .format import (
    _SLOT_MIN,
    _SLOT_PID,
    _SLOT_WEIGHT,
    _W_BUDGET,
    _W_POLICY,
    _W_STALE,
    BUDGET_FILES,
    BUDGET_PREFIX,
    DEFAULT_POLICY,
    SEGMENT_BYTES,
    STALE_AFTER_S,
    BudgetSnapshot,
    _check_policy,
    _check_size,
    _check_stale_after,
    _create,
    _Segment,
    _slot_word,
    budget_path,
    check_weight,
    invalid_budget,
)


def set_budget(name: str, budget_bytes: int, stale_after_s: float | None = None,
               policy: str | None = None) -> BudgetSnapshot:
    """Create budget ``name`` of ``budget_bytes``, or change the size of the existing one.

    ``stale_after_s`` (default STALE_AFTER_S when creating; unchanged otherwise): how old a
    heartbeat makes a holder of another pid namespace dead (Note [Slot heartbeats] in format).
    ``policy`` ("fair" or "first_come"; default DEFAULT_POLICY when creating, unchanged
    otherwise): how holders share it (see ``set_policy``). Lowering the budget below what is held
    takes nothing back; acquisitions fail until enough is released. Returns the budget after the
    change.

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
