"""The load schedule: how the clients are split between the instances in each phase.

The load is a fixed number of clients, each sending its next request as soon as the previous one
finished. They move from the first instance to both (half each), to the second, and back to the
first: the plot shows memory following the load both ways and the budget shared under contention.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    """One span of the run (seconds from the start of the first phase)."""

    label: str
    share: tuple[float, ...]    # fraction of the clients on each instance, in the instances' order
    start_s: float
    end_s: float


def phases(names: tuple[str, str], phase_s: float) -> list[Phase]:
    """The four phases of ``phase_s`` seconds each for instances ``names`` (first, second)."""
    a, b = names
    plan = ((f"{a} busy", (1.0, 0.0)), ("both busy", (0.5, 0.5)),
            (f"{b} busy", (0.0, 1.0)), (f"{a} busy again", (1.0, 0.0)))
    return [Phase(label, share, i * phase_s, (i + 1) * phase_s) for i, (label, share) in enumerate(plan)]


def phase_at(plan: list[Phase], t_s: float) -> int | None:
    """Index of the phase running at ``t_s``; None before the first or after the last."""
    for index, phase in enumerate(plan):
        if phase.start_s <= t_s < phase.end_s:
            return index
    return None
