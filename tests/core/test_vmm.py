"""Backend layer on the host backend: real mappings, real memory, faults seen in child processes.

Mirrors kvcached/core/vmm.pyx and hostmem.pyx: reserve / create / map / set access / unmap /
release, the handle cache, fault injection, out of memory, validation, and the no-driver path of CudaBackend.
"""

from __future__ import annotations

import os
import time

import pytest

from kvcached import core
from kvcached.errors import (
    DriverError,
    DriverUnavailableError,
    KVCachedConfigError,
    MappingError,
    OutOfDeviceMemory,
)

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


# -- map / unmap / alias ---------------------------------------------------------------------


def test_alias_two_mappings_of_one_handle_share_memory():
    b = host_backend()
    r1, r2 = b.reserve(4 * G), b.reserve(4 * G)
    h = b.create(G)
    b.map(r1.address + G, G, h)
    b.map(r2.address + 3 * G, G, h)
    fill(r1.address + G, 0x5A, G)
    assert read(r2.address + 3 * G, G) == b"\x5a" * G
    fill(r2.address + 3 * G + 17, 0xC3, 5)
    assert read(r1.address + G + 17, 5) == b"\xc3" * 5
    b.unmap(r1.address + G, G)
    assert read(r2.address + 3 * G, 17) == b"\x5a" * 17      # the other mapping is untouched
    b.unmap(r2.address + 3 * G, G)
    b.release(h, G)
    assert b.stats()["physical_bytes"] == 0


def test_distinct_handles_do_not_alias():
    b = host_backend()
    r = b.reserve(2 * G)
    h1, h2 = b.create(G), b.create(G)
    assert h1 != h2
    b.map(r.address, G, h1)
    b.map(r.address + G, G, h2)
    fill(r.address, 1, G)
    fill(r.address + G, 2, G)
    assert read(r.address, G) == b"\x01" * G and read(r.address + G, G) == b"\x02" * G


def test_remap_shows_the_handles_data_again():
    b = host_backend()
    r = b.reserve(2 * G)
    h = b.create(G)
    b.map(r.address, G, h)
    fill(r.address, 9, G)
    b.unmap(r.address, G)
    b.map(r.address + G, G, h)                                 # another address, same memory
    assert read(r.address + G, G) == b"\x09" * G


def test_reserved_but_never_mapped_address_faults():
    result = run_child(
        """
        import ctypes
        from kvcached import core
        b = core.HostBackend(granularity=4096, capacity_bytes=1 << 20)
        r = b.reserve(4 * 4096)
        print("ok", flush=True)
        ctypes.string_at(r.address + 4096, 1)
        print("survived")
        """
    )
    assert_segfaults_after(result)


def test_unmapped_address_faults_and_neighbour_still_works():
    result = run_child(
        """
        import ctypes
        from kvcached import core
        g = 4096
        b = core.HostBackend(granularity=g, capacity_bytes=1 << 20)
        r = b.reserve(4 * g)
        h0, h1 = b.create(g), b.create(g)
        b.map(r.address, g, h0)
        b.map(r.address + g, g, h1)
        ctypes.memset(r.address + g, 1, g)
        b.unmap(r.address + g, g)
        ctypes.memset(r.address, 2, g)          # the neighbour is still mapped
        print("ok", flush=True)
        ctypes.memset(r.address + g, 3, 1)      # the unmapped page
        print("survived")
        """
    )
    assert_segfaults_after(result)


def test_read_only_access_faults_on_write():
    result = run_child(
        """
        import ctypes
        from kvcached import core
        g = 4096
        b = core.HostBackend(granularity=g, capacity_bytes=1 << 20)
        r = b.reserve(g)
        h = b.create(g)
        b.map(r.address, g, h, writable=False)
        assert ctypes.string_at(r.address, 4) == b"\\0" * 4
        print("ok", flush=True)
        ctypes.memset(r.address, 1, 1)
        print("survived")
        """
    )
    assert_segfaults_after(result)


