"""VirtualRange's zero-copy export to torch through DLPack, on the host backend (core/vmm.pyx)."""

from __future__ import annotations

import gc
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.utils.dlpack  # noqa: E402

from kvcached import core  # noqa: E402
from kvcached.errors import MappingError  # noqa: E402

from _backends import OS_PAGE, assert_segfaults_after, fill, host_backend, proc_maps_has, read, run_child  # noqa: E402

G = OS_PAGE


def test_tensor_is_the_range_itself():
    b = host_backend()
    r = b.reserve(16 * G)
    t = r.tensor()
    assert t.data_ptr() == r.address
    assert t.dtype == torch.uint8 and t.dim() == 1 and t.numel() == 16 * G
    assert t.device.type == "cpu" and t.is_contiguous()


def test_writes_through_the_tensor_land_in_the_mapped_pages_and_back():
    b = host_backend()
    r = b.reserve(4 * G)
    pt = core.PageTable(b, [(r, 0)], G, 4)
    assert pt.map([1, 3])
    t = r.tensor()
    t[G:2 * G] = 0x21
    t[3 * G + 5] = 0x99
    assert read(r.address + G, G) == b"\x21" * G
    assert read(r.address + 3 * G + 5, 1) == b"\x99"
    fill(r.address + 3 * G, 0x42, 4)
    assert t[3 * G:3 * G + 4].tolist() == [0x42] * 4
    # typed, strided views share the memory: layout.py builds its views this way
    v = t[G:2 * G].view(torch.int32)
    assert v.data_ptr() == r.address + G and int(v[0]) == 0x21212121


def test_two_tensors_of_one_range_alias():
    b = host_backend()
    r = b.reserve(2 * G)
    h = b.create(G)
    b.map(r.address, G, h)
    a, c = r.tensor(), torch.from_dlpack(r.dlpack())
    a[:8] = 3
    assert c[:8].tolist() == [3] * 8


def test_huge_reservation_exports_without_touching_memory():
    b = host_backend()
    r = b.reserve(1 << 40)
    t = r.tensor()
    assert t.numel() == 1 << 40 and t.data_ptr() == r.address
    assert b.stats()["physical_bytes"] == 0


def test_range_stays_reserved_while_a_tensor_lives_and_goes_with_it():
    b = host_backend()
    size = 1 << 30
    r = b.reserve(size)
    h = b.create(G)
    b.map(r.address + G, G, h)
    address = r.address
    t = r.tensor()
    del r
    gc.collect()
    # the reservation survives its VirtualRange object: the tensor holds it
    assert all(proc_maps_has(a) for a in (address, address + size // 2, address + size - 1))
    t[G:G + 16] = 0x5C
    assert read(address + G, 16) == b"\x5c" * 16
    fill(address + G + 16, 0x6D, 16)
    assert t[G + 16:G + 32].tolist() == [0x6D] * 16
    del t
    gc.collect()
    # the reservation is gone (a small mapping made since could land at the top of the hole,
    # never across the start and middle of 1 GiB)
    assert not proc_maps_has(address) and not proc_maps_has(address + size // 2)


def test_tensor_over_a_dropped_range_still_faults_on_unmapped_pages():
    result = run_child(
        """
        import ctypes, gc
        from kvcached import core
        g = 4096
        b = core.HostBackend(granularity=g, capacity_bytes=1 << 20)
        r = b.reserve(4 * g)
        h = b.create(g)
        b.map(r.address, g, h)
        t = r.tensor()
        del r
        gc.collect()
        t[:g] = 1
        print("ok", flush=True)
        t[2 * g] = 1
        print("survived")
        """
    )
    assert_segfaults_after(result)


def test_capsule_can_be_consumed_only_once():
    b = host_backend()
    r = b.reserve(G)
    capsule = r.dlpack()
    t = torch.utils.dlpack.from_dlpack(capsule)
    with pytest.raises(RuntimeError):
        torch.utils.dlpack.from_dlpack(capsule)
    assert t.data_ptr() == r.address


def test_unconsumed_capsule_does_not_leak_the_range():
    b = host_backend()
    r = b.reserve(G)
    base = sys.getrefcount(r)
    capsules = [r.dlpack() for _ in range(5)]
    assert sys.getrefcount(r) == base + 5
    del capsules
    gc.collect()
    assert sys.getrefcount(r) == base


def test_consumed_capsule_gives_the_range_back_when_the_tensor_dies():
    b = host_backend()
    r = b.reserve(G)
    base = sys.getrefcount(r)
    t = r.tensor()
    views = [t[:8], t.view(torch.int8)]
    assert sys.getrefcount(r) == base + 1
    del t
    gc.collect()
    assert sys.getrefcount(r) == base + 1          # views keep the storage, hence the range
    del views
    gc.collect()
    assert sys.getrefcount(r) == base


def test_unconsumed_capsule_keeps_the_reservation_until_dropped():
    b = host_backend()
    size = 1 << 30
    r = b.reserve(size)
    address = r.address
    capsule = r.dlpack()
    del r
    gc.collect()
    assert proc_maps_has(address + size // 2)
    del capsule
    gc.collect()
    assert not proc_maps_has(address) and not proc_maps_has(address + size // 2)


def test_freed_range_refuses_to_export():
    b = host_backend()
    r = b.reserve(G)
    r.free()
    r.free()                                       # idempotent
    with pytest.raises(MappingError):
        r.dlpack()
    with pytest.raises(MappingError):
        r.tensor()


def test_virtual_range_is_made_by_reserve_only():
    with pytest.raises(TypeError):
        core.VirtualRange()


def test_check_offset_validates_alignment_and_bounds():
    b = host_backend()
    r = b.reserve(4 * G)
    r.check_offset(0, 4 * G)
    r.check_offset(3 * G, G)
    for offset, size in [(G, 4 * G), (4 * G, G), (G // 2, G), (0, G // 2), (-G, G), (0, 0),
                         (2**64 - G, 2 * G), (G, 2**64 - G), (0.0, G)]:
        with pytest.raises(MappingError):
            r.check_offset(offset, size)
