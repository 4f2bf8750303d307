"""PageTable on the host backend: all-or-nothing map with rollback, zero page, validation, and a
seeded model-based test of map/unmap over several segments (mirrors kvcached/core/pagetable.pyx)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcached import core
from kvcached.errors import KVCachedConfigError, KVCachedError, MappingError, OutOfDeviceMemory

from _backends import (
    OS_PAGE,
    assert_segfaults_after,
    fill,
    host_backend,
    live_state,
    pool_bytes,
    read,
    run_child,
)

G = OS_PAGE


def make_table(backend, num_pages=4, num_segments=3, map_bytes=G, zero_page=False, ranges_out=None):
    """`num_segments` segments over two ranges (segments 0 and 2 share the first range at
    different offsets, segment 1 has the second), like a small per_layer layout."""
    span = map_bytes * num_pages
    first = backend.reserve(span * ((num_segments + 1) // 2))
    second = backend.reserve(span * max(1, num_segments // 2))
    segments = []
    for s in range(num_segments):
        r, k = (first, s // 2) if s % 2 == 0 else (second, s // 2)
        segments.append((r, k * span))
    if ranges_out is not None:
        ranges_out.extend([first, second])
    return core.PageTable(backend, segments, map_bytes, num_pages, zero_page=zero_page)


# -- map / unmap semantics -------------------------------------------------------------------------


def test_map_backs_every_segment_with_its_own_memory():
    b = host_backend()
    pt = make_table(b)
    assert pt.map([1, 3])
    pt.check_invariants()
    assert pt.mapped_page_ids() == [1, 3] and pt.num_mapped == 2
    assert pt.mapped_bytes == 2 * 3 * G and pt.page_bytes == 3 * G
    addresses = pt.segment_addresses(1) + pt.segment_addresses(3)
    assert len(set(addresses)) == 6
    for i, address in enumerate(addresses):
        fill(address, i + 1, G)
    for i, address in enumerate(addresses):
        assert read(address, G) == bytes([i + 1]) * G
    assert b.stats()["physical_bytes"] == 6 * G


def test_unmap_returns_handles_to_the_cache_and_remap_reuses_them():
    b = host_backend()
    pt = make_table(b)
    assert pt.map([0, 1])
    pt.unmap([0])
    assert pt.mapped_page_ids() == [1]
    s = b.stats()
    assert s["cached_handles"] == 3 and s["physical_bytes"] == 6 * G
    assert pt.map([2])
    s2 = b.stats()
    assert s2["num_creates"] == s["num_creates"] and s2["num_cache_hits"] == s["num_cache_hits"] + 3
    pt.check_invariants()


def test_unmapped_page_faults_in_a_child():
    result = run_child(
        """
        import ctypes
        from kvcached import core
        g = 4096
        b = core.HostBackend(granularity=g, capacity_bytes=1 << 20)
        r = b.reserve(8 * g)
        pt = core.PageTable(b, [(r, 0), (r, 4 * g)], g, 4)
        assert pt.map([0, 1, 2])
        pt.unmap([1])
        for p in (0, 2):
            for a in pt.segment_addresses(p):
                ctypes.memset(a, 1, g)
        print("ok", flush=True)
        ctypes.memset(pt.segment_addresses(1)[1], 1, 1)
        print("survived")
        """
    )
    assert_segfaults_after(result)


def test_map_of_nothing_is_a_no_op():
    b = host_backend()
    pt = make_table(b)
    before = live_state(b, pt)
    assert pt.map([]) is True
    pt.unmap([])
    assert live_state(b, pt) == before


def test_page_ids_accept_numpy_arrays_and_ranges():
    b = host_backend()
    pt = make_table(b)
    assert pt.map(np.array([0, 2], dtype=np.int32))
    assert pt.map(range(1, 2))
    pt.unmap(np.array([2, 0], dtype=np.uint64))
    assert pt.mapped_page_ids() == [1]


# -- zero page --------------------------------------------------------------------------------------


def test_zero_page_reads_zeros_then_real_data_then_zeros_again():
    b = host_backend()
    pt = make_table(b, zero_page=True)
    pt.check_invariants()
    for p in range(pt.num_pages):
        for address in pt.segment_addresses(p):
            assert read(address, G) == b"\0" * G
    assert pt.map([2])
    for s, address in enumerate(pt.segment_addresses(2)):
        fill(address, 0x40 + s, G)
    for s, address in enumerate(pt.segment_addresses(2)):
        assert read(address, G) == bytes([0x40 + s]) * G
    assert read(pt.segment_addresses(1)[0], G) == b"\0" * G     # the zero page was not written
    pt.unmap([2])
    for address in pt.segment_addresses(2):
        assert read(address, G) == b"\0" * G
    pt.check_invariants()


def test_zero_page_is_zero_even_when_its_handle_comes_from_the_cache():
    # Regression: the zero page's handle is acquired through the cache, and a cached handle holds
    # its last user's data; the host backend did not clear it.
    b = host_backend()
    r = b.reserve(G)
    h = b.acquire(G)
    b.map(r.address, G, h)
    fill(r.address, 0x77, G)
    b.unmap(r.address, G)
    b.recycle(h, G)
    pt = make_table(b, zero_page=True)
    assert b.stats()["num_cache_hits"] == 1
    for p in range(pt.num_pages):
        for address in pt.segment_addresses(p):
            assert read(address, G) == b"\0" * G


def test_zero_page_is_read_only():
    result = run_child(
        """
        import ctypes
        from kvcached import core
        g = 4096
        b = core.HostBackend(granularity=g, capacity_bytes=1 << 20)
        r = b.reserve(4 * g)
        pt = core.PageTable(b, [(r, 0)], g, 4, zero_page=True)
        assert pt.map([1])
        ctypes.memset(pt.segment_addresses(1)[0], 5, g)         # a mapped page is writable
        assert ctypes.string_at(pt.segment_addresses(2)[0], g) == bytes(g)
        print("ok", flush=True)
        ctypes.memset(pt.segment_addresses(2)[0], 5, 1)         # the zero page is not
        print("survived")
        """
    )
    assert_segfaults_after(result)


def test_zero_page_is_read_only_again_after_unmap():
    result = run_child(
        """
        import ctypes
        from kvcached import core
        g = 4096
        b = core.HostBackend(granularity=g, capacity_bytes=1 << 20)
        r = b.reserve(4 * g)
        pt = core.PageTable(b, [(r, 0)], g, 4, zero_page=True)
        assert pt.map([1])
        ctypes.memset(pt.segment_addresses(1)[0], 5, g)
        pt.unmap([1])
        assert ctypes.string_at(pt.segment_addresses(1)[0], g) == bytes(g)
        print("ok", flush=True)
        ctypes.memset(pt.segment_addresses(1)[0], 5, 1)
        print("survived")
        """
    )
    assert_segfaults_after(result)


def test_zero_page_costs_one_handle_and_close_gives_it_back():
    b = host_backend(capacity_granules=8)
    pt = make_table(b, num_pages=8, zero_page=True)
    assert b.stats()["physical_bytes"] == G and pt.mapped_bytes == 0
    pt.close()
    assert not pt.zero_page
    b.release_cached()
    assert b.stats()["physical_bytes"] == 0 and pool_bytes(b) == 0


def test_zero_page_out_of_memory_raises():
    b = host_backend()
    b.inject_out_of_memory(0)
    with pytest.raises(OutOfDeviceMemory):
        make_table(b, zero_page=True)
    b.inject_out_of_memory(-1)
    assert b.stats()["physical_bytes"] == 0


# -- out of memory and fault injection: False, nothing changed ---------------------------------------


def test_map_beyond_capacity_returns_false_and_changes_nothing():
    b = host_backend(capacity_granules=7)           # room for two pages of 3 segments, plus one
    pt = make_table(b)
    assert pt.map([0, 1])
    fill(pt.segment_addresses(0)[0], 0xAB, G)
    before, blocks = live_state(b, pt), pool_bytes(b)
    assert pt.map([2, 3]) is False                  # needs 6, has room for 1
    assert live_state(b, pt) == before and pool_bytes(b) == blocks
    assert read(pt.segment_addresses(0)[0], G) == b"\xab" * G
    pt.unmap([1])
    assert pt.map([2])                              # three handles from the cache
    pt.check_invariants()


def test_map_beyond_capacity_with_a_warm_cache_changes_nothing():
    b = host_backend(capacity_granules=7)
    pt = make_table(b)
    assert pt.map([0, 1])
    pt.unmap([1])                                   # 3 cached, 3 mapped, room for 1 more
    before = live_state(b, pt)
    assert pt.map([1, 2]) is False                  # needs 6: 3 hits + 1 create, then out of memory
    assert live_state(b, pt) == before


def test_fault_injection_at_every_acquisition_of_a_multi_segment_multi_page_map():
    b = host_backend(capacity_granules=64)
    pt = make_table(b, num_pages=6, num_segments=3)
    assert pt.map([4])
    pt.unmap([4])                                   # a warm cache: acquisitions mix hits and creates
    assert pt.map([5])
    fill(pt.segment_addresses(5)[1], 0x11, G)
    ids = [0, 2, 3]
    needed = len(ids) * pt.num_segments
    for after in range(needed):
        before = live_state(b, pt)
        b.inject_out_of_memory(after)
        assert pt.map(ids) is False, after
        assert live_state(b, pt) == before, after
        assert read(pt.segment_addresses(5)[1], G) == b"\x11" * G
    b.inject_out_of_memory(needed)                  # exactly enough
    assert pt.map(ids)
    pt.unmap(ids)
    b.inject_out_of_memory(-1)
    assert pt.map(ids)
    assert pt.mapped_page_ids() == [0, 2, 3, 5]
    pt.check_invariants()


def test_fault_injection_with_zero_page_restores_the_zero_page():
    result = run_child(
        """
        import ctypes
        from kvcached import core
        g = 4096
        b = core.HostBackend(granularity=g, capacity_bytes=1 << 20)
        r = b.reserve(8 * g)
        pt = core.PageTable(b, [(r, 0), (r, 4 * g)], g, 4, zero_page=True)
        for after in range(4):
            b.inject_out_of_memory(after)
            assert pt.map([0, 1]) is False
        b.inject_out_of_memory(-1)
        pt.check_invariants()
        for p in range(4):
            for a in pt.segment_addresses(p):
                assert ctypes.string_at(a, g) == bytes(g)
        print("ok", flush=True)
        ctypes.memset(pt.segment_addresses(1)[1], 1, 1)   # still the read-only zero page
        print("survived")
        """
    )
    assert_segfaults_after(result)


# -- bad input: the specific exception, nothing changed ----------------------------------------------


@pytest.fixture()
def mapped_table():
    b = host_backend()
    pt = make_table(b, num_pages=4)
    assert pt.map([1, 2])
    return b, pt


@pytest.mark.parametrize(
    "ids",
    [[1], [0, 2], [3, 3], [0, 0], [4], [-1], [0, 7], [2**40], [0.0], [1.5], [True], ["0"], [None]],
    ids=["mapped", "one-mapped", "dup", "dup-unmapped", "past-end", "negative", "one-past-end", "huge",
         "float", "float-frac", "bool", "str", "none"],
)
def test_bad_ids_to_map_raise_mapping_error_and_change_nothing(mapped_table, ids):
    b, pt = mapped_table
    before = live_state(b, pt)
    with pytest.raises(MappingError):
        pt.map(ids)
    assert live_state(b, pt) == before


@pytest.mark.parametrize("ids", [[0], [1, 3], [1, 1], [4], [-1], [1.0]],
                         ids=["unmapped", "one-unmapped", "dup", "past-end", "negative", "float"])
def test_bad_ids_to_unmap_raise_mapping_error_and_change_nothing(mapped_table, ids):
    b, pt = mapped_table
    before = live_state(b, pt)
    with pytest.raises(MappingError):
        pt.unmap(ids)
    assert live_state(b, pt) == before


def test_is_mapped_and_segment_addresses_check_the_id(mapped_table):
    _, pt = mapped_table
    assert pt.is_mapped(1) and not pt.is_mapped(0)
    for bad in (-1, 4):
        with pytest.raises(MappingError):
            pt.is_mapped(bad)
        with pytest.raises(MappingError):
            pt.segment_addresses(bad)


def _table_args_cases(b):
    r = b.reserve(8 * G)
    other = host_backend().reserve(8 * G)
    return {
        "map_bytes-not-aligned": ([(r, 0)], G + 512, 2, MappingError),
        "map_bytes-zero": ([(r, 0)], 0, 2, MappingError),
        "map_bytes-larger-than-range": ([(r, 0)], 16 * G, 1, MappingError),
        "pages-past-range": ([(r, 0)], G, 9, MappingError),
        "offset-past-range": ([(r, 8 * G)], G, 1, MappingError),
        "offset-misaligned": ([(r, 100)], G, 2, MappingError),
        "offset-negative": ([(r, -G)], G, 2, MappingError),
        "offset-wraps-around": ([(r, 2**64 - G)], G, 2, MappingError),
        "offset-float": ([(r, 0.0)], G, 2, MappingError),
        "segments-overlap": ([(r, 0), (r, 2 * G)], G, 4, MappingError),
        "segments-identical": ([(r, 0), (r, 0)], G, 1, MappingError),
        "range-of-another-backend": ([(other, 0)], G, 2, MappingError),
        "no-segments": ([], G, 2, KVCachedConfigError),
        "no-pages": ([(r, 0)], G, 0, KVCachedConfigError),
        "negative-pages": ([(r, 0)], G, -1, KVCachedConfigError),
    }


@pytest.mark.parametrize("case", list(_table_args_cases(host_backend())))
def test_bad_page_table_arguments_raise_and_allocate_nothing(case):
    b = host_backend()
    segments, map_bytes, num_pages, error = _table_args_cases(b)[case]
    before = b.stats()
    with pytest.raises(error):
        core.PageTable(b, segments, map_bytes, num_pages, zero_page=True)
    assert b.stats() == before


def test_adjacent_segments_are_accepted():
    b = host_backend()
    r = b.reserve(8 * G)
    pt = core.PageTable(b, [(r, 0), (r, 4 * G)], G, 4)
    assert pt.map([3])


def test_freed_range_refuses_map_unmap_and_close():
    # Regression: a freed range's addresses may be handed to someone else by the OS; mapping or
    # unmapping there (MAP_FIXED) would clobber their memory.
    b = host_backend()
    ranges = []
    pt = make_table(b, ranges_out=ranges)
    assert pt.map([0])
    ranges[1].free()
    before = live_state(b)
    with pytest.raises(MappingError):
        pt.map([1])
    with pytest.raises(MappingError):
        pt.unmap([0])
    with pytest.raises(MappingError):
        pt.close()
    assert live_state(b) == before
    with pytest.raises(MappingError):
        core.PageTable(b, [(ranges[1], 0)], G, 1)


def test_close_empties_the_table_and_a_closed_table_maps_nothing():
    b = host_backend()
    pt = make_table(b)
    assert pt.map([0, 3])
    pt.close()
    assert pt.num_mapped == 0 and pt.mapped_page_ids() == []
    assert pt.lifecycle == "closed"
    pt.check_invariants()
    pt.close()                                      # idempotent
    with pytest.raises(KVCachedError, match="page table is closed; .*init_kvcached"):
        pt.map([1])
    assert pt.num_mapped == 0 and b.physical_bytes == b.cached_bytes
    pt.check_invariants()


def test_dropping_a_table_recycles_its_handles():
    b = host_backend(cache_capacity=2)
    pt = make_table(b)
    assert pt.map([0, 1])
    del pt
    s = b.stats()
    assert s["cached_handles"] == 2 and s["physical_bytes"] == 2 * G and s["num_releases"] == 4


# -- model-based: random map/unmap against a Python model -------------------------------------------


class _Model:
    """What the table must show: which pages are mapped and the byte written into each mapping."""

    def __init__(self, num_pages, num_segments, capacity, cache_capacity):
        self.values: dict[int, list[int]] = {}
        self.num_pages, self.num_segments = num_pages, num_segments
        self.capacity, self.cache_capacity = capacity, cache_capacity
        self.live = 0          # handles created and not released (mapped + cached)
        self.cached = 0

    def map_fits(self, n_pages):
        need = n_pages * self.num_segments
        return self.live + max(0, need - self.cached) <= self.capacity

    def do_map(self, ids, counter):
        need = len(ids) * self.num_segments
        hits = min(self.cached, need)
        self.cached -= hits
        self.live += need - hits
        for p in ids:
            self.values[p] = [(counter + 7 * p + 31 * s) % 251 + 1 for s in range(self.num_segments)]

    def do_unmap(self, ids):
        for p in ids:
            del self.values[p]
        back = len(ids) * self.num_segments
        kept = min(back, self.cache_capacity - self.cached)
        self.cached += kept
        self.live -= back - kept


_op = st.tuples(st.sampled_from(["map", "unmap", "map_bad", "unmap_bad", "trim"]),
                st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True))


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=st.lists(_op, min_size=1, max_size=30),
       capacity=st.integers(3, 18), cache_capacity=st.integers(0, 4), zero_page=st.booleans())
def test_random_map_unmap_matches_the_model(ops, capacity, cache_capacity, zero_page):
    num_pages, num_segments = 6, 3
    b = host_backend(capacity_granules=capacity + int(zero_page), cache_capacity=cache_capacity)
    pt = make_table(b, num_pages=num_pages, num_segments=num_segments, zero_page=zero_page)
    model = _Model(num_pages, num_segments, capacity, cache_capacity)
    for step, (kind, ids) in enumerate(ops):
        mapped = set(model.values)
        if kind == "map":
            ids = [p for p in ids if p not in mapped]
            if not ids:
                continue
            fits = model.map_fits(len(ids))
            assert pt.map(ids) is fits, (step, ids)
            if fits:
                model.do_map(ids, step)
                for p in ids:
                    for s, address in enumerate(pt.segment_addresses(p)):
                        fill(address, model.values[p][s], G)
        elif kind == "unmap":
            ids = [p for p in ids if p in mapped]
            if not ids:
                continue
            pt.unmap(ids)
            model.do_unmap(ids)
        elif kind == "map_bad":
            if not set(ids) & mapped:
                continue
            with pytest.raises(MappingError):
                pt.map(ids)
        elif kind == "unmap_bad":
            if set(ids) <= mapped:
                continue
            with pytest.raises(MappingError):
                pt.unmap(ids)
        else:
            b.release_cached()
            model.live -= model.cached
            model.cached = 0
        # the whole state, after every step
        pt.check_invariants()
        assert pt.mapped_page_ids() == sorted(model.values)
        stats = b.stats()
        zero = 1 if zero_page else 0
        assert stats["cached_handles"] == model.cached, step
        assert stats["physical_bytes"] == (model.live + zero) * G, step
        for p in range(num_pages):
            for s, address in enumerate(pt.segment_addresses(p)):
                if p in model.values:
                    assert read(address, G) == bytes([model.values[p][s]]) * G, (step, p, s)
                elif zero_page:
                    assert read(address, G) == b"\0" * G, (step, p, s)
    pt.close()
    b.release_cached()
    assert b.stats()["physical_bytes"] == 0 and pool_bytes(b) == 0


def _churn_until_closed(pages, started, errors) -> None:
    """Take and give back pages (each a map and an unmap) until the table refuses to map."""
    try:
        while True:
            ids = pages.take(4)
            started.set()
            if ids is not None:
                pages.give_back(ids)
    except KVCachedError:
        pass                                        # the table was closed: maps are refused
    except Exception as exc:  # noqa: BLE001 - anything but the closed error fails the test
        errors.append(exc)
    finally:
        started.set()


def test_close_racing_with_an_allocator_never_recycles_a_handle_twice():
    """close() and the page allocator's unmaps both read and clear a page's handles; both run
    under the table's lock, so a handle goes back to the backend exactly once (recycled twice,
    two pages would share one allocation). Afterwards the allocator's maps are refused."""
    import threading

    from kvcached.core import PageAllocator

    from _stacks import GRANULARITY

    for _ in range(20):
        b = core.HostBackend(GRANULARITY, 64 * GRANULARITY)
        b.set_handle_cache_capacity(0)              # every recycle is a release: twice would show
        ranges = [b.reserve(16 * GRANULARITY) for _ in range(3)]
        pt = core.PageTable(b, [(r, 0) for r in ranges], GRANULARITY, 16)
        pages = PageAllocator(pt, min_reserved=0, max_reserved=0, idle_trim_s=0)
        started, errors = threading.Event(), []
        t = threading.Thread(target=_churn_until_closed, args=(pages, started, errors))
        t.start()
        assert started.wait(30)
        pt.close()
        t.join(30)
        assert not t.is_alive() and not errors, errors
        assert pt.num_mapped == 0
        pages.drain()
        b.release_cached()
        assert b.physical_bytes == 0, f"physical bytes {b.physical_bytes}: a handle was released twice or leaked"
        assert b.num_creates == b.num_releases
        assert pool_bytes(b) == 0
