"""kvcached.runtime: init / alloc_kv_cache / get_kv_cache_manager / shutdown on the host backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcached import KVCacheManager, alloc_kv_cache, init_kvcached, shutdown_kvcached
from kvcached import runtime as rt_mod
from kvcached.core import cuda_unavailable_reason
from kvcached.errors import KVCachedConfigError
from kvcached.runtime import get_kv_cache_manager

from _stacks import KV_PAGE_BYTES

LAYOUTS = ("per_layer", "interleaved", "page_grouped")


@pytest.fixture
def cpu(kv_env):
    def start(layout="interleaved", **env):
        kv_env(LAYOUT=layout, MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=2, **env)
        init_kvcached(device="cpu", page_size_bytes=KV_PAGE_BYTES)
        return rt_mod.runtime()
    return start


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cpu:0", "", 3, "cuda:-1", "tpu:0", "cuda:٣", "cuda:0x0"])
def test_init_bad_device(kv_env, device):
    kv_env()
    with pytest.raises(KVCachedConfigError, match="device="):
        init_kvcached(device=device, page_size_bytes=KV_PAGE_BYTES)
    assert rt_mod._runtime is None


@pytest.mark.skipif(cuda_unavailable_reason() is None, reason="CUDA is usable here")
def test_init_cuda_without_driver(kv_env):
    kv_env()
    for device in ("cuda", "cuda:0"):
        with pytest.raises(KVCachedConfigError, match="device='cpu'"):
            init_kvcached(device=device)
    init_kvcached(device=None, page_size_bytes=KV_PAGE_BYTES)      # None falls back to the host
    assert rt_mod.runtime().device == "cpu" and rt_mod.runtime().backend.kind == "host"


@pytest.mark.parametrize("page_size", [0, -4096, 1000, "x", 3 << 20, 64.0 * 1024, True, 1 << 50, (1 << 30) + 1])
def test_init_bad_page_size(kv_env, page_size):
    kv_env()
    with pytest.raises(KVCachedConfigError, match="page") as info:
        init_kvcached(device="cpu", page_size_bytes=page_size)
    assert rt_mod._runtime is None
    if page_size in (1 << 50, (1 << 30) + 1):           # refused up front, naming the bound
        assert f"page_size_bytes={page_size} must be an int in [1, {1 << 30}]" in str(info.value)


def test_init_page_larger_than_host_capacity(kv_env):
    kv_env()
    with pytest.raises(KVCachedConfigError, match="larger than the host backend's capacity"):
        init_kvcached(device="cpu", page_size_bytes=8 << 20, host_capacity_bytes=4 << 20)
    assert rt_mod._runtime is None


@pytest.mark.parametrize("page_size_mb, kwargs, match", [
    (3, {}, r"KVCACHED_PAGE_SIZE_MB=3: pages of 3145728 bytes are not a positive multiple of the host granularity "
            r"\(2097152 bytes\); set KVCACHED_PAGE_SIZE_MB to a multiple of 2"),
    (3, dict(page_size_bytes=3 << 20), r"page_size_bytes=3145728: .* granularity \(2097152 bytes\); pass a "
                                       r"multiple of 2097152"),
    (8, dict(host_capacity_bytes=4 << 20), r"KVCACHED_PAGE_SIZE_MB=8: pages of 8388608 bytes are larger than the "
                                           r"host backend's capacity of 4194304 bytes"),
])
def test_page_size_errors_name_the_variable_or_the_argument(kv_env, page_size_mb, kwargs, match):
    """The page size comes from KVCACHED_PAGE_SIZE_MB or page_size_bytes: an error names the one
    that gave it, and the fix for that one (it told an engine passing page_size_bytes to set the
    variable)."""
    kv_env(PAGE_SIZE_MB=page_size_mb)
    with pytest.raises(KVCachedConfigError, match=match):
        init_kvcached(device="cpu", **kwargs)
    assert rt_mod._runtime is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(host_capacity_bytes="x"), "host_capacity_bytes='x' must be"),
    (dict(host_capacity_bytes=0), "host_capacity_bytes=0"),
    (dict(host_capacity_bytes=1.5e9), "host_capacity_bytes=1500000000.0"),
    (dict(host_capacity_bytes=True), "host_capacity_bytes=True"),
    (dict(tp_rank=-1), "tp_rank=-1"),
    (dict(pp_rank=0.0), "pp_rank=0.0"),
    (dict(world_size=True), "world_size=True"),
    (dict(async_sched=True), "async_sched=True is not supported: allocation is synchronous"),
])
def test_init_bad_arguments(kv_env, kwargs, match):
    kv_env()
    with pytest.raises(KVCachedConfigError, match=match):
        init_kvcached(device="cpu", page_size_bytes=KV_PAGE_BYTES, **kwargs)
    assert rt_mod._runtime is None
    init_kvcached(device="cpu", page_size_bytes=KV_PAGE_BYTES, host_capacity_bytes=np.int64(1 << 24))


def test_init_world_size_and_bad_env(kv_env):
    kv_env()
    with pytest.raises(KVCachedConfigError, match="world_size=2 needs torch.distributed initialised"):
        init_kvcached(device="cpu", world_size=2)
    with pytest.raises(KVCachedConfigError, match=r"tp_rank=2 is outside \[0, 2\) for world_size=2"):
        init_kvcached(device="cpu", world_size=2, tp_rank=2)
    with pytest.raises(KVCachedConfigError, match="world_size=0"):
        init_kvcached(device="cpu", world_size=0)
    assert rt_mod._runtime is None
    with pytest.raises(KVCachedConfigError, match="KVCACHED_MIN_RESERVED_PAGES=5"):
        kv_env(MIN_RESERVED_PAGES=5, MAX_RESERVED_PAGES=1)          # reloads the settings
    kv_env(MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=1)


def test_init_world_size_must_match_torch_distributed(kv_env, tmp_path):
    """A world of one process: world_size=2 names the mismatch; tp_group must be gloo and match."""
    import torch.distributed as dist

    kv_env()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(KVCachedConfigError, match="do not match torch.distributed's rank 0 of 1"):
            init_kvcached(device="cpu", world_size=2)
        with pytest.raises(KVCachedConfigError, match="do not match tp_group's rank 0 of 1"):
            init_kvcached(device="cpu", world_size=2, tp_group=dist.group.WORLD)
        assert rt_mod._runtime is None
    finally:
        dist.destroy_process_group()


def test_init_twice(cpu):
    rt = cpu()
    init_kvcached(device="cpu", page_size_bytes=KV_PAGE_BYTES)     # same: no-op
    init_kvcached(device=" CPU ")                                   # no page size asked: no-op
    assert rt_mod.runtime() is rt
    with pytest.raises(KVCachedConfigError, match="already initialised"):
        init_kvcached(device="cpu", page_size_bytes=2 * KV_PAGE_BYTES)
    assert rt_mod.runtime() is rt and rt.page_bytes == KV_PAGE_BYTES


def test_shutdown_then_init_again(cpu):
    for round_ in range(3):
        rt = cpu()
        kv = alloc_kv_cache((2, 64, 16, 2, 32), 16, torch.float16, "cpu", 2)
        m = get_kv_cache_manager(64, 16, 128, 2)
        ids = m.alloc(64)
        kv[0][0, ids[0]].fill_(round_ + 1)
        assert float(kv[0][0, ids[0]].sum()) == (round_ + 1) * 16 * 2 * 32
        backend = rt.backend
        shutdown_kvcached()
        assert rt_mod._runtime is None
        assert backend.stats()["physical_bytes"] == 0
    shutdown_kvcached()                                                # idempotent


SHAPES = {
    # name: (kvcache_shape, attention_type, kv_layout, expected per-layer shape (dense layouts))
    "flash_attn": ((2, 100, 16, 4, 32), "MHA", "NHD"),
    "flash_attn_hnd": ((2, 100, 4, 16, 32), "GQA", "HND"),
    "flashinfer": ((100, 2, 16, 4, 32), "MHA", "NHD"),
    "flashinfer_hnd": ((100, 2, 4, 16, 32), "MQA", "HND"),
    "mla": ((100, 16, 64), "MLA", "NHD"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_alloc_kv_cache_shapes(cpu, layout, name):
    rt = cpu(layout)
    shape, attention_type, kv_layout = SHAPES[name]
    kv = alloc_kv_cache(shape, 16, torch.bfloat16, "cpu", 3, attention_type=attention_type, kv_layout=kv_layout)
    assert len(kv) == 3
    group = rt.groups[0]
    block_dim = 1 if name.startswith("flash_attn") else 0
    for t in kv:
        assert t.dtype == torch.bfloat16 and t.device.type == "cpu"
        if layout == "page_grouped":
            expected = list(shape)
            expected[block_dim] = group.layout.max_block_id
            assert tuple(t.shape) == tuple(expected)
        else:
            assert tuple(t.shape) == shape
        # zero-copy: the tensor's first and last element lie inside one of the group's ranges
        lo = t.data_ptr()
        hi = lo + max((s - 1) * st for s, st in zip(t.shape, t.stride())) * t.element_size()
        assert any(r.address <= lo and hi < r.address + r.size_bytes for r in group.ranges)
    cell_size = (shape[-1] if name == "mla" else shape[-2] * shape[-1] * shape[-3] // 16) * 2
    assert 16 * cell_size == group.layout.block_bytes
    m = get_kv_cache_manager(100, 16, cell_size, 3, num_kv_buffers=1 if name == "mla" else 2)
    assert m.alloc(m.available_size()) is not None


def test_alloc_kv_cache_mla_cell_size(cpu):
    cpu()
    kv = alloc_kv_cache((50, 16, 512), 16, torch.float16, "cpu", 2, attention_type="MLA")
    assert tuple(kv[0].shape) == (50, 16, 512)
    m = KVCacheManager(50, 16, 512 * 2, 2, num_kv_buffers=1)
    ids = m.alloc(50)
    for b in ids:
        kv[1][b].fill_(b)
    assert all(float(kv[1][b, 3, 7]) == b for b in ids)


@pytest.mark.parametrize("kwargs, match", [
    (dict(kvcache_shape=(2, 100, 16, 2)), "not understood"),
    (dict(kvcache_shape=(3, 100, 16, 2, 32)), "K/V dimension"),
    (dict(kvcache_shape=(2, 100, 8, 2, 32)), "block_size=16"),
    (dict(kvcache_shape=(2, 0, 16, 2, 32)), r"kvcache_shape\[1\]=0 must be a positive int"),
    (dict(kvcache_shape=(2, 100, 16, 0, 32)), r"kvcache_shape\[3\]=0"),
    (dict(kvcache_shape=(2, 100, 16, -2, 32)), r"kvcache_shape\[3\]=-2"),
    (dict(kvcache_shape=(2, 100, 16, 2, 32.5)), r"kvcache_shape\[4\]=32.5 must be a positive int"),
    (dict(kvcache_shape=(2, 100, 16, 2, 32.0)), r"kvcache_shape\[4\]=32.0"),
    (dict(kvcache_shape=(2, 100, 16, True, 32)), r"kvcache_shape\[3\]=True"),
    (dict(kvcache_shape=(2, torch.tensor(100.0), 16, 2, 32)), r"kvcache_shape\[1\]=tensor\(100.\)"),
    (dict(kvcache_shape=None), "kvcache_shape=None must be a sequence"),
    (dict(kvcache_shape=(2, 10**13, 16, 2, 32)), r"num_blocks=10000000000000 .* TiB.*ask for at most"),
    (dict(block_size=16.0), "block_size=16.0 must be a positive int"),
    (dict(block_size=True), "block_size=True"),
    (dict(num_layers=True), "num_layers=True"),
    (dict(num_layers=2.0), "num_layers=2.0"),
    (dict(group_id=True), "group_id=True"),
    (dict(kvcache_shape=(2, 100, 16, 64, 128), dtype=torch.float32), "larger than a page"),
    (dict(dtype="float16"), "torch.dtype"),
    (dict(dtype=np.float16), "torch.dtype"),
    (dict(attention_type="XYZ"), "attention_type='XYZ'"),
    (dict(kv_layout="HDN"), "kv_layout='HDN'"),
    (dict(kvcache_shape=(100, 16, 64), attention_type="MLA", kv_layout="HND"), "HND"),
    (dict(kvcache_shape=(100, 8, 64), attention_type="MLA"), "MLA kvcache_shape"),
    (dict(kvcache_shape=(2, 100, 16, 2, 32), attention_type="MLA"), "MLA kvcache_shape"),
    (dict(num_layers=0), "num_layers=0"),
    (dict(num_layers=-1), "num_layers=-1"),
    (dict(group_id=-1), "group_id=-1"),
    (dict(group_id="a"), "group_id='a'"),
    (dict(device="gpu"), "device='gpu'"),
])
def test_alloc_kv_cache_refuses(cpu, kwargs, match):
    rt = cpu()
    args = dict(kvcache_shape=(2, 100, 16, 2, 32), block_size=16, dtype=torch.float16, device="cpu", num_layers=2)
    args.update(kwargs)
    with pytest.raises(KVCachedConfigError, match=match):
        alloc_kv_cache(**args)
    assert rt.groups == {}, "a refused call left a group behind"
    kv = alloc_kv_cache((2, 100, 16, 2, 32), 16, torch.float16, "cpu", 2)     # the group id is still free
    assert len(kv) == 2


@pytest.mark.skipif(cuda_unavailable_reason() is None, reason="CUDA is usable here")
def test_alloc_kv_cache_other_device(cpu):
    cpu()
    with pytest.raises(KVCachedConfigError, match="device="):
        alloc_kv_cache((2, 100, 16, 2, 32), 16, torch.float16, "cuda", 2)


def test_group_reuse_and_geometry(cpu):
    rt = cpu()
    alloc_kv_cache((2, 100, 16, 2, 32), 16, torch.float16, "cpu", 2)
    with pytest.raises(KVCachedConfigError, match="already has KV tensors"):
        alloc_kv_cache((2, 100, 16, 2, 32), 16, torch.float16, "cpu", 2)
    with pytest.raises(KVCachedConfigError, match="already has KV tensors"):
        alloc_kv_cache((2, 50, 16, 4, 32), 16, torch.float16, "cpu", 4)
    kv1 = alloc_kv_cache((2, 30, 16, 4, 32), 16, torch.float16, "cpu", 3, group_id=1)
    assert tuple(kv1[0].shape) == (2, 30, 16, 4, 32) and len(kv1) == 3
    for kwargs, match in [(dict(cell_size=64), "block_bytes"), (dict(block_size=8), "block_bytes"),
                          (dict(num_layers=3), "num_layers"), (dict(num_kv_buffers=1), "num_kv_buffers"),
                          (dict(num_blocks=500), "num_blocks=500")]:
        args = dict(num_blocks=100, block_size=16, cell_size=128, num_layers=2)
        args.update(kwargs)
        with pytest.raises(KVCachedConfigError, match=match):
            KVCacheManager(**args)
        with pytest.raises(KVCachedConfigError, match=match):
            get_kv_cache_manager(**args)
    assert rt.groups[0].managers == []
    m0 = get_kv_cache_manager(100, 16, 128, 2)
    m1 = get_kv_cache_manager(30, 16, 256, 3, group_id=1)
    assert get_kv_cache_manager(100, 16, 128, 2) is m0
    assert get_kv_cache_manager(30, 16, 256, 3, group_id=1) is m1 and m1 is not m0
    assert sorted(id(m) for m in rt_mod.managers()) == sorted([id(m0), id(m1)])
    with pytest.raises(KVCachedConfigError, match="already has a manager"):
        get_kv_cache_manager(100, 16, 128, 2, pool_name="other")
    a, b = m0.alloc(100), m1.alloc(30)
    assert a is not None and b is not None


def test_manager_before_tensors(cpu):
    """A manager may come first (kv_group makes the group); alloc_kv_cache then gives the same
    group its tensors, and blocks handed out before are rows of them."""
    rt = cpu()
    m = get_kv_cache_manager(100, 16, 128, 2)
    ids = m.alloc(10)
    kv = alloc_kv_cache((2, 100, 16, 2, 32), 16, torch.float16, "cpu", 2)
    assert rt.groups[0].managers == [m]
    for b in ids:
        kv[1][0, b].fill_(b)
    assert [float(kv[1][0, b, 15, 1, 31]) for b in ids] == [float(b) for b in ids]
    with pytest.raises(KVCachedConfigError, match="already has KV tensors"):
        alloc_kv_cache((2, 100, 16, 2, 32), 16, torch.float16, "cpu", 2)
    get_kv_cache_manager(10, 16, 128, 3, group_id=4)
    with pytest.raises(KVCachedConfigError, match="num_layers"):
        alloc_kv_cache((2, 10, 16, 2, 32), 16, torch.float16, "cpu", 2, group_id=4)
    assert rt.groups[4].tensors is None


def test_group_repr_reads_no_tensor(cpu):
    """repr of a group (logs, debuggers, pytest) must not print its tensors: most rows are unmapped."""
    rt = cpu()
    alloc_kv_cache((2, 100, 16, 2, 32), 16, torch.float16, "cpu", 2)
    assert "tensors" not in repr(rt.groups[0])


def test_tensors_track_mappings(cpu):
    """Blocks handed out are readable and writable through the views; their pages are the
    group's mapped pages."""
    rt = cpu("per_layer")
    kv = alloc_kv_cache((2, 64, 16, 2, 32), 16, torch.float16, "cpu", 2)
    m = get_kv_cache_manager(64, 16, 128, 2)
    ids = m.alloc(40)
    table = rt.groups[0].page_table
    assert sorted(table.mapped_page_ids()) == sorted({m._group.layout.page_of(b) for b in ids})
    for b in ids:
        kv[0][0, b].fill_(1)
        kv[1][1, b].fill_(-1)
    assert all(float(kv[0][0, b].sum()) == 16 * 64 for b in ids)


def test_get_kv_cache_manager_validates_first(cpu):
    """A bool is no count: get_kv_cache_manager(True, ...) must not hand back the manager made
    with num_blocks=1 (True == 1 in a tuple comparison)."""
    cpu()
    alloc_kv_cache((2, 100, 16, 2, 32), 16, torch.float16, "cpu", 2)
    m = get_kv_cache_manager(1, 16, 128, 2)
    assert get_kv_cache_manager(np.int64(1), np.int32(16), 128, 2) is m
    for args, match in [((True, 16, 128, 2), "num_blocks=True"), ((1, 16.0, 128, 2), "block_size=16.0"),
                        ((1, 16, 128, 2, True), "num_kv_buffers=True")]:
        with pytest.raises(KVCachedConfigError, match=match):
            get_kv_cache_manager(*args)
    with pytest.raises(KVCachedConfigError, match="group_id=True"):
        get_kv_cache_manager(1, 16, 128, 2, group_id=True)