def test_reservation_is_granularity_aligned_and_large_reserve_is_cheap():
    b = host_backend(granularity=16 * G)
    for _ in range(4):
        r = b.reserve(16 * G)
        assert r.address % (16 * G) == 0
    huge = b.reserve(1 << 40)                                  # 1 TiB of address space, no memory
    assert huge.size_bytes == 1 << 40 and huge.address % (16 * G) == 0
    assert b.stats()["physical_bytes"] == 0
    huge.free()


# -- memory is really given back --------------------------------------------------------------


def test_release_through_recycle_and_release_cached_gives_memory_back():
    g = 16 * G
    b = host_backend(granularity=g, capacity_granules=16)
    r = b.reserve(8 * g)
    base = pool_bytes(b)
    handles = [b.acquire(g) for _ in range(8)]
    for i, h in enumerate(handles):
        b.map(r.address + i * g, g, h)
        fill(r.address + i * g, i + 1, g)
    assert pool_bytes(b) - base >= 8 * g
    for i, h in enumerate(handles):
        b.unmap(r.address + i * g, g)
        b.recycle(h, g)
    # 8 handles fit the default cache of 8: still held, still counted
    assert b.stats()["cached_handles"] == 8 and b.stats()["cached_bytes"] == 8 * g
    assert pool_bytes(b) - base >= 8 * g
    b.release_cached()
    assert pool_bytes(b) == base
    s = b.stats()
    assert (s["physical_bytes"], s["cached_bytes"], s["cached_handles"], s["num_releases"]) == (0, 0, 0, 8)


def test_release_through_page_table_close_and_release_cached_gives_memory_back():
    g = 16 * G
    b = host_backend(granularity=g, capacity_granules=32, cache_capacity=4)
    r = b.reserve(16 * g)
    pt = core.PageTable(b, [(r, 0), (r, 8 * g)], g, 8)
    base = pool_bytes(b)
    assert pt.map(range(8))
    for p in range(8):
        for address in pt.segment_addresses(p):
            fill(address, p + 1, g)
    assert pool_bytes(b) - base >= 16 * g
    pt.close()
    # 4 went to the cache, 12 were released at once
    assert b.stats()["cached_handles"] == 4
    assert pool_bytes(b) - base <= 4 * g
    b.release_cached()
    assert pool_bytes(b) == base
    assert b.stats()["physical_bytes"] == 0


def test_shrinking_cache_capacity_releases_the_extra_handles():
    g = 16 * G
    b = host_backend(granularity=g)
    r = b.reserve(g)
    handles = [b.acquire(g) for _ in range(6)]
    for h in handles:
        b.map(r.address, g, h)
        fill(r.address, 7, g)
        b.unmap(r.address, g)
        b.recycle(h, g)
    held = pool_bytes(b)
    b.set_handle_cache_capacity(2)
    s = b.stats()
    assert s["cached_handles"] == 2 and s["cached_bytes"] == 2 * g and s["physical_bytes"] == 2 * g
    assert held - pool_bytes(b) == 4 * g


def test_create_release_bypasses_the_cache():
    b = host_backend()
    h = b.create(G)
    b.release(h, G)
    s = b.stats()
    assert (s["num_creates"], s["num_releases"], s["cached_handles"], s["physical_bytes"]) == (1, 1, 0, 0)


def test_released_slot_is_reused_and_reads_zero():
    b = host_backend(capacity_granules=2)
    r = b.reserve(G)
    h = b.create(G)
    b.map(r.address, G, h)
    fill(r.address, 0xEE, G)
    b.unmap(r.address, G)
    b.release(h, G)
    h2 = b.create(G)                       # a punched hole: zeros, never the old data
    b.map(r.address, G, h2)
    assert read(r.address, G) == b"\0" * G


# -- handle cache -------------------------------------------------------------------------------


