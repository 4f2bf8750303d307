"""Model-based test: random sequences of alloc / free / try_to_reserve / free_reserved / resize /
trim / clear / limits against a small pure-Python model, on real host mappings with tiny pages.

After every step: no id is live twice, the counts match the model, every page holding a live or
held block is mapped, and both allocators' check_invariants() pass."""

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pytest

from kvcached.errors import KVCachedConfigError

from _stacks import make_stack

KIB = 1 << 10


class AllocatorMachine(RuleBasedStateMachine):
    NUM_PAGES = 10
    CAPACITY_GRANULES = 7          # physical memory runs out before the page ids do
    SEGMENTS = 1
    BLOCK_BYTES = 16 * KIB         # 4 per page
    SPARSE = None

    def __init__(self):
        super().__init__()
        self.s = None

    @initialize(min_reserved=st.integers(0, 2), extra=st.integers(0, 2))
    def setup(self, min_reserved, extra):
        self.s = make_stack(num_pages=self.NUM_PAGES, capacity_granules=self.CAPACITY_GRANULES,
                            segments=self.SEGMENTS, block_bytes=self.BLOCK_BYTES, sparse=self.SPARSE,
                            min_reserved=min_reserved, max_reserved=min_reserved + extra)
        self.b = self.s.blocks
        self.live = set()          # ids the model handed to the caller
        self.held = 0              # blocks held by try_to_reserve
        self.capacity = self.NUM_PAGES

    def teardown(self):
        if self.s is not None:
            self.s.close()

    def page(self, block_id):
        return block_id * self.b.id_to_page_num // self.b.id_to_page_den

    # -- rules ----------------------------------------------------------------------------------
    @rule(n=st.integers(0, 14))
    def alloc(self, n):
        available = self.b.available_blocks()
        slow = self.s.pages.stats()["num_slow_path"]
        got = self.b.alloc(n)
        if n <= available:
            assert got is not None and len(got) == n, f"alloc({n}) failed with {available} available"
        else:
            assert got is None, f"alloc({n}) succeeded with only {available} available"
            event("alloc refused")
            return
        event("alloc mapped pages" if self.s.pages.stats()["num_slow_path"] > slow else "alloc")
        assert len(set(got)) == n and not (set(got) & self.live)
        taken_from_held = min(n, self.held)
        self.held -= taken_from_held
        self.live |= set(got)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, max_size=len(self.live), unique=True))
        self.b.free(ids)
        self.live -= set(ids)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def double_free_is_refused(self, data):
        victim = data.draw(st.sampled_from(sorted(self.live)))
        before = self.b.block_states().tolist()
        try:
            self.b.free([victim, victim])
        except ValueError:
            pass
        else:
            raise AssertionError("a repeated id was accepted")
        assert self.b.block_states().tolist() == before

    @rule(n=st.integers(0, 8))
    def try_to_reserve(self, n):
        available = self.b.available_blocks() - self.held
        ok = self.b.try_to_reserve(n)
        assert ok == (n <= available), f"try_to_reserve({n}) -> {ok} with {available} available"
        if ok:
            self.held += n

    @rule()
    def free_reserved(self):
        self.b.free_reserved()
        self.held = 0

    @rule(num_pages=st.integers(0, 12))
    def resize(self, num_pages):
        states = self.b.block_states()
        if num_pages > self.NUM_PAGES:          # past the reservation: refused, nothing changed
            before = self.s.pages.page_states().tolist()
            with pytest.raises(KVCachedConfigError):
                self.b.resize(num_pages)
            assert self.s.pages.page_states().tolist() == before
            return
        busy_pages = {self.page(b) for b in self.live} | {self.page(int(b)) for b in (states == 3).nonzero()[0]}
        ok = self.b.resize(num_pages)
        assert ok == all(p < num_pages for p in busy_pages)
        if ok:
            self.capacity = num_pages

    @rule()
    def trim(self):
        self.b.trim()
        assert self.s.pages.stats()["reserved"] == 0

    @rule()
    def clear(self):
        self.b.clear()
        self.live.clear()
        self.held = 0

    @rule(limit=st.one_of(st.just(-1), st.integers(0, 10)))
    def set_limit(self, limit):
        self.s.pages.set_limit_pages(limit)

    # -- after every step -------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if self.s is None:
            return
        st_ = self.b.stats()
        assert st_["allocated"] == len(self.live)
        assert st_["held"] == self.held
        states = self.b.block_states()
        assert all(states[b] == 1 for b in self.live)
        live_pages = {self.page(b) for b in self.live} | {self.page(int(b)) for b in (states == 3).nonzero()[0]}
        mapped = set(self.s.table.mapped_page_ids())
        assert live_pages <= mapped, f"pages {sorted(live_pages - mapped)} hold live blocks but are unmapped"
        assert all(p < self.capacity for p in live_pages)
        pages = st_["pages"]
        assert pages["capacity_pages"] == self.capacity
        assert pages["reserved"] <= max(pages["max_reserved"], 0)
        if pages["limit_pages"] >= 0 and pages["in_use"] <= pages["limit_pages"]:
            assert pages["in_use"] + pages["reserved"] <= pages["limit_pages"]
        self.b.check_invariants()


SETTINGS = settings(max_examples=200, stateful_step_count=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


class DividingMachine(AllocatorMachine):
    pass


class StraddlingMachine(AllocatorMachine):
    BLOCK_BYTES = 24 * KIB         # 2 per page, some blocks straddle
    SEGMENTS = 2


class SmallBlockMachine(AllocatorMachine):
    BLOCK_BYTES = 8 * KIB          # 8 per page
    NUM_PAGES = 6
    CAPACITY_GRANULES = 5


class SparseMachine(AllocatorMachine):
    BLOCK_BYTES = None
    SPARSE = (10, 3)               # page p holds ids [10p, 10p + 3)


TestDividing = DividingMachine.TestCase
TestDividing.settings = SETTINGS
TestStraddling = StraddlingMachine.TestCase
TestStraddling.settings = SETTINGS
TestSmallBlocks = SmallBlockMachine.TestCase
TestSmallBlocks.settings = SETTINGS
TestSparse = SparseMachine.TestCase
TestSparse.settings = SETTINGS
