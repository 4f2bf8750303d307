"""Which pages to empty by moving their live blocks into the free slots of the others, and where
to: the plan behind ``KVCacheManager.plan_compaction``. Pure bookkeeping over per-page counts.

See Note [Moving blocks instead of preempting] in kvcached.kv_cache_manager.
"""

from __future__ import annotations


def plan_pages(live: dict[int, int], capacity: dict[int, int], pages: int,
               stay: set[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """(the pages to empty, [(page, blocks to place on it)]) for emptying up to `pages` of the
    pages in `live` (page -> live blocks; every page in use) by moving their blocks onto the
    others' free slots (capacity[page] - live[page]). The emptiest pages not in `stay` go first,
    as long as their blocks fit on the pages left; the destinations are the fullest pages with a
    free slot (best fit, so the emptier ones can be emptied next). ([], []) when none fits."""
    candidates = sorted((p for p in live if p not in stay), key=lambda p: (live[p], -p))
    free = {p: capacity[p] - live[p] for p in live}
    room = sum(free.values())
    victims: list[int] = []
    moving = 0
    for page in candidates[:max(0, pages)]:
        if moving + live[page] > room - free[page]:
            break
        victims.append(page)
        moving += live[page]
        room -= free[page]
    chosen = set(victims)
    destinations: list[tuple[int, int]] = []
    left = moving
    for page in sorted((p for p in live if p not in chosen and free[p] > 0), key=lambda p: (free[p], p)):
        if left == 0:
            break
        take = min(free[page], left)
        destinations.append((page, take))
        left -= take
    return victims, destinations
