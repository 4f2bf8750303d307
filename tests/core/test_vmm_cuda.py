"""The backend, page-table and DLPack semantics of the host tests, on CudaBackend (marker `gpu`).

Skipped unless kvcached.core.cuda_unavailable_reason() is None and torch sees the device. Data is
written and read with torch on the device through the DLPack export, or with cuMemsetD8
(CudaBackend.memset). Anything that would corrupt this process's CUDA context (a write to the
read-only zero page) runs in a child process.
"""

from __future__ import annotations

import random

import pytest

from kvcached import core
from kvcached.errors import DriverError, KVCachedConfigError, MappingError, OutOfDeviceMemory

from _backends import live_state, run_child

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(core.cuda_unavailable_reason() is not None,
                       reason="CUDA is not usable here (kvcached.core.cuda_unavailable_reason())"),
]

torch = pytest.importorskip("torch")
MiB = 1 << 20


@pytest.fixture(scope="module")
def backend():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    torch.cuda.init()
    b = core.CudaBackend(0)
    yield b
    torch.cuda.synchronize()
    b.release_cached()


@pytest.fixture()
def b(backend):
    """The module's backend, checked to hold no live handle after each test (nothing leaked)."""
    backend.set_handle_cache_capacity(core.DEFAULT_HANDLE_CACHE_SIZE)
    backend.inject_out_of_memory(-1)
    backend.release_cached()
    live = backend.stats()["num_creates"] - backend.stats()["num_releases"]
    yield backend
    torch.cuda.synchronize()
    backend.inject_out_of_memory(-1)
    backend.release_cached()
    stats = backend.stats()
    assert stats["num_creates"] - stats["num_releases"] == live, stats
    assert stats["physical_bytes"] == 0 and stats["cached_bytes"] == 0, stats


def all_equal(t, value) -> bool:
    return bool((t == value).all().item())


def test_granularity_and_kind(b):
    assert b.kind == "cuda" and b.device_id == 0
    assert b.granularity > 0 and b.granularity % (64 * 1024) == 0


def test_unknown_device_raises_config_error():
    with pytest.raises(KVCachedConfigError):
        core.CudaBackend(core.cuda_device_count())


def test_alias_two_mappings_of_one_handle(b):
    g = b.granularity
    r1, r2 = b.reserve(2 * g), b.reserve(4 * g)
    h = b.create(g)
    b.map(r1.address, g, h)
    b.map(r2.address + 3 * g, g, h)
    t1, t2 = r1.tensor(), r2.tensor()
    t1[:g].fill_(0x5A)
    torch.cuda.synchronize()
    assert all_equal(t2[3 * g:4 * g], 0x5A)
    b.memset(r2.address + 3 * g + 4096, 0xC3, 4096)
    assert all_equal(t1[4096:8192], 0xC3)
    torch.cuda.synchronize()
    b.unmap(r1.address, g)
    assert all_equal(t2[3 * g:3 * g + 4096], 0x5A)       # the other mapping is untouched
    torch.cuda.synchronize()
    b.unmap(r2.address + 3 * g, g)
    b.release(h, g)


def test_dlpack_exports_a_cuda_tensor_of_the_range(b):
    g = b.granularity
    r = b.reserve(8 * g)
    pt = core.PageTable(b, [(r, 0)], g, 8)
    assert pt.map([2, 5])
    t = r.tensor()
    assert t.device == torch.device("cuda", 0) and t.dtype == torch.uint8
    assert t.data_ptr() == r.address and t.numel() == 8 * g
    t[2 * g:3 * g] = 7
    t[5 * g:5 * g + 2].copy_(torch.tensor([1, 2], dtype=torch.uint8))
    assert t[5 * g:5 * g + 2].cpu().tolist() == [1, 2] and all_equal(t[2 * g:3 * g], 7)
    v = t[2 * g:3 * g].view(torch.float16)
    assert v.data_ptr() == r.address + 2 * g
    torch.cuda.synchronize()
    pt.close()


def test_range_outlives_its_object_while_a_cuda_tensor_lives(b):
    g = b.granularity
    r = b.reserve(2 * g)
    pt = core.PageTable(b, [(r, 0)], g, 2)
    assert pt.map([0])
    t = r.tensor()
    del r
    t[:g] = 9
    assert all_equal(t[:g], 9)
    torch.cuda.synchronize()
    pt.close()
    del pt, t


def test_unmap_then_map_again_skips_cuMemCreate(b):
    g = b.granularity
    r = b.reserve(4 * g)
    pt = core.PageTable(b, [(r, 0), (r, 2 * g)], g, 2)
    assert pt.map([0])
    s0 = b.stats()
    pt.unmap([0])
    assert pt.map([0])
    s1 = b.stats()
    assert s1["num_creates"] == s0["num_creates"]
    assert s1["num_cache_hits"] == s0["num_cache_hits"] + 2
    pt.close()


