"""Weighted max-min fair shares of one budget, and the caps that enforce them.

Every holder of a fair budget runs the same pure function over the same copy of the segment
(``budget.Budget.cap_bytes``), so they agree without talking to each other. Pure Python, exact
integer and rational arithmetic: no float decides a byte. See Note [Fair shares] and Note [Caps
that conserve work].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from ..limits import I64_MAX

UNCAPPED = I64_MAX          # the cap of a holder nobody is waiting for


@dataclass(frozen=True, slots=True)
class Claim:
    """What one live holder asks of the budget (bytes; ``weight_milli`` is weight x 1000)."""

    weight_milli: int
    min_bytes: int
    held_bytes: int
    demand_bytes: int

    @property
    def want(self) -> int:
        """Bytes it would hold if it could: what it holds and what it waits for."""
        return self.held_bytes + self.demand_bytes


def fair_shares(budget_bytes: int, claims: Sequence[Claim]) -> list[int]:
    """Each holder's share of ``budget_bytes``, in the order of ``claims``. O(n log n).

    Minimums first: each gets min(min_bytes, want). If those exceed the budget they are scaled
    down in proportion (largest remainder; nothing is left to share by weight). Otherwise the
    rest is water-filled by weight: share = min(want, max(minimum, L x weight)) for the one
    level L that spends the budget, so a minimum is a floor under the weighted share, not added
    to it. The shares are whole bytes that sum to the budget exactly when the holders together
    want at least that much, and to what they want otherwise; no share exceeds its want.

    Raises:
        ValueError: a weight <= 0, or a negative budget, minimum, held or demand (the budget
            sanitises what it reads from the segment before calling).
    """
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes={budget_bytes} must be >= 0")
    for c in claims:
        if c.weight_milli <= 0 or min(c.min_bytes, c.held_bytes, c.demand_bytes) < 0:
            raise ValueError(f"{c} is invalid: weight_milli must be > 0 and the byte counts >= 0")
    wants = [c.want for c in claims]
    if sum(wants) <= budget_bytes:
        return wants
    floors = [min(c.min_bytes, w) for c, w in zip(claims, wants)]
    total_floor = sum(floors)
    if total_floor >= budget_bytes:
        return _round([Fraction(f * budget_bytes, total_floor) if total_floor else Fraction(0)
                       for f in floors], budget_bytes)
    level = _level(budget_bytes, claims, floors, wants)
    exact = [min(Fraction(w), max(Fraction(f), level * c.weight_milli))
             for c, f, w in zip(claims, floors, wants)]
    return _round(exact, budget_bytes)


def _level(budget_bytes: int, claims: Sequence[Claim], floors: list[int],
           wants: list[int]) -> Fraction:
    """The L at which sum(min(want, max(floor, L x weight))) reaches the budget: a sweep over
    the sorted breakpoints floor/weight (a holder's share starts to rise) and want/weight (it
    stops). Assumes sum(floors) < budget_bytes < sum(wants)."""
    events: list[tuple[Fraction, int]] = []          # (L, change of the slope)
    for c, f, w in zip(claims, floors, wants):
        if f < w:
            events.append((Fraction(f, c.weight_milli), c.weight_milli))
            events.append((Fraction(w, c.weight_milli), -c.weight_milli))
    events.sort()
    at, spent, slope = Fraction(0), Fraction(sum(floors)), 0
    for point, change in events:
        reached = spent + slope * (point - at)
        if slope and reached >= budget_bytes:
            break
        at, spent, slope = point, reached, slope + change
    return at + (budget_bytes - spent) / slope


def _round(exact: list[Fraction], total: int) -> list[int]:
    """Whole bytes: each rounded down, then the bytes that sum(exact) == total leaves over one
    each to the largest fractional parts (ties: the earlier holder)."""
    shares = [int(x) for x in exact]   # exact >= 0: int() floors
    left = total - sum(shares)
    if left > 0:
        order = sorted((i for i, x in enumerate(exact) if x != shares[i]),
                       key=lambda i: (shares[i] - exact[i], i))
        for i in order[:left]:
            shares[i] += 1
    return shares


def caps(budget_bytes: int, claims: Sequence[Claim], shares: Sequence[int]) -> list[int]:
    """Each holder's cap: UNCAPPED unless the holders together want more than ``budget_bytes``
    and some *other* holder is below its own share with demand waiting; then the larger of its
    share and the share it would get if it asked for the whole budget, so that a holder wanting
    less than that may still grow to it. ``shares`` are fair_shares' for the same claims.
    O(n^2 log n). See Note [Caps that conserve work]."""
    if sum(c.want for c in claims) <= budget_bytes:
        return [UNCAPPED] * len(claims)     # what is free covers every demand
    short = [c.held_bytes < s and c.demand_bytes > 0 for c, s in zip(claims, shares)]
    waiting = sum(short)
    return [max(s, _asking_all(budget_bytes, claims, i)) if waiting - is_short > 0 else UNCAPPED
            for i, (s, is_short) in enumerate(zip(shares, short))]


def _asking_all(budget_bytes: int, claims: Sequence[Claim], i: int) -> int:
    """Holder i's share if it wanted the whole budget (and its minimum) on top of what it holds:
    a want no share can reach, so a larger one would change nothing."""
    c = claims[i]
    asking = Claim(c.weight_milli, c.min_bytes, c.held_bytes, budget_bytes + c.min_bytes)
    return fair_shares(budget_bytes, [*claims[:i], asking, *claims[i + 1:]])[i]


# Note [Fair shares]
# ~~~~~~~~~~~~~~~~~~
# First come, first served let an instance that mapped the budget keep it while its own
# requests needed it: a second instance held 0 % of a 2 GiB budget for 5 s with 32 requests
# waiting. A fair budget gives each live holder a weighted max-min share of it: the holders that
# want less than their weighted slice get what they want, the rest split what is left by weight.
# A minimum (min_bytes) is a floor under the weighted share, as cgroups' memory.min is: a holder
# with min 40 % and weight 1 next to another of weight 1 gets 50 %, not 40 % + 30 %. Minimums
# that exceed the budget (an operator promised more than there is) are scaled down in
# proportion, so every holder keeps the same fraction of its promise rather than the first ones
# getting theirs whole; nothing is then left to share by weight. Shares are computed from exact
# fractions and rounded to whole bytes by largest remainder, so two holders with unmet demand
# get shares proportional to their weights within one byte, and the result is the same in every
# process (no float, no iteration order but the slots').
#
# Note [Caps that conserve work]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A share is enforced only while it is needed: a holder is capped while the holders together
# want more than the budget (what they hold plus what they wait for) and some other holder is
# below its own share with demand waiting; otherwise it is uncapped, and may take whatever nobody
# asks for (an idle instance's share is anybody's). While the wants fit the budget nobody is
# capped even if someone waits: the free bytes cover its demand, and a cap would only stop the
# others' running requests from taking their next blocks. (The shares are then the wants, so a
# holder with nothing waiting was capped at exactly what it held: the next page one of its
# running requests needed failed and the engine preempted, with the budget partly free. On the
# CPU machine, bench_share --quick with a budget often free, dropping those caps cut fair's
# preemptions by 27-78 %: benchmarks/README.md.) For the same reason a capped holder's cap is
# the larger of its share and the share it would get if it asked for the whole budget: one that
# wants less keeps room to grow to that, which is no more than fairness would give it anyway.
# Capping at the share, not at what the holder holds, lets a capped holder keep what fairness
# gives it and give back only the excess. A holder that reaches its share, or stops asking,
# uncaps the others at the next round.
# Why every holder computes its own cap from the segment rather than a daemon handing them out:
# nothing extra to start, supervise or lose (a crashed daemon would freeze every cap), the
# segment already holds what the computation needs (under one shared flock: one consistent
# copy), and a dead holder drops out of the next computation of every survivor by itself, as
# does the demand of a stopped one (Note [Demand of a stopped holder] in budget).