def test_unmap_then_map_again_hits_the_cache_instead_of_creating():
    b = host_backend()
    r = b.reserve(4 * G)
    pt = core.PageTable(b, [(r, 0), (r, 2 * G)], G, 2)
    assert pt.map([0])
    s0 = b.stats()
    pt.unmap([0])
    assert pt.map([0])
    s1 = b.stats()
    assert s1["num_creates"] == s0["num_creates"] == 2
    assert s1["num_cache_hits"] == s0["num_cache_hits"] + 2
    assert s1["num_releases"] == 0


def test_cache_capacity_bound_is_respected():
    b = host_backend(cache_capacity=3)
    handles = [b.acquire(G) for _ in range(5)]
    for h in handles:
        b.recycle(h, G)
    s = b.stats()
    assert s["cached_handles"] == 3 and s["cached_bytes"] == 3 * G
    assert s["num_releases"] == 2 and s["physical_bytes"] == 3 * G


def test_cache_capacity_zero_disables_the_cache():
    b = host_backend(cache_capacity=0)
    h = b.acquire(G)
    b.recycle(h, G)
    b.acquire(G)
    s = b.stats()
    assert (s["num_creates"], s["num_releases"], s["num_cache_hits"], s["cached_handles"]) == (2, 1, 0, 0)


def test_cache_only_serves_handles_of_the_requested_size():
    b = host_backend()
    h = b.acquire(2 * G)
    b.recycle(h, 2 * G)
    b.acquire(G)
    s = b.stats()
    assert s["num_cache_hits"] == 0 and s["num_creates"] == 2 and s["cached_bytes"] == 2 * G
    assert b.acquire(2 * G) == h
    assert b.stats()["num_cache_hits"] == 1


def test_physical_and_cached_bytes_accounting():
    b = host_backend(capacity_granules=16)
    hs = [b.acquire(G) for _ in range(4)]
    assert b.stats()["physical_bytes"] == 4 * G and b.free_physical_bytes() == 12 * G
    b.recycle(hs[0], G)
    b.recycle(hs[1], G)
    s = b.stats()
    assert s["physical_bytes"] == 4 * G and s["cached_bytes"] == 2 * G
    assert b.free_physical_bytes() == 12 * G                  # cached handles still hold memory
    b.release_cached()
    assert b.stats()["physical_bytes"] == 2 * G and b.free_physical_bytes() == 14 * G


@pytest.mark.parametrize("capacity", [-1, 257, 10**6])
def test_cache_capacity_out_of_bounds_raises_config_error(capacity):
    b = host_backend()
    with pytest.raises(KVCachedConfigError):
        b.set_handle_cache_capacity(capacity)
    assert b.cache_capacity == core.DEFAULT_HANDLE_CACHE_SIZE


# -- out of memory --------------------------------------------------------------------------------


def test_create_beyond_capacity_raises_out_of_device_memory_and_changes_nothing():
    b = host_backend(capacity_granules=4)
    hs = [b.create(G) for _ in range(4)]
    before = b.stats()
    with pytest.raises(OutOfDeviceMemory) as info:
        b.create(G)
    assert isinstance(info.value, MemoryError) and isinstance(info.value, DriverError)
    assert b.stats() == before
    assert b.acquire(G) is None                                 # acquire: a value, not an exception
    assert b.stats() == before
    b.release(hs[0], G)
    assert b.create(G)                                          # room again


def test_create_larger_than_capacity_raises():
    b = host_backend(capacity_granules=4)
    with pytest.raises(OutOfDeviceMemory):
        b.create(5 * G)
    assert b.stats()["physical_bytes"] == 0 and b.free_physical_bytes() == 4 * G


def test_fault_injection_counts_successful_acquisitions():
    b = host_backend()
    b.inject_out_of_memory(2)
    assert b.acquire(G) is not None and b.acquire(G) is not None
    assert b.acquire(G) is None and b.acquire(G) is None       # stays failing
    b.inject_out_of_memory(-1)
    assert b.acquire(G) is not None
    b.inject_out_of_memory(0)
    assert b.acquire(G) is None
    b.inject_out_of_memory(-1)


