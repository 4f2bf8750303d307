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
  description). Nobody reads ``/proc`` while holding the flock (Note [No /proc under the flock] in
  format).
* ``held_bytes`` is derived from the slots: a holder writes its slot first and the total second,
  and whoever reclaims a slot (and every ``Budget.open``) recounts the total from the slots, so a
  holder killed between the two writes leaks nothing (Note [The total is the sum of the slots]
  in holder). At every unlock by a live holder, an acquisition has left it <= ``budget_bytes``.
  Lowering ``budget_bytes`` below ``held_bytes`` takes nothing back: acquisitions fail until
  holders release enough.
* A slot is free when its pid is 0. A handle claims one at ``Budget.open`` and frees it at
  ``close`` (releasing what it holds). The process's poller refreshes the heartbeat of each of
  its slots every ``stale_after_s / 8``. A slot is dead when its process is (see Note
  [Telling a dead owner] in files) or, for a process of another pid namespace (another
  container), whose life cannot be checked, when its heartbeat is older than the budget's
  ``stale_after_s`` (Note [Slot heartbeats] in format). A dead slot is reclaimed: its bytes are
  taken back and added to ``recovered_bytes``. A live process of this namespace is never
  reclaimed, however old its heartbeat.
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
0 (Note [Demand of a stopped holder] in format). ``try_acquire`` refuses what would take the
holder past its cap. Under ``first_come`` nobody is capped (version 2's behaviour). Share values
a slot or the header holds that no kvcached writes (a weight <= 0, a negative minimum or demand,
a policy of neither value, a stale_after outside its bounds) are read as the default (weight 1,
minimum 0, demand 0, the fair policy, STALE_AFTER_S); they never make a holder fail. The
accounting fields are another matter: a header size, total or slot (pid, start time, pid
namespace, held bytes, heartbeat) out of range, a free slot holding bytes, or slots summing past
an i64 make the file no budget (Note [Budget fields another program wrote] in format).

Three modules, one per role, as for an instance's segment (``segment``, ``owner``, ``client``):
``format`` is what every process must agree on (the layout, the checks of every word read, the
open file under its flock, a snapshot and the fair shares in it); ``client`` is what operators
call (``set_budget``, ``read_budget``, ``gc_budgets``, ``delete_budget``, ...), opening the file
for one call; ``holder`` is ``Budget``, the handle a process keeps to take and release bytes.
``client`` and ``holder`` import ``format`` and never each other. This package re-exports their
public names: import from ``kvcached.shm.budget``.
"""

from __future__ import annotations

from .client import (
    delete_budget,
    gc_budgets,
    list_budgets,
    read_budget,
    remove_broken_budgets,
    scan_budgets,
    set_budget,
    set_holder_share,
    set_policy,
)
from .format import (
    BUDGET_FILES,
    BUDGET_PREFIX,
    DEFAULT_POLICY,
    MAGIC,
    MAX_WEIGHT,
    MIN_STALE_AFTER_S,
    NUM_SLOTS,
    POLICIES,
    SEGMENT_BYTES,
    SLOT_BYTES,
    SLOTS_OFFSET,
    STALE_AFTER_S,
    VERSION,
    BudgetSnapshot,
    Holder,
    budget_path,
    check_weight,
    invalid_budget,
)
from .holder import RECLAIM_EVERY_S, Budget

__all__ = [
    # format
    "BUDGET_FILES", "BUDGET_PREFIX", "DEFAULT_POLICY", "MAGIC", "MAX_WEIGHT", "MIN_STALE_AFTER_S",
    "NUM_SLOTS", "POLICIES", "SEGMENT_BYTES", "SLOT_BYTES", "SLOTS_OFFSET", "STALE_AFTER_S",
    "VERSION", "BudgetSnapshot", "Holder", "budget_path", "check_weight", "invalid_budget",
    # client
    "delete_budget", "gc_budgets", "list_budgets", "read_budget", "remove_broken_budgets",
    "scan_budgets", "set_budget", "set_holder_share", "set_policy",
    # holder
    "RECLAIM_EVERY_S", "Budget",
]
