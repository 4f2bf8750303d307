"""Limit arithmetic: how a limit request is judged, and how an instance's limit is shared out.

The manager (``set_memory_limit``, the limit requests operators write with ``kvctl limit``) and
the runtime (``set_instance_memory_limit``, one limit over every pool) use it; the segment stores
its values (``kvcached.shm``). Pure Python; imports nothing of ``kvcached.shm``.

Revision semantics (the manager's apply callback implements them; ``classify_limit_request``
spells them out): a request whose revision is lower than the current revision is ``stale`` and
changes nothing; the same revision with a different limit is a ``conflict`` and changes nothing; the
same revision and limit is idempotent; a higher revision is applied now (``applied``) or recorded
and applied once usage has fallen below it (``deferred``).
"""

from __future__ import annotations

from .errors import KVCachedConfigError

NO_LIMIT = -1                # a limit of "no limit": capacity bounds the instance
I64_MAX = (1 << 63) - 1      # the largest value an i64 field of a segment holds


def classify_limit_request(current_limit_bytes: int, current_revision: int, limit_bytes: int,
                           revision: int) -> str:
    """How an instance must treat a limit request, by the module's revision semantics.

    Returns ``"stale"`` (revision below the current one: reject), ``"conflict"`` (same revision,
    other limit: reject), ``"same"`` (same revision and limit: answer with the current state) or
    ``"new"`` (higher revision: apply now, or defer until usage allows).
    """
    if revision < current_revision:
        return "stale"
    if revision == current_revision:
        return "same" if limit_bytes == current_limit_bytes else "conflict"
    return "new"


def split_limit(limit_bytes: int, capacities: list[int], page_size_bytes: int = 0) -> list[int]:
    """Divide an instance-wide limit across its pools in proportion to their capacities.

    Largest-remainder rounding: the shares sum exactly to ``limit_bytes`` (or to it rounded down to
    a whole number of pages when ``page_size_bytes`` > 0, every share then being page-aligned).
    Pools of capacity 0 get 0, unless all capacities are 0 (then equal shares). NO_LIMIT gives
    NO_LIMIT to every pool. O(n log n).

    Example: ``split_limit(10, [1, 1, 1]) == [4, 3, 3]``.

    Raises:
        KVCachedConfigError: negative limit (other than NO_LIMIT), capacity or page size.
    """
    if limit_bytes == NO_LIMIT:
        return [NO_LIMIT] * len(capacities)
    if limit_bytes < 0:
        raise KVCachedConfigError(
            f"limit_bytes={limit_bytes} is invalid: give an int >= 0, or NO_LIMIT (-1)")
    if any(c < 0 for c in capacities):
        raise KVCachedConfigError(f"capacities={capacities} must all be >= 0")
    if page_size_bytes < 0:
        raise KVCachedConfigError(f"page_size_bytes={page_size_bytes} must be >= 0")
    if not capacities:
        return []
    unit = page_size_bytes or 1
    units = limit_bytes // unit
    weights = capacities if sum(capacities) else [1] * len(capacities)
    total = sum(weights)
    shares = [units * w // total for w in weights]
    remainders = sorted(range(len(weights)), key=lambda i: (-(units * weights[i] % total), i))
    for i in remainders[: units - sum(shares)]:
        shares[i] += 1
    return [s * unit for s in shares]
