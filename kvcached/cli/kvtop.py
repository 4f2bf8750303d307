"""kvtop: a live view of every kvcached instance on this machine, one bar per instance.

Each bar spans the instance's capacity (or its limit, if larger): ``#`` is used memory (pages
holding live blocks), ``+`` reserved (mapped, unused), ``.`` the rest, ``|`` the limit. The frame
is rendered as plain lines by ``render``, shared by the curses loop and ``--once`` (pipes, tests).
Keys: q quits; the view follows terminal resizes.
"""

from __future__ import annotations

import argparse
import curses
import itertools
import os
import sys
import time

from ..errors import KVCachedError
from ..shm.segment import Snapshot
from ..sizes import format_bytes
from .kvctl import budget_shares, format_cap, printable, read_instances, state_of

LEGEND = "# used  + reserved  . free  | limit"


def bar(snap: Snapshot, cells: int) -> str:
    """The instance's bar, ``cells`` characters wide (at least 1)."""
    cells = max(1, cells)
    scale = max(snap.capacity_bytes, snap.limit_bytes, snap.mapped_bytes, 1)
    used = round(snap.used_bytes * cells / scale)
    reserved = min(cells - used, round(snap.reserved_bytes * cells / scale))
    chars = ["#"] * used + ["+"] * reserved + ["."] * (cells - used - reserved)
    if snap.limit_bytes >= 0:
        chars[min(cells - 1, round(snap.limit_bytes * cells / scale))] = "|"
    return "".join(chars)


def render(snaps: list[Snapshot], width: int, shares: dict[int, list[dict]] | None = None,
           skipped: int = 0) -> list[str]:
    """One frame: a header, then two lines per instance (figures, bar), ``width`` columns.
    ``shares`` (``kvctl.budget_shares``): an instance whose process holds a budget slot also
    shows its fair share and its cap there ("none": uncapped). ``skipped``: entries at segment
    names that could not be read, counted in the header (``kvctl list`` names them)."""
    width = max(20, width)
    lines = [f"kvtop  {len(snaps)} instance(s)  {time.strftime('%H:%M:%S')}  q: quit"[:width],
             LEGEND[:width]]
    if skipped:
        lines.insert(1, f"{skipped} unreadable segment(s) skipped: `kvctl list` says why"[:width])
    if not snaps:
        lines.append("no kvcached instances")
    for s in snaps:
        figures = (f"{printable(s.name)}  pid {s.pid} {state_of(s)}  used {format_bytes(s.used_bytes)}  "
                   f"reserved {format_bytes(s.reserved_bytes)}  limit "
                   f"{format_bytes(s.limit_bytes)} ({s.limit_status}, rev {s.limit_revision})  "
                   + "".join(f"share {format_bytes(b['share_bytes'])}  cap {format_cap(b['cap_bytes'])}  "
                             for b in (shares or {}).get(s.pid, []))
                   + f"capacity {format_bytes(s.capacity_bytes)}")
        lines.append(figures[:width])
        lines.append(f" [{bar(s, width - 3)}]")
    return lines


def _loop(stdscr: curses.window, interval_s: float) -> int:
    try:
        curses.curs_set(0)
    except curses.error:
        pass  # terminals without an invisible cursor
    colors = {}
    if curses.has_colors():
        curses.use_default_colors()
        for pair, (char, color) in enumerate(
                (("#", curses.COLOR_GREEN), ("+", curses.COLOR_YELLOW), ("|", curses.COLOR_RED)),
                start=1):
            curses.init_pair(pair, color, -1)
            colors[char] = curses.color_pair(pair)
    stdscr.timeout(max(1, int(interval_s * 1000)))
    while True:
        height, width = stdscr.getmaxyx()
        snaps, skipped = read_instances(warn=False)
        lines = render(snaps, width - 1, budget_shares(), skipped)
        if len(lines) > height:
            hidden_lines = len(lines) - (height - 1)
            lines = lines[: height - 1] + [
                f"... {(hidden_lines + 1) // 2} more instance(s): enlarge the window"]
        stdscr.erase()
        for y, line in enumerate(lines):
            _draw(stdscr, y, line[: width - 1], colors)
        stdscr.refresh()
        key = stdscr.getch()
        if key in (ord("q"), ord("Q")):
            return 0
        if key == curses.KEY_RESIZE:
            curses.update_lines_cols()
            stdscr.clear()  # repaint all of the next frame: the terminal may have reflowed the old one


def _draw(stdscr: curses.window, y: int, line: str, colors: dict[str, int]) -> None:
    if not line.startswith(" [") or not colors:
        stdscr.addstr(y, 0, line)
        return
    x = 0
    for char, run in itertools.groupby(line):
        text = "".join(run)
        stdscr.addstr(y, x, text, colors.get(char, curses.A_NORMAL))
        x += len(text)


def main(argv: list[str] | None = None) -> int:
    """Run kvtop with ``argv`` (default: sys.argv[1:]); the exit status."""
    parser = argparse.ArgumentParser(prog="kvtop", description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between refreshes")
    parser.add_argument("--once", action="store_true",
                        help="print one plain-text frame and exit (for pipes and scripts)")
    parser.add_argument("--width", type=int,
                        help="columns of the --once frame (default: the terminal's, else 100)")
    args = parser.parse_args(argv)
    if not args.interval > 0:
        parser.exit(2, f"kvtop: error: --interval {args.interval} is invalid: give seconds > 0\n")
    if args.once:
        width = args.width
        if width is None:
            try:
                width = os.get_terminal_size().columns
            except OSError:
                width = 100
        try:
            snaps, skipped = read_instances("kvtop")
            print("\n".join(render(snaps, width, budget_shares(), skipped)))
        except (KVCachedError, OSError) as exc:  # a file changed under us: no traceback
            print(f"kvtop: {printable(str(exc))}", file=sys.stderr)
            return 1
        return 0
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        parser.exit(2, "kvtop: error: needs a terminal; use --once to print one frame\n")
    try:
        return curses.wrapper(_loop, args.interval)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
