"""PageTable.set_mirror: every map and unmap of a table repeated on a peer table, all or nothing
(Note [Mirrored page table]). The peer here is a second real page table on its own host backend,
standing where a tensor-parallel rank stands; kvcached/tp carries the same calls across processes."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _stacks import GRANULARITY, make_stack, make_table
from kvcached.core import HostBackend
from kvcached.errors import KVCachedConfigError, MappingError


class PeerGone(RuntimeError):
    """What a mirror raises when its peer stopped answering."""


class TableMirror:
    """Mirrors onto `peer`, a page table of the same geometry; `gone` makes every call raise."""

    def __init__(self, peer):
        self.peer = peer
        self.gone = False
        self.pending: list[int] | None = None
        self.peer_mapped = False
        self.calls = 0
        self.batches: list[list[int]] = []
        self.table = None                       # the mirrored table (mirrored_stack sets it)
        self.undoing: list[int] | None = None   # ids the table must unmap before map_undone

    def map_start(self, ids: list[int]) -> None:
        self.calls += 1
        self.batches.append(list(ids))
        assert self.pending is None, "map_start twice without map_finish"
        assert self.undoing is None, "map_start before map_undone: the mirror must stay serialised"
        if self.gone:
            raise PeerGone("peer gone at map_start")
        self.pending = list(ids)
        self.peer_mapped = self.peer.map(ids)

    def map_finish(self, mapped_here: bool) -> bool:
        ids, self.pending = self.pending, None
        assert ids is not None, "map_finish without map_start"
        if self.gone:
            raise PeerGone("peer gone at map_finish")
        if self.peer_mapped and not mapped_here:
            self.peer.unmap(ids)
        if mapped_here and not self.peer_mapped:
            self.undoing = ids
        return self.peer_mapped

    def map_undone(self) -> None:
        ids, self.undoing = self.undoing, None
        assert ids is not None, "map_undone without a map_finish(True) that returned False"
        ahead = [p for p in ids if self.table.is_mapped(p)]
        assert not ahead, f"map_undone while the table still maps {ahead}: a reader would see it ahead of its peer"

    def unmap_start(self, ids: list[int]) -> None:
        if self.gone:
            raise PeerGone("peer gone at unmap_start")
        self.peer.unmap([p for p in ids if self.peer.is_mapped(p)])

    def unmap_finish(self) -> None:
        pass


def mirrored_stack(num_pages: int, capacity_granules: int, peer_granules: int, **kw):
    stack = make_stack(num_pages=num_pages, capacity_granules=capacity_granules, **kw)
    peer_backend = HostBackend(GRANULARITY, peer_granules * GRANULARITY)
    peer, peer_ranges = make_table(peer_backend, num_pages)
    mirror = TableMirror(peer)
    mirror.table = stack.table
    stack.table.set_mirror(mirror)
    return stack, mirror, peer_ranges


def assert_same_pages(stack, mirror) -> None:
    assert stack.table.mapped_page_ids() == mirror.peer.mapped_page_ids()
    stack.table.check_invariants()
    mirror.peer.check_invariants()
    stack.pages.check_invariants()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(peer_granules=st.integers(1, 10),
       ops=st.lists(st.tuples(st.sampled_from(["alloc", "free", "trim"]), st.integers(1, 9)), max_size=25))
def test_peer_maps_exactly_what_the_table_maps(peer_granules, ops):
    """Model test: whatever the peer's room, after every alloc / free / trim both tables map the
    same page ids, and an alloc the peer cannot back returns None with nothing changed."""
    stack, mirror, _ = mirrored_stack(12, 10, peer_granules, max_reserved=2)
    live: list[list[int]] = []
    try:
        for op, k in ops:
            if op == "alloc":
                before = stack.table.mapped_page_ids()
                got = stack.blocks.alloc(k)
                if got is None:
                    assert stack.table.mapped_page_ids() == before
                else:
                    live.append(got)
            elif op == "free" and live:
                stack.blocks.free(live.pop(k % len(live)))
            elif op == "trim":
                stack.pages.trim()
            assert_same_pages(stack, mirror)
            assert mirror.peer.num_mapped <= peer_granules
    finally:
        stack.close()


def test_out_of_memory_on_the_peer_is_out_of_memory():
    stack, mirror, _ = mirrored_stack(8, 8, 1, max_reserved=0)
    try:
        first = stack.blocks.alloc(4)               # one page: fits on the peer
        assert first is not None
        assert stack.blocks.alloc(4) is None        # a second page does not
        assert stack.table.mapped_page_ids() == mirror.peer.mapped_page_ids() == [0]
        assert stack.pages.stats()["num_oom"] >= 1
        stack.blocks.free(first)
        assert stack.table.num_mapped == mirror.peer.num_mapped == 0
    finally:
        stack.close()


@pytest.mark.parametrize("at", ["map_start", "map_finish"])
def test_a_peer_gone_while_mapping_raises_and_maps_nothing(at):
    stack, mirror, _ = mirrored_stack(8, 8, 8, max_reserved=0)
    try:
        kept = stack.blocks.alloc(4)
        if at == "map_start":
            mirror.gone = True
        else:
            real_finish = mirror.map_finish

            def finish(mapped_here):
                mirror.gone = True
                return real_finish(mapped_here)
            mirror.map_finish = finish
        with pytest.raises(PeerGone):
            stack.blocks.alloc(8)
        assert stack.table.mapped_page_ids() == [0]     # only the page of `kept`
        stack.pages.check_invariants()
        stack.table.check_invariants()
        assert stack.blocks.stats()["allocated"] == len(kept)
    finally:
        stack.close()


def test_a_peer_gone_while_unmapping_still_unmaps_here():
    """free() does not raise for the unmap of emptied pages (the blocks are free already): the
    mirror's error is kept in pages.last_error, and this table unmaps all the same."""
    stack, mirror, _ = mirrored_stack(8, 8, 8, max_reserved=0)
    try:
        ids = stack.blocks.alloc(8)
        assert stack.table.num_mapped == 2
        mirror.gone = True
        stack.blocks.free(ids)
        assert isinstance(stack.pages.last_error, PeerGone)
        assert stack.table.num_mapped == 0              # local accounting exact
        stack.pages.check_invariants()
        assert stack.pages.stats()["transit"] == 0
    finally:
        stack.close()


