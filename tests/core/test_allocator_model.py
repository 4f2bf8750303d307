"""Model-based test: random sequences of alloc / free / try_to_reserve / free_reserved / resize /
trim / clear / limits against a small pure-Python model, on real host mappings with tiny pages,
with a failing map, set-access or unmap (error or out of memory) injected at any step.

After every step: no id is live twice, the counts match the model, every page holding a live or
held block is mapped, the budget gate holds exactly the mapped bytes, and both allocators'
check_invariants() pass. Variants run with the zero page, the budget gate and the background
thread on."""

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import pytest

from kvcached.errors import DriverError, KVCachedConfigError, OutOfDeviceMemory

from _stacks import ByteBudget, make_stack

KIB = 1 << 10


class AllocatorMachine(RuleBasedStateMachine):
    NUM_PAGES = 10
    CAPACITY_GRANULES = 7          # physical memory runs out before the page ids do
    SEGMENTS = 1
    BLOCK_BYTES = 16 * KIB         # 4 per page
    SPARSE = None
    ZERO_PAGE = False              # unmapped page ids show the zero page
    BUDGET_PAGES = None            # a budget gate of this many pages (binding before memory when small)
    BACKGROUND = False             # the refill thread runs: only what holds under concurrency is checked

    def __init__(self):
        super().__init__()
        self.s = None

    @initialize(min_reserved=st.integers(0, 2), extra=st.integers(0, 2))
    def setup(self, min_reserved, extra):
        self.s = make_stack(num_pages=self.NUM_PAGES, capacity_granules=self.CAPACITY_GRANULES,
                            segments=self.SEGMENTS, block_bytes=self.BLOCK_BYTES, sparse=self.SPARSE,
                            min_reserved=min_reserved, max_reserved=min_reserved + extra,
                            zero_page=self.ZERO_PAGE)
        self.b = self.s.blocks
        self.budget = None
        if self.BUDGET_PAGES is not None:
            self.budget = ByteBudget(self.BUDGET_PAGES * self.s.table.page_bytes)
            self.s.pages.set_budget_gate(self.budget.acquire, self.budget.release)
        if self.BACKGROUND:
            self.s.pages.start()
        self.live = set()          # ids the model handed to the caller
        self.held = 0              # blocks held by try_to_reserve
        self.capacity = self.NUM_PAGES

    def teardown(self):
        if self.s is not None:
            self.s.close()

    def page(self, block_id):
        return block_id * self.b.id_to_page_num // self.b.id_to_page_den

    def available(self):
        """available_blocks, capped by the budget's free bytes as a manager does."""
        if self.budget is None:
            return self.b.available_blocks()
        free_pages = (self.budget.capacity_bytes - self.budget.held_bytes) // self.s.table.page_bytes
        return self.b.available_blocks(free_pages)

    def exact(self):
        """Whether available() is a promise now: not while the refill thread runs, nor while
        unmaps wait for a retry (a slow alloc retries them, and may get more)."""
        return not self.BACKGROUND and self.s.pages.stats()["unmap_retries"] == 0

    # -- rules ----------------------------------------------------------------------------------
    @rule(n=st.integers(0, 14))
    def alloc(self, n):
        available = self.available()
        exact = self.exact()
        slow = self.s.pages.stats()["num_slow_path"]
        got = self.b.alloc(n)
        if not exact:
            if got is None:
                return
        elif n <= available:
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

    def pick(self, picks):
        """Live ids chosen by `picks` (indices modulo the live count). The draws never depend on
        the state, so a run whose outcomes depend on the background thread's timing still draws
        the same data (Hypothesis refuses strategies that follow external state)."""
        live = sorted(self.live)
        return sorted({live[i % len(live)] for i in picks}) if live else []

    @rule(picks=st.lists(st.integers(0, 255), min_size=1, max_size=14))
    def free(self, picks):
        ids = self.pick(picks)
        if not ids:
            return
        self.b.free(ids)
        self.live -= set(ids)

    @rule(pick=st.integers(0, 255))
    def double_free_is_refused(self, pick):
        if not self.live:
            return
        victim = self.pick([pick])[0]
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
        available = self.available() - self.held
        exact = self.exact()
        ok = self.b.try_to_reserve(n)
        assert ok == (n <= available) or not exact, f"try_to_reserve({n}) -> {ok} with {available} available"
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
            assert self.s.pages.page_states().tolist() == before or self.BACKGROUND
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

    @rule(op=st.sampled_from(["map", "set_access", "unmap"]), after=st.integers(0, 8), oom=st.booleans(),
          action=st.sampled_from(["alloc", "free", "try_to_reserve", "trim", "set_limit", "clear", "drain"]),
          n=st.integers(1, 14), picks=st.lists(st.integers(0, 255), min_size=1, max_size=14),
          limit=st.integers(-1, 10))
    def faulty_step(self, op, after, oom, action, n, picks, limit):
        """One step with a driver failure armed at its `after`-th map / set-access / unmap:
        whatever the step does, it raises a DriverError or succeeds, and the invariants hold."""
        oom = oom and op != "unmap"
        self.s.backend.inject_fault(op, after, oom=oom)
        event(f"fault in {op}{' (oom)' if oom else ''} during {action}")
        try:
            if action == "alloc":
                got = self.b.alloc(n)
                if got is not None:
                    assert len(set(got)) == n and not (set(got) & self.live)
                    self.held -= min(n, self.held)
                    self.live |= set(got)
            elif action == "try_to_reserve":
                if self.b.try_to_reserve(n):
                    self.held += n
            elif action == "free" and self.live:
                ids = self.pick(picks)
                self.b.free(ids)                    # frees whatever the driver does
                self.live -= set(ids)
            elif action == "clear":
                self.b.clear()
                self.live.clear()
                self.held = 0
            elif action == "trim":
                self.b.trim()
            elif action == "set_limit":
                self.s.pages.set_limit_pages(limit)
            elif action == "drain":
                self.s.pages.drain()
        except DriverError as exc:
            # what the injected failures report: EIO, or out of memory where an undo cannot return it
            assert exc.code == 5 or isinstance(exc, OutOfDeviceMemory), exc
            event("step raised")
        finally:
            self.s.backend.inject_fault(op, -1)

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
        if self.budget is not None and not self.BACKGROUND:
            assert self.budget.held_bytes == self.s.table.num_mapped * self.s.table.page_bytes, \
                "the budget gate must hold exactly the mapped pages' bytes"
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


class ZeroPageBudgetMachine(AllocatorMachine):
    SEGMENTS = 2
    ZERO_PAGE = True
    BUDGET_PAGES = 5               # binds before the 7 granules of memory


class BackgroundMachine(AllocatorMachine):
    ZERO_PAGE = True
    BUDGET_PAGES = 6
    BACKGROUND = True


TestDividing = pytest.mark.slow(DividingMachine.TestCase)
TestDividing.settings = SETTINGS
TestStraddling = pytest.mark.slow(StraddlingMachine.TestCase)
TestStraddling.settings = SETTINGS
TestSmallBlocks = pytest.mark.slow(SmallBlockMachine.TestCase)
TestSmallBlocks.settings = SETTINGS
TestSparse = pytest.mark.slow(SparseMachine.TestCase)
TestSparse.settings = SETTINGS
TestZeroPageBudget = pytest.mark.slow(ZeroPageBudgetMachine.TestCase)
TestZeroPageBudget.settings = SETTINGS
TestBackground = BackgroundMachine.TestCase
TestBackground.settings = settings(SETTINGS, max_examples=60)
