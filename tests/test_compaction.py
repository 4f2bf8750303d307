"""Moving live blocks so that pages beyond a limit empty without preemption: the page plan
(kvcached.compaction), BlockAllocator.alloc_on, and KVCacheManager.plan_compaction on the host
backend, model-based: whatever the allocs, frees, pins and limit, the plan moves only live blocks
of the pages it empties, onto free slots of pages already mapped, and freeing the old ids empties
exactly those pages. See Note [Moving blocks instead of preempting]."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcached import KVCacheManager, init_kvcached
from kvcached.compaction import plan_pages
from kvcached.errors import KVCachedArgumentError, MappingError

from _stacks import KV_PAGE_BYTES, state_of

KIB = 1 << 10


# -- the page plan --------------------------------------------------------------------------------

@st.composite
def page_counts(draw):
    pages = draw(st.lists(st.integers(0, 40), min_size=1, max_size=12, unique=True))
    capacity = {p: draw(st.integers(1, 8)) for p in pages}
    live = {p: draw(st.integers(1, capacity[p])) for p in pages}
    stay = set(draw(st.lists(st.sampled_from(pages), max_size=3)))
    return live, capacity, draw(st.integers(-1, len(pages) + 1)), stay


@settings(max_examples=300, deadline=None)
@given(page_counts())
def test_the_plan_fits_the_moved_blocks_into_free_slots_of_the_pages_left(case):
    live, capacity, pages, stay = case
    victims, destinations = plan_pages(live, capacity, pages, stay)
    assert len(set(victims)) == len(victims) <= max(0, pages)
    assert not set(victims) & stay
    targets = [p for p, _ in destinations]
    assert len(set(targets)) == len(targets) and not set(targets) & set(victims)
    assert all(0 < n <= capacity[p] - live[p] for p, n in destinations)
    assert sum(n for _, n in destinations) == sum(live[p] for p in victims)
    # the emptiest candidates first, and the next one would not have fit
    candidates = sorted((p for p in live if p not in stay), key=lambda p: (live[p], -p))
    assert victims == candidates[:len(victims)]
    if len(victims) < min(max(0, pages), len(candidates)):
        nxt = candidates[len(victims)]
        room = sum(capacity[p] - live[p] for p in live if p not in victims and p != nxt)
        assert sum(live[p] for p in victims) + live[nxt] > room


def test_the_plan_empties_the_emptiest_pages_into_the_fullest():
    live, capacity = {0: 7, 1: 2, 2: 5, 3: 1}, {p: 8 for p in range(4)}
    assert plan_pages(live, capacity, 2, set()) == ([3, 1], [(0, 1), (2, 2)])
    assert plan_pages(live, capacity, 2, {3}) == ([1, 2], [(0, 1), (3, 6)])   # the pinned page takes 6
    assert plan_pages(live, capacity, 4, set()) == ([3, 1], [(0, 1), (2, 2)])    # page 2's 5 fit nowhere
    assert plan_pages(live, capacity, 0, set()) == ([], [])


# -- BlockAllocator.alloc_on ----------------------------------------------------------------------

def test_alloc_on_takes_free_ids_of_a_page_in_use_and_maps_nothing(stack_factory):
    s = stack_factory(num_pages=8, block_bytes=16 * KIB, max_reserved=0)    # 4 blocks per page
    ids = s.blocks.alloc(6)                                                 # pages 0 (full) and 1 (2 of 4)
    maps = s.pages.stats()["num_maps"]
    got = s.blocks.alloc_on(1, 2)
    assert sorted(got) == [6, 7] and s.pages.stats()["num_maps"] == maps
    assert s.blocks.block_states()[got].tolist() == [1, 1]
    assert s.blocks.alloc_on(1, 0) == []
    before = state_of(s)
    for page, n in [(1, 1), (0, 1), (2, 1), (5, 3)]:                        # full pages, pages not in use
        assert s.blocks.alloc_on(page, n) is None
    assert state_of(s) == before
    for page, error in [(8, MappingError), (-1, MappingError), (1.5, TypeError), ("1", TypeError)]:
        with pytest.raises(error):
            s.blocks.alloc_on(page, 1)
    with pytest.raises(ValueError):
        s.blocks.alloc_on(1, -1)
    with pytest.raises(TypeError):
        s.blocks.alloc_on(1, True)
    assert state_of(s) == before
    s.blocks.free(ids + got)
    assert s.table.mapped_page_ids() == []
    s.blocks.check_invariants()


# -- KVCacheManager.plan_compaction ---------------------------------------------------------------

def manager(kv_env, layout: str) -> KVCacheManager:
    kv_env(LAYOUT=layout, MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=0)
    init_kvcached(device="cpu", page_size_bytes=KV_PAGE_BYTES)
    return KVCacheManager(256, 16, 2 * KIB, 1)        # 32 KiB blocks, 2 per 64 KiB page and buffer


def owned_pages(m: KVCacheManager) -> set[int]:
    return set(m.pages_of(np.flatnonzero(m._blocks.block_states() == 1).tolist()))


@pytest.mark.parametrize("layout", ["interleaved", "page_grouped", "per_layer"])
def test_plan_compaction_empties_pages_onto_mapped_free_slots(kv_env, layout):
    """Random allocs and frees leave pages partly used; a limit below the mapped pages, some ids
    pinned: the plan moves live blocks only, off pages without a pinned id, onto free slots of
    pages that stay, mapping nothing; freeing the old ids unmaps exactly the emptied pages. When
    the blocks fit the limit and nothing is pinned, the limit is then met without preemption."""
    m = manager(kv_env, layout)
    revisions = itertools.count(1)

    @settings(max_examples=40, deadline=None)
    @given(sizes=st.lists(st.integers(1, 5), min_size=2, max_size=24), data=st.data())
    def check(sizes, data):
        m.set_memory_limit(-1, revision=next(revisions))
        m.clear()                               # each example from an empty manager
        requests = [m.alloc(n) for n in sizes]
        requests = [r for r in requests if r is not None]
        kept = [r for r in requests if data.draw(st.booleans())]
        for r in requests:
            if r not in kept:
                m.free(r)
        live = [b for r in kept for b in r]
        pinned = data.draw(st.lists(st.sampled_from(live), max_size=2)) if live else []
        pages = owned_pages(m)
        limit_pages = data.draw(st.integers(0, max(0, len(pages) - 1)))
        m.set_memory_limit(limit_pages * m.page_bytes, revision=next(revisions))
        fits = m.over_limit_blocks() == 0
        mapped = m.get_mapped_memory_size()
        moves = m.plan_compaction(pinned)
        old, new = list(moves), list(moves.values())
        assert set(old) <= set(live) and not set(new) & set(live) and len(set(new)) == len(new)
        assert not set(m.pages_of(old)) & set(m.pages_of(new))
        assert not set(m.pages_of(old)) & set(m.pages_of(pinned))
        assert set(m.pages_of(new)) <= pages and m.get_mapped_memory_size() == mapped
        emptied = set(m.pages_of(old))
        assert all(m.pages_of([b]) [0] not in emptied for b in set(live) - set(old))
        m.free(old)
        assert owned_pages(m) == pages - emptied
        if fits and not pinned:                 # pages of equal blocks: the blocks fit the limit
            assert m.over_limit_pages() == 0
        m.check_invariants()

    check()
    m.close()


def test_plan_compaction_keeps_held_blocks_and_refuses_bad_pins(kv_env):
    m = manager(kv_env, "interleaved")
    ids = m.alloc(2) + m.alloc(2)           # pages 0 and 1, full
    m.free([ids[1], ids[3]])                # one live block on each
    assert m.try_to_reserve(1)              # one page full again, with a held block
    m.set_memory_limit(m.page_bytes, revision=1)
    assert m.over_limit_pages() == 1
    assert m.plan_compaction() == {}        # the held page stays, the other's block fits nowhere
    m.free_reserved()
    for bad in ([-1], ["x"], [1.5]):
        with pytest.raises(KVCachedArgumentError):
            m.plan_compaction(bad)
    assert m.plan_compaction([ids[0], ids[2]]) == {}        # both pages pinned
    moves = m.plan_compaction()
    assert len(moves) == 1
    m.free(list(moves))
    assert m.over_limit_pages() == 0
    m.free([b for b in (ids[0], ids[2]) if b not in moves] + list(moves.values()))
    m.check_invariants()
    m.close()
