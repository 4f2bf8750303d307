"""The live view of the demo: a rich table on a terminal, progress lines otherwise."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Self

from ..sizes import format_bytes

BAR_CELLS = 12
PLAIN_EVERY_S = 1.0


@dataclass(frozen=True)
class Row:
    """One instance as the view shows it (bytes; counts since the instance started)."""

    name: str
    model: str
    clients: int
    mapped_bytes: int
    used_bytes: int
    reserved_bytes: int
    running: int
    waiting: int
    preemptions: int
    generated_tokens: int
    tokens_per_s: float


@dataclass(frozen=True)
class Frame:
    """Everything one refresh of the view shows."""

    t_s: float
    total_s: float                  # 0: no end (holding)
    phase: str
    budget_name: str
    budget_bytes: int
    held_bytes: int
    rows: tuple[Row, ...]


def _mib(value: int) -> str:
    return f"{value / (1 << 20):.1f}"


def _bar(value: int, whole: int) -> str:
    filled = 0 if whole <= 0 else min(BAR_CELLS, round(BAR_CELLS * value / whole))
    return "█" * filled + "·" * (BAR_CELLS - filled)


def _heading(frame: Frame) -> str:
    clock = f"{frame.t_s:.1f} of {frame.total_s:.0f} s" if frame.total_s else f"{frame.t_s:.0f} s"
    return (f"{frame.phase}  {clock}  budget {frame.budget_name}: "
            f"{format_bytes(frame.held_bytes)} of {format_bytes(frame.budget_bytes)} held")


def _models(frame: Frame) -> str:
    return ", ".join(f"{r.name}: {r.model} model" for r in frame.rows)


class PlainView:
    """One line per instance about once a second, and a line at each phase change."""

    def __init__(self, out=None) -> None:
        self._out = out or sys.stdout
        self._next_s = 0.0
        self._phase: str | None = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def say(self, text: str) -> None:
        print(text, file=self._out, flush=True)

    def show(self, frame: Frame) -> None:
        now = time.monotonic()
        if frame.phase == self._phase and now < self._next_s:
            return
        if frame.phase != self._phase:
            self.say(f"-- {frame.phase} --")
            self._phase = frame.phase
        self._next_s = now + PLAIN_EVERY_S
        parts = [f"{r.name}: {_mib(r.mapped_bytes)} MiB mapped, {r.running} running, {r.waiting} waiting, "
                 f"{r.preemptions} preempted, {r.generated_tokens} tokens ({r.tokens_per_s:.0f} tok/s)"
                 for r in frame.rows]
        self.say(f"[{frame.t_s:5.1f} s] " + " | ".join(parts) +
                 f" | budget {_mib(frame.held_bytes)} of {_mib(frame.budget_bytes)} MiB")


class RichView:
    """A table refreshed in place (rich.live), a few times per second."""

    def __init__(self, refresh_per_s: float) -> None:
        from rich.console import Console
        from rich.live import Live

        self._console = Console()
        self._live = Live(console=self._console, refresh_per_second=refresh_per_s, transient=False)

    def __enter__(self) -> Self:
        self._live.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._live.__exit__(kind, exc, tb)

    def say(self, text: str) -> None:
        self._live.console.print(text, markup=False, highlight=False)

    def show(self, frame: Frame) -> None:
        from rich import box
        from rich.console import JustifyMethod
        from rich.table import Table

        columns: tuple[tuple[str, JustifyMethod], ...] = (
            ("instance", "left"), ("clients", "right"), ("MiB", "right"), ("of budget", "left"),
            ("live+pool", "right"), ("run", "right"), ("wait", "right"), ("preempted", "right"),
            ("tokens", "right"), ("tok/s", "right"))
        table = Table(title=_heading(frame), title_justify="left", box=box.SIMPLE_HEAD, expand=False,
                      caption=f"{_models(frame)}; MiB mapped = live (pages holding blocks) + pool",
                      caption_justify="left")
        for header, justify in columns:
            table.add_column(header, justify=justify)
        for r in frame.rows:
            table.add_row(
                r.name, f"[bold green]{r.clients}[/]" if r.clients else "[dim]idle[/]",
                _mib(r.mapped_bytes), f"[cyan]{_bar(r.mapped_bytes, frame.budget_bytes)}[/]",
                f"{_mib(r.used_bytes)}+{_mib(r.reserved_bytes)}", str(r.running), str(r.waiting),
                str(r.preemptions), str(r.generated_tokens), f"{r.tokens_per_s:.0f}")
        self._live.update(table, refresh=False)


def make_view(refresh_per_s: float):
    """RichView on a terminal, PlainView when stdout is a pipe or a file."""
    return RichView(refresh_per_s) if sys.stdout.isatty() else PlainView()