# -- bad input: the specific exception, nothing changed -----------------------------------------


def test_host_granularity_not_a_multiple_of_the_os_page_raises():
    for granularity in (0, OS_PAGE // 2, OS_PAGE + 512, 3 * OS_PAGE // 2):
        with pytest.raises(KVCachedConfigError):
            core.HostBackend(granularity=granularity, capacity_bytes=1 << 20)


def test_host_capacity_below_one_granule_raises():
    with pytest.raises(KVCachedConfigError):
        core.HostBackend(granularity=16 * OS_PAGE, capacity_bytes=8 * OS_PAGE)


def test_failed_host_backend_construction_closes_no_foreign_fd():
    # Regression: the fd field started at 0 and __dealloc__ closed stdin after a failed __init__.
    result = run_child(
        """
        import gc, os
        from kvcached import core
        r, w = os.pipe()
        os.dup2(r, 0)
        try:
            core.HostBackend(granularity=1000)
        except Exception as exc:
            print(type(exc).__name__)
        gc.collect()
        os.fstat(0)
        print("stdin-open")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["KVCachedConfigError", "stdin-open"]


@pytest.mark.parametrize("size", [0, 1, G // 2, G + 1, 3 * G // 2])
def test_sizes_not_a_multiple_of_the_granularity_raise_mapping_error(size):
    b = host_backend()
    r = b.reserve(2 * G)
    h = b.create(G)
    before = b.stats()
    for call in (
        lambda: b.reserve(size),
        lambda: b.create(size),
        lambda: b.acquire(size),
        lambda: b.map(r.address, size, h),
        lambda: b.release(h, size),
        lambda: b.recycle(h, size),
    ):
        with pytest.raises(MappingError):
            call()
    assert b.stats() == before


def test_misaligned_map_address_raises_mapping_error():
    b = host_backend()
    r = b.reserve(2 * G)
    h = b.create(G)
    before = b.stats()
    with pytest.raises(MappingError):
        b.map(r.address + 8, G, h)
    assert b.stats() == before
    # nothing was mapped: the page still faults
    result = run_child(
        """
        import ctypes
        from kvcached import core
        from kvcached.errors import MappingError
        b = core.HostBackend(granularity=4096, capacity_bytes=1 << 20)
        r = b.reserve(2 * 4096)
        h = b.create(4096)
        try:
            b.map(r.address + 8, 4096, h)
        except MappingError:
            print("ok", flush=True)
        ctypes.string_at(r.address + 8, 1)
        print("survived")
        """
    )
    assert_segfaults_after(result)


def test_release_of_handle_zero_raises_mapping_error():
    b = host_backend()
    before = b.stats()
    with pytest.raises(MappingError):
        b.release(0, G)
    with pytest.raises(MappingError):
        b.recycle(0, G)
    assert b.stats() == before


def test_mapping_error_is_a_value_error_and_config_error_a_runtime_error():
    assert issubclass(MappingError, ValueError)
    assert issubclass(KVCachedConfigError, RuntimeError)
    assert issubclass(OutOfDeviceMemory, MemoryError)


# -- the no-driver case -----------------------------------------------------------------------------


@pytest.mark.skipif(core.cuda_unavailable_reason() is None, reason="this machine has a usable CUDA driver")
def test_cuda_backend_without_a_driver_names_the_host_backend():
    reason = core.cuda_unavailable_reason()
    assert isinstance(reason, str) and reason
    with pytest.raises(DriverUnavailableError) as info:
        core.CudaBackend(0)
    assert "device='cpu'" in str(info.value)
    assert reason in str(info.value)
    assert core.cuda_device_count() == 0


def test_driver_probe_is_cached():
    first = core.cuda_unavailable_reason()
    start = time.perf_counter()
    answers = [core.cuda_unavailable_reason() for _ in range(200)]
    elapsed = time.perf_counter() - start
    # the same object every time: the probe ran once. (An uncached probe without libcuda costs
    # 0.1-0.5 ms a call, 20-100 ms for 200; the cached answer a fraction of a microsecond.)
    assert all(a is first for a in answers)
    assert elapsed < 0.02, f"200 cached probes took {elapsed * 1e3:.1f} ms"


def test_driver_probe_in_a_fresh_process_answers_the_same():
    result = run_child(
        """
        from kvcached import core
        a = core.cuda_unavailable_reason()
        b = core.cuda_unavailable_reason()
        print(repr(a is b), repr(a))
        """
    )
    assert result.returncode == 0, result.stderr
    same, reason = result.stdout.split(" ", 1)
    assert same == "True"
    assert reason.strip() == repr(core.cuda_unavailable_reason())


def test_fences_on_the_host_backend_are_immediately_done():
    b = host_backend()
    fence = b.record_fence(0)
    assert b.fence_done(fence)
    b.release_fence(fence)


def test_stats_keys():
    s = host_backend().stats()
    assert set(s) == {"kind", "granularity", "num_creates", "num_releases", "num_cache_hits",
                      "physical_bytes", "cached_bytes", "cached_handles"}
    assert s["kind"] == "host" and s["granularity"] == G


def test_pool_fd_is_a_sparse_memfd_spanning_more_than_the_capacity():
    b = host_backend(capacity_granules=8)
    st = os.fstat(b.pool_fd)
    assert st.st_size > 8 * G and st.st_size % G == 0 and st.st_blocks == 0


def test_unmerged_free_slots_do_not_exhaust_the_pool():
    # 16 single-granule slots released, then a two-granule slot: offsets past them are still free.
    b = host_backend(capacity_granules=16)
    for h in [b.create(G) for _ in range(16)]:
        b.release(h, G)
    h = b.create(2 * G)
    assert b.physical_bytes == 2 * G
    b.release(h, 2 * G)


def test_objects_that_own_memory_cannot_be_copied_or_pickled():
    # A copy of a range would be a second owner that frees the reservation when it dies.
    import copy
    import pickle

    b = host_backend()
    r = b.reserve(4 * b.granularity)
    table = core.PageTable(b, [(r, 0)], b.granularity, 4)
    for obj in (b, r, table, core.PageAllocator(table)):
        with pytest.raises(TypeError):
            copy.copy(obj)
        with pytest.raises(TypeError):
            pickle.dumps(obj)


def test_none_and_abstract_arguments_are_refused_without_a_crash():
    b = host_backend()
    r = b.reserve(b.granularity)
    with pytest.raises(TypeError, match="abstract"):
        core.Backend()
    with pytest.raises(TypeError):
        core.PageTable(None, [(r, 0)], b.granularity, 1)
    with pytest.raises(MappingError, match="not a VirtualRange"):
        core.PageTable(b, [(None, 0)], b.granularity, 1)
    with pytest.raises(TypeError):
        core.PageAllocator(None)
    with pytest.raises(TypeError):
        core.BlockAllocator.dense(None, 4096)


def test_integrated_memory_is_false_on_the_host_backend():
    assert host_backend().integrated_memory is False


@pytest.mark.gpu
@pytest.mark.skipif(core.cuda_unavailable_reason() is not None, reason="needs a CUDA device")
def test_integrated_memory_matches_the_device_attribute():
    """CudaBackend.integrated_memory is CU_DEVICE_ATTRIBUTE_INTEGRATED (the layout choice reads
    it): False on a discrete GPU such as the H200, True on a GB10 or Jetson."""
    import torch

    backend = core.CudaBackend(0)
    assert backend.integrated_memory is bool(torch.cuda.get_device_properties(0).is_integrated)
