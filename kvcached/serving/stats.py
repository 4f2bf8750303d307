"""The serving loop's counters, one object that each of its rooms updates in place.

The scheduler counts preemptions, swaps and moved blocks, the runner its model calls and waits,
the loop its committed steps (through StepClock, which keeps the window behind the rate); callers
read them all as ``loop.stats`` at any moment, a failed step included, so they are one shared
dataclass rather than a sum gathered at the commit.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

RATE_WINDOW = 32                # steps over which stats.tokens_per_s is measured


@dataclass
class LoopStats:
    """Counters of a ServingLoop, updated by every step."""

    running: int = 0
    waiting: int = 0
    finished: int = 0
    preemptions: int = 0
    swapped_out: int = 0            # preemptions that kept the request's K/V on the host (Note [Swapping out])
    swapped_in: int = 0             # readmissions that copied it back instead of recomputing it
    blocks_moved: int = 0           # blocks moved to empty pages instead of preempting (Note [Fair share in the loop])
    generated_tokens: int = 0
    steps: int = 0
    step_tokens: int = 0            # tokens the last step ran through the model
    last_step_s: float = 0.0        # the last committed step's time (from its start or the commit before, the later)
    tokens_per_s: float = 0.0       # generated tokens per second over the last RATE_WINDOW steps
    runner_steps: int = 0           # decode steps run by the padded decode runner (graphs or not)
    graph_replays: int = 0          # of those, CUDA graph replays
    eager_steps: int = 0            # steps whose model call ran eagerly (prefill, mixed, graphs off)
    steps_ahead: int = 0            # decode steps launched before the last one's tokens were read (overlap)
    last_forward_s: float = 0.0     # host time of the last step's model call (the replay's launch)
    last_wait_s: float = 0.0        # time the last step waited for the device's tokens


class StepClock:
    """Counts committed steps into a LoopStats: their time and the rate over the last
    RATE_WINDOW of them."""

    def __init__(self, stats: LoopStats):
        self.stats = stats
        self._rate: collections.deque[tuple[float, int]] = collections.deque(maxlen=RATE_WINDOW)
        self._committed_at = 0.0                # perf_counter of the last step's commit

    def count(self, tokens: int, started: float, generated: int, finished: int, running: int, waiting: int) -> None:
        """Count a committed step of `tokens` tokens begun at `started`. Its time runs from its
        start or the last commit, whichever is later: a step ahead is committed inside the next
        step() call, after that call launched the next step, so the time from its own start
        would count that stretch twice."""
        now = time.perf_counter()
        elapsed = now - max(started, self._committed_at)
        self._committed_at = now
        s = self.stats
        s.steps += 1
        s.step_tokens = tokens
        s.last_step_s = elapsed
        s.generated_tokens += generated
        s.finished += finished
        s.running, s.waiting = running, waiting
        self._rate.append((elapsed, generated))
        seconds = sum(t for t, _ in self._rate)
        s.tokens_per_s = sum(g for _, g in self._rate) / seconds if seconds > 0 else 0.0
