"""kvctl: see every kvcached instance on this machine, change their limits, manage budgets.

It reads and writes the instances' shared-memory segments (kvcached.shm.client) and the
budget segments (kvcached.shm.budget) directly; no daemon is involved. Exit status: 0 success,
1 bad input or unknown name, 2 usage error, 3 the instance rejected the request, 4 it did not
answer within --timeout. An entry at a kvcached name that cannot be read (no regular file of
this user, a file that is no segment or budget) is named on stderr with the fix and skipped;
`gc` reports what it left, and exits 0 (see Note [Files in /dev/shm] in kvcached.shm.files).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

from ..checks import as_int
from ..errors import KVCachedError
from ..limits import I64_MAX, NO_LIMIT
from ..shm.budget.client import (
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
from ..shm.budget.format import POLICIES, BudgetSnapshot
from ..shm.client import (
    delete_segment,
    gc_segments,
    read_segment,
    request_limit,
    scan_segments,
    wait_for_ack,
)
from ..shm.segment import Snapshot
from ..sizes import SIZE_HELP, format_bytes, parse_size

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_REJECTED, EXIT_TIMEOUT = 0, 1, 2, 3, 4
# argparse takes "-1G" for an unknown option; a leading space makes it a value, which the command
# then rejects with a message about the negative value itself.
_NEGATIVE_VALUE = re.compile(r"-\.?\d")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors that point at --help."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Fail(Exception):
    """A one-line explanation for stderr, and the exit status."""

    def __init__(self, message: str, status: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.status = status


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on escaped (``\\x1b``, ``\\n``,
    ``\\u202e``): names come from files any local user can write."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def state_of(snap: Snapshot) -> str:
    """"alive", "stale" (alive, heartbeat older than STALE_AFTER_S: hung) or "dead"."""
    if not snap.alive:
        return "dead"
    return "stale" if snap.stale else "alive"


def _table(rows: list[list[str]], right: set[int]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                  for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
        for row in rows)


def read_instances(prog: str = "kvctl", warn: bool = True) -> tuple[list[Snapshot], int]:
    """(snapshots of the readable segments, number of unreadable entries skipped); with
    ``warn``, each skipped one is named on stderr with why and the fix."""
    snaps, skipped = [], 0
    for name, snap in scan_segments():
        if isinstance(snap, Snapshot):
            snaps.append(snap)
            continue
        skipped += 1
        if warn:
            print(f"{prog}: skipped segment {printable(name)!r}: {printable(str(snap))}",
                  file=sys.stderr)
    return snaps, skipped


def budget_shares() -> dict[int, list[dict]]:
    """{pid: its budget slots} over every readable budget: the budget's name and policy, and the
    slot's weight, min_bytes, demand_bytes, share_bytes and cap_bytes (I64_MAX: uncapped).
    O(budgets x slots)."""
    shares: dict[int, list[dict]] = {}
    for b in list_budgets():
        for h in b.holders:
            if h.alive:
                shares.setdefault(h.pid, []).append(
                    {"budget": b.name, "policy": b.policy, "weight": h.weight,
                     "min_bytes": h.min_bytes, "demand_bytes": h.demand_bytes,
                     "share_bytes": h.share_bytes, "cap_bytes": h.cap_bytes})
    return shares


def _json_snapshot(snap: Snapshot, shares: dict[int, list[dict]] | None = None) -> dict:
    record = snap.to_dict()
    record["state"] = state_of(snap)
    record["mapped_bytes"] = snap.mapped_bytes
    if shares is not None:
        record["budgets"] = shares.get(snap.pid, [])   # the slots of the instance's process
    return record


def format_cap(cap_bytes: int) -> str:
    return "none" if cap_bytes >= I64_MAX else format_bytes(cap_bytes)


def cmd_list(args: argparse.Namespace) -> int:
    snaps, _ = read_instances()
    if args.json:
        shares = budget_shares()
        print(json.dumps([_json_snapshot(s, shares) for s in snaps], indent=2))
        return EXIT_OK
    if not snaps:
        print("no kvcached instances")
        return EXIT_OK
    rows = [["NAME", "PID", "STATE", "LIMIT", "USED", "RESERVED", "CAPACITY", "STATUS", "REV"]]
    for s in snaps:
        rows.append([printable(s.name), str(s.pid), state_of(s), format_bytes(s.limit_bytes),
                     format_bytes(s.used_bytes), format_bytes(s.reserved_bytes),
                     format_bytes(s.capacity_bytes), s.limit_status, str(s.limit_revision)])
    print(_table(rows, right={1, 3, 4, 5, 6, 8}))
    return EXIT_OK


def cmd_limit(args: argparse.Namespace) -> int:
    snap = read_segment(args.name)
    if not snap.alive:
        raise _Fail(f"instance {args.name!r} is dead (pid {snap.pid} is gone); `kvctl gc` "
                    "removes its segment")
    try:
        limit_bytes = NO_LIMIT if args.size.strip().lower() == "none" else parse_size(args.size, snap.capacity_bytes)
    except ValueError as exc:
        raise _Fail(str(exc)) from None
    if limit_bytes > I64_MAX:
        raise _Fail(f"size {args.size!r} is {limit_bytes} bytes, above the largest limit a "
                    f"segment holds ({format_bytes(I64_MAX)}); give a smaller size, or none to "
                    "remove the limit")
    if args.timeout < 0:
        raise _Fail(f"--timeout {args.timeout} is negative: give seconds >= 0 (0: do not wait)")
    if args.revision is not None:
        as_int(args.revision, "--revision", minimum=0, maximum=I64_MAX, error=_Fail,
               hint="a revision is 0 or above, and at most the largest a segment holds; "
                    "omit it to take the next one")
    request = request_limit(args.name, limit_bytes, args.revision)
    ack = wait_for_ack(request, timeout_s=args.timeout)
    if args.json:
        print(json.dumps({"request": {"name": request.name, "limit_bytes": request.limit_bytes,
                                      "revision": request.revision,
                                      "request_seq": request.request_seq},
                          "acknowledged": ack is not None,
                          "state": _json_snapshot(ack) if ack else None}, indent=2))
    if ack is None:
        try:
            gone = not read_segment(args.name).alive
        except KVCachedError:
            gone = True
        if gone:
            raise _Fail(f"{args.name} exited before acknowledging limit "
                        f"{format_bytes(limit_bytes)} (revision {request.revision})")
        raise _Fail(
            f"{args.name} did not acknowledge limit {format_bytes(limit_bytes)} (revision "
            f"{request.revision}) within {args.timeout} s; the request stays pending until its "
            "tracker's watcher runs (is the instance busy or not watching?)", EXIT_TIMEOUT)
    where = f"limit {format_bytes(ack.limit_bytes)} (revision {ack.limit_revision})"
    if ack.ack_request_seq > request.request_seq:
        raise _Fail(f"{args.name}: a later request superseded this one; the instance now has "
                    f"{where}, status {ack.ack_status}", EXIT_REJECTED)
    if ack.ack_status == "stale":
        raise _Fail(f"{args.name} rejected revision {request.revision} as stale: its revision "
                    f"is {ack.limit_revision}; omit --revision or pass one above it",
                    EXIT_REJECTED)
    if ack.ack_status == "conflict":
        raise _Fail(f"{args.name} rejected the request: revision {request.revision} already has "
                    f"limit {format_bytes(ack.limit_bytes)}; omit --revision or pass "
                    f"{ack.limit_revision + 1}", EXIT_REJECTED)
    if ack.ack_status not in ("applied", "deferred"):
        raise _Fail(f"{args.name} could not apply the limit (status {ack.ack_status}); its log "
                    "says why", EXIT_REJECTED)
    if not args.json:
        mapped = format_bytes(ack.mapped_bytes)
        if ack.ack_status == "applied":
            print(f"{args.name}: applied {where}; mapped {mapped}")
        else:
            print(f"{args.name}: deferred {where}; mapped {mapped}, applied once usage falls "
                  "below the limit")
    return EXIT_OK


def cmd_watch(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        raise _Fail(f"--interval {args.interval} is invalid: give seconds > 0, e.g. 0.5")
    if args.count is not None and args.count < 1:
        raise _Fail(f"--count {args.count} is invalid: give a number of polls >= 1")
    seen: dict[str, tuple] = {}
    polls = 0
    try:
        while args.count is None or polls < args.count:
            if polls:
                time.sleep(args.interval)
            polls += 1
            now = time.strftime("%H:%M:%S")
            current = {s.name: s for s in read_instances(warn=polls == 1)[0]}
            for name in sorted(set(seen) - set(current)):
                print(f"{now} - {printable(name)} gone", flush=True)
                del seen[name]
            for name, s in current.items():
                key = (s.used_bytes, s.reserved_bytes, s.limit_bytes, s.limit_revision,
                       s.limit_status, s.capacity_bytes, state_of(s))
                if seen.get(name) != key:
                    mark = "~" if name in seen else "+"
                    seen[name] = key
                    print(f"{now} {mark} {printable(name)} {state_of(s)} used "
                          f"{format_bytes(s.used_bytes)}"
                          f" reserved {format_bytes(s.reserved_bytes)} limit "
                          f"{format_bytes(s.limit_bytes)} rev {s.limit_revision} "
                          f"{s.limit_status}", flush=True)
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    segments = gc_segments(force=args.force)
    budgets = remove_broken_budgets(force=args.force)
    recovered = gc_budgets()
    for what, sweep in (("segment", segments), ("budget", budgets)):
        for name, why in sweep.removed.items():
            print(f"removed {what} {printable(name)} ({printable(why)})")
        for name, why in sweep.kept.items():
            print(f"kvctl gc: kept {what} {printable(name)!r}: {printable(why)}", file=sys.stderr)
    for name, nbytes in recovered.items():
        print(f"budget {printable(name)}: recovered {format_bytes(nbytes)} from dead holders")
    if not segments.removed and not budgets.removed and not recovered:
        print("nothing to clean")
    return EXIT_OK


def cmd_delete(args: argparse.Namespace) -> int:
    delete_segment(args.name, force=args.force)
    print(f"deleted segment {args.name}")
    return EXIT_OK


def cmd_budget(args: argparse.Namespace) -> int:
    if args.name is None:
        if args.size is not None or args.delete or args.policy is not None:
            raise _Fail("give a budget NAME")
        budgets, unreadable = [], 0
        for name, snap in scan_budgets():
            if isinstance(snap, BudgetSnapshot):
                budgets.append(snap)
            else:  # shown, not hidden: its message says how to remove it
                unreadable += 1
                print(f"kvctl: budget {printable(name)!r} is unreadable: {printable(str(snap))}",
                      file=sys.stderr)
        if args.json:
            print(json.dumps([b.to_dict() for b in budgets], indent=2))
        elif not budgets:
            print("no readable kvcached budgets" if unreadable else "no kvcached budgets")
        else:
            rows = [["NAME", "BUDGET", "HELD", "FREE", "HOLDERS", "RECOVERED"]]
            for b in budgets:
                rows.append([printable(b.name), format_bytes(b.budget_bytes),
                             format_bytes(b.held_bytes),
                             format_bytes(max(0, b.budget_bytes - b.held_bytes)),
                             str(len(b.holders)), format_bytes(b.recovered_bytes)])
            print(_table(rows, right={1, 2, 3, 4, 5}))
        return EXIT_OK
    if args.delete:
        if args.size is not None or args.stale_after is not None or args.policy is not None:
            raise _Fail("give either SIZE (and --stale-after, --policy) or --delete, not both")
        delete_budget(args.name, force=args.force)
        print(f"deleted budget {args.name}")
        return EXIT_OK
    if args.size is not None:
        try:
            budget_bytes = parse_size(args.size)
        except ValueError as exc:
            raise _Fail(str(exc)) from None
        snap = set_budget(args.name, budget_bytes, args.stale_after, args.policy)
    elif args.stale_after is not None:
        raise _Fail("--stale-after needs the budget's SIZE too")
    elif args.policy is not None:
        snap = set_policy(args.name, args.policy)
    else:
        snap = read_budget(args.name)
    if args.json:
        print(json.dumps(snap.to_dict(), indent=2))
        return EXIT_OK
    _print_budget(snap)
    return EXIT_OK


def _print_budget(snap: BudgetSnapshot) -> None:
    print(f"budget {printable(snap.name)}: {format_bytes(snap.budget_bytes)}, {snap.policy}, held "
          f"{format_bytes(snap.held_bytes)} by {len(snap.holders)} holder(s), recovered "
          f"{format_bytes(snap.recovered_bytes)}; holders of other pid namespaces are dead "
          f"after {snap.stale_after_s:g} s without a heartbeat")
    for h in snap.holders:
        state = "dead" if not h.alive else "stale" if h.stale else "alive"
        print(f"  pid {h.pid:>8}  {format_bytes(h.held_bytes):>12}  "
              f"{state}  share {format_bytes(h.share_bytes)}  cap "
              f"{format_cap(h.cap_bytes)}  demand {format_bytes(h.demand_bytes)}  weight "
              f"{h.weight:g}  min {format_bytes(h.min_bytes)}")


def cmd_share(args: argparse.Namespace) -> int:
    if args.weight is None and args.min is None:
        raise _Fail("give --weight, --min or both")
    min_bytes = None
    if args.min is not None:
        try:
            min_bytes = parse_size(args.min)
        except ValueError as exc:
            raise _Fail(str(exc)) from None
    snap = set_holder_share(args.name, args.pid, weight=args.weight, min_bytes=min_bytes)
    if args.json:
        print(json.dumps(snap.to_dict(), indent=2))
    else:
        _print_budget(snap)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvctl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("list", help="list instances: usage, limit, state",
                       description="List every kvcached instance on this machine.")
    p.add_argument("--json", action="store_true", help="print a JSON array")
    p.set_defaults(run=cmd_list)

    p = sub.add_parser("limit", help="change an instance's memory limit",
                       description="Ask instance NAME to change its limit and print the state it "
                                   "reports.")
    p.add_argument("name", metavar="NAME")
    p.add_argument("size", metavar="SIZE",  # argparse formats help with %
                   help=SIZE_HELP.replace("%", "%%") + "; 0 releases everything; none removes the limit")
    p.add_argument("--revision", type=int, help="revision of this limit (default: the next one)")
    p.add_argument("--timeout", type=float, default=1.0,
                   help="seconds to wait for the instance's answer (default 1)")
    p.add_argument("--json", action="store_true", help="print the request and state as JSON")
    p.set_defaults(run=cmd_limit)

    p = sub.add_parser("watch", help="print changes until Ctrl-C",
                       description="Poll the instances and print a line per change.")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between polls")
    p.add_argument("--count", type=int, help="stop after this many polls")
    p.set_defaults(run=cmd_watch)

    p = sub.add_parser("gc", help="remove dead instances' segments, recover budgets",
                       description="Remove the segments of dead instances, the files at segment "
                                   "or budget names that are no segment or budget (truncated or "
                                   "overwritten), and take back what dead processes held in "
                                   "budgets. Entries that are no regular file (a FIFO, a "
                                   "directory, a link) and other users' files are reported "
                                   "and kept.")
    p.add_argument("--force", action="store_true",
                   help="also remove this user's entries at kvcached names that are no regular "
                        "file (FIFO, link, socket, empty directory); never another user's")
    p.set_defaults(run=cmd_gc)

    p = sub.add_parser("delete", help="remove an instance's segment",
                       description="Remove the segment of instance NAME (refused while it is "
                                   "alive, unless --force).")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--force", action="store_true",
                   help="remove whatever has the name, even if the owner is alive")
    p.set_defaults(run=cmd_delete)

    p = sub.add_parser("budget", help="list, show, size or delete global budgets",
                       description="No NAME: list budgets. NAME: show it. NAME SIZE: create it "
                                   "or change its size. NAME --delete: remove it.")
    p.add_argument("name", metavar="NAME", nargs="?")
    p.add_argument("size", metavar="SIZE", nargs="?",
                   help="whole bytes (4096) or a binary unit (40G, 0.5G)")
    p.add_argument("--stale-after", type=float, metavar="SECONDS",
                   help="with SIZE: a holder in another pid namespace (container) whose heartbeat "
                        "is older is dead and its share reclaimed (default 10 when creating)")
    p.add_argument("--delete", action="store_true", help="remove the budget")
    p.add_argument("--force", action="store_true",
                   help="with --delete: even if it is in use, unreadable or of another version")
    p.add_argument("--policy", choices=POLICIES,
                   help="how the holders share it: fair (weighted max-min shares, enforced by "
                        "capping a holder at its share while another waits below its own; the "
                        "default of a new budget) or first_come (no caps)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=cmd_budget)

    p = sub.add_parser("share", help="set a budget holder's weight or guaranteed minimum",
                       description="Set the weight (holders waiting for memory share what the "
                                   "minimums leave in proportion to their weights) and/or the "
                                   "guaranteed minimum of process PID in fair budget NAME.")
    p.add_argument("name", metavar="NAME")
    p.add_argument("pid", metavar="PID", type=int)
    p.add_argument("--weight", type=float, help="a number in [0.001, 1000000] (default 1)")
    p.add_argument("--min", metavar="SIZE", help="whole bytes (4096) or a binary unit (8G)")
    p.add_argument("--json", action="store_true", help="print the budget as JSON")
    p.set_defaults(run=cmd_share)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run kvctl with ``argv`` (default: sys.argv[1:]); the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = [" " + a if _NEGATIVE_VALUE.match(a) else a for a in argv]
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except _Fail as exc:
        print(f"kvctl {args.command}: {exc}", file=sys.stderr)
        return exc.status
    except KVCachedError as exc:
        print(f"kvctl {args.command}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # e.g. `kvctl list | head`: quiet, like other Unix tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except OSError as exc:  # a file changed under us: say which, without a traceback
        print(f"kvctl {args.command}: {printable(str(exc))}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