def test_a_failed_local_map_is_undone_on_the_peer():
    stack, mirror, _ = mirrored_stack(8, 8, 8, max_reserved=0)
    try:
        stack.backend.inject_out_of_memory(0)           # this table's creates fail from now on
        assert stack.blocks.alloc(4) is None
        assert stack.table.num_mapped == mirror.peer.num_mapped == 0
        stack.backend.inject_out_of_memory(-1)
        assert stack.blocks.alloc(4) is not None
        assert_same_pages(stack, mirror)
    finally:
        stack.close()


def test_the_refill_thread_maps_through_the_mirror():
    stack, mirror, _ = mirrored_stack(16, 16, 16, min_reserved=3, max_reserved=4)
    try:
        stack.pages.start()
        stack.pages.drain(wait=True)
        ids = stack.blocks.alloc(4)                     # wakes the refill thread
        assert ids is not None
        stack.pages.stop()                              # joins it: its last round is over
        assert_same_pages(stack, mirror)
        assert mirror.calls >= 1
    finally:
        stack.close()


def test_set_mirror_checks_the_object_and_the_table():
    stack = make_stack(num_pages=4, capacity_granules=4, max_reserved=0)
    try:
        with pytest.raises(KVCachedConfigError, match="map_start"):
            stack.table.set_mirror(object())
        ids = stack.blocks.alloc(1)
        peer, _ = make_table(HostBackend(GRANULARITY, 4 * GRANULARITY), 4)
        with pytest.raises(MappingError, match="no page id mapped"):
            stack.table.set_mirror(TableMirror(peer))
        assert stack.table.mirror is None
        stack.blocks.free(ids)
        stack.pages.trim()
        mirror = TableMirror(peer)
        stack.table.set_mirror(mirror)
        assert stack.table.mirror is mirror
        stack.table.set_mirror(None)
        assert stack.blocks.alloc(1) is not None and peer.num_mapped == 0
    finally:
        stack.close()


def test_a_refill_round_is_one_message():
    """Under a mirror the refill thread maps a round's pages in one call, not one per page."""
    stack, mirror, _ = mirrored_stack(16, 16, 16, min_reserved=4, max_reserved=4)
    try:
        stack.pages.start()
        deadline = time.monotonic() + 60
        while stack.pages.stats()["reserved"] < 4 and time.monotonic() < deadline:
            time.sleep(0.001)                           # polling a counter, with a generous bound
        stack.pages.stop()
        assert stack.pages.stats()["reserved"] == 4
        assert mirror.batches == [[0, 1, 2, 3]]
        assert_same_pages(stack, mirror)
    finally:
        stack.close()