def test_cache_capacity_zero_creates_every_time(b):
    g = b.granularity
    b.set_handle_cache_capacity(0)
    r = b.reserve(g)
    pt = core.PageTable(b, [(r, 0)], g, 1)
    assert pt.map([0])
    pt.unmap([0])
    s0 = b.stats()
    assert pt.map([0])
    assert b.stats()["num_creates"] == s0["num_creates"] + 1 and b.stats()["num_cache_hits"] == s0["num_cache_hits"]
    pt.close()


def test_absurd_create_raises_out_of_device_memory_and_the_process_survives(b):
    g = b.granularity
    total = torch.cuda.get_device_properties(0).total_memory
    absurd = -(-4 * total // g) * g
    before = b.stats()
    with pytest.raises(OutOfDeviceMemory) as info:
        b.create(absurd)
    assert isinstance(info.value, MemoryError)
    assert info.value.call == "cuMemCreate" and info.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert b.acquire(absurd) is None
    assert b.stats() == before
    h = b.create(g)                                       # the context is fine
    b.release(h, g)
    x = torch.ones(1024, device="cuda")
    assert x.sum().item() == 1024


def test_page_table_map_returns_false_when_the_device_is_full(b):
    # A real out of memory: 8 GiB mappings until the device says no.
    big = 8 << 30
    num_pages = 40                                       # 320 GiB virtual: more than any H200
    r = b.reserve(big * num_pages)
    pt = core.PageTable(b, [(r, 0)], big, num_pages)
    mapped = 0
    try:
        while mapped < num_pages and pt.map([mapped]):
            mapped += 1
        assert 0 < mapped < num_pages, mapped
        before = live_state(b, pt)
        assert pt.map([mapped]) is False
        assert live_state(b, pt) == before
        b.release_cached()
    finally:
        pt.close()
        b.release_cached()
    free_after = b.free_physical_bytes()
    assert free_after >= mapped * big - big              # the memory came back


def test_fault_injection_at_every_acquisition(b):
    g = b.granularity
    r = b.reserve(12 * g)
    pt = core.PageTable(b, [(r, 0), (r, 4 * g), (r, 8 * g)], g, 4)
    assert pt.map([3])
    t = r.tensor()
    t[3 * g:4 * g] = 0x11
    torch.cuda.synchronize()
    ids = [0, 1]
    for after in range(len(ids) * 3):
        before = live_state(b, pt)
        b.inject_out_of_memory(after)
        assert pt.map(ids) is False
        assert live_state(b, pt) == before
    b.inject_out_of_memory(-1)
    assert pt.map(ids)
    assert all_equal(t[3 * g:4 * g], 0x11)
    pt.check_invariants()
    torch.cuda.synchronize()
    pt.close()


def test_driver_error_names_the_call_and_the_cuda_error(b):
    # Mapping over an address that is already mapped is refused by the driver. (cuMemUnmap of a
    # reserved but never-mapped address is *not* an error on driver 580: it returns success.)
    g = b.granularity
    r = b.reserve(2 * g)
    h1, h2 = b.create(g), b.create(g)
    b.map(r.address, g, h1)
    with pytest.raises(DriverError) as info:
        b.map(r.address, g, h2)
    err = info.value
    assert not isinstance(err, OutOfDeviceMemory)
    assert err.call == "cuMemMap" and err.name.startswith("CUDA_ERROR_") and err.code != 0
    assert "cuMemMap" in str(err) and err.name in str(err)
    t = r.tensor()                                       # the first mapping and the context are fine
    t[:4096] = 1
    assert all_equal(t[:4096], 1)
    torch.cuda.synchronize()
    b.unmap(r.address, g)
    b.map(r.address, g, h2)                              # the refused handle maps fine elsewhere
    b.unmap(r.address, g)
    b.release(h1, g)
    b.release(h2, g)


def test_bad_input_raises_before_the_driver(b):
    g = b.granularity
    r = b.reserve(2 * g)
    before = b.stats()
    with pytest.raises(MappingError):
        b.reserve(g + 4096)
    with pytest.raises(MappingError):
        b.create(g // 2)
    with pytest.raises(MappingError):
        core.PageTable(b, [(r, 0)], g, 3)
    with pytest.raises(MappingError):
        core.PageTable(b, [(r, 0), (r, 0)], g, 1)
    assert b.stats() == before


def test_zero_page_reads_zeros_real_data_after_map_and_zeros_after_unmap(b):
    g = b.granularity
    # a cached handle with old data first: the zero page must still read zeros
    r0 = b.reserve(g)
    h = b.acquire(g)
    b.map(r0.address, g, h)
    b.memset(r0.address, 0x77, g)
    b.unmap(r0.address, g)
    b.recycle(h, g)
    r = b.reserve(8 * g)
    pt = core.PageTable(b, [(r, 0), (r, 4 * g)], g, 4, zero_page=True)
    t = r.tensor()
    assert all_equal(t, 0)
    assert pt.map([1])
    a0, a1 = pt.segment_addresses(1)
    t[a0 - r.address:a0 - r.address + g] = 3
    t[a1 - r.address:a1 - r.address + g] = 4
    assert all_equal(t[a0 - r.address:a0 - r.address + g], 3)
    assert all_equal(t[a1 - r.address:a1 - r.address + g], 4)
    assert all_equal(t[:a0 - r.address], 0)              # the zero page was not written
    torch.cuda.synchronize()
    pt.unmap([1])
    assert all_equal(t, 0)
    torch.cuda.synchronize()
    pt.close()


def test_zero_page_write_fails_in_a_child_and_this_process_is_unharmed(b):
    result = run_child(
        """
        import torch
        from kvcached import core
        torch.cuda.init()
        b = core.CudaBackend(0)
        g = b.granularity
        r = b.reserve(2 * g)
        pt = core.PageTable(b, [(r, 0)], g, 2, zero_page=True)
        t = r.tensor()
        assert int(t[:g].sum().item()) == 0
        print("ok", flush=True)
        try:
            t[:4096].fill_(1)
            torch.cuda.synchronize()
            print("survived", int(t[:4096].sum().item()), flush=True)
        except RuntimeError as exc:
            print("faulted", str(exc).splitlines()[0], flush=True)
        """,
        timeout=300,
    )
    detail = f"rc={result.returncode}\nstdout={result.stdout!r}\nstderr={result.stderr[-2000:]}"
    assert "ok" in result.stdout.split(), detail
    assert "survived" not in result.stdout, detail
    assert "faulted" in result.stdout or result.returncode != 0, detail
    x = torch.arange(10, device="cuda")                  # this process's context is fine
    assert x.sum().item() == 45
    g = b.granularity
    h = b.create(g)
    b.release(h, g)


def test_memory_is_given_back_after_close_and_release_cached(b):
    page = 64 * MiB
    r = b.reserve(16 * page)
    torch.cuda.synchronize()
    free0 = b.free_physical_bytes()
    pt = core.PageTable(b, [(r, 0)], page, 16)
    assert pt.map(range(16))
    free1 = b.free_physical_bytes()
    assert free0 - free1 >= 16 * page - page
    pt.close()
    assert b.stats()["cached_bytes"] == 8 * page         # the default cache keeps 8
    b.release_cached()
    free2 = b.free_physical_bytes()
    assert abs(free2 - free0) <= page, (free0, free2)


def test_fences_complete_after_the_stream_finishes(b):
    stream = torch.cuda.current_stream()
    x = torch.randn(2048, 2048, device="cuda")
    y = x @ x
    fence = b.record_fence(stream.cuda_stream)
    torch.cuda.synchronize()
    assert b.fence_done(fence)
    b.release_fence(fence)
    del y


def test_random_map_unmap_matches_a_model(b):
    g = b.granularity
    rng = random.Random(1234)
    num_pages, num_segments = 6, 3
    b.set_handle_cache_capacity(3)
    r1, r2 = b.reserve(2 * num_pages * g), b.reserve(num_pages * g)
    segments = [(r1, 0), (r2, 0), (r1, num_pages * g)]
    pt = core.PageTable(b, segments, g, num_pages, zero_page=True)
    tensors = {id(r1): r1.tensor(), id(r2): r2.tensor()}
    model: dict[int, list[int]] = {}

    def view(p, s):
        r, offset = segments[s]
        start = offset + p * g
        return tensors[id(r)][start:start + g]

    for step in range(150):
        ids = rng.sample(range(num_pages), rng.randint(1, 3))
        if rng.random() < 0.5:
            ids = [p for p in ids if p not in model]
            if ids:
                assert pt.map(ids)
                for p in ids:
                    model[p] = [(step * 3 + p * 5 + s) % 250 + 1 for s in range(num_segments)]
                    for s in range(num_segments):
                        view(p, s).fill_(model[p][s])
        else:
            ids = [p for p in ids if p in model]
            if ids:
                torch.cuda.synchronize()
                pt.unmap(ids)
                for p in ids:
                    del model[p]
        pt.check_invariants()
        assert pt.mapped_page_ids() == sorted(model)
        if step % 10 == 0 or step == 149:
            for p in range(num_pages):
                for s in range(num_segments):
                    assert all_equal(view(p, s), model[p][s] if p in model else 0), (step, p, s)
    torch.cuda.synchronize()
    pt.close()
    del tensors
