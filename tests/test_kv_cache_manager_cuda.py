"""KVCacheManager and the runtime on the CUDA backend (marker `gpu`): the section-7 contract,
data integrity through the views, and unmaps ordered after the GPU work that used the pages.

Skipped unless kvcached.core.cuda_unavailable_reason() is None and torch sees a device. Default
2 MiB pages, a modest number of blocks; patterns are written and read with torch on the device.
"""

from __future__ import annotations

import random
import time

import pytest

from kvcached import core

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(core.cuda_unavailable_reason() is not None,
                       reason="CUDA is not usable here (kvcached.core.cuda_unavailable_reason())"),
]

torch = pytest.importorskip("torch")

from kvcached import KVCacheManager, alloc_kv_cache, init_kvcached  # noqa: E402
from kvcached.errors import BlockStateError  # noqa: E402

from _procs import wait_until  # noqa: E402
from _stacks import POOL_EXITS, take_out_of_the_pool  # noqa: E402

LAYOUTS = ("per_layer", "interleaved", "page_grouped")
SHAPE_KINDS = ("flash_attn", "flashinfer", "mla")
NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, MLA_DIM = 4, 1024, 16, 8, 128, 512
DTYPE = torch.int32


@pytest.fixture
def cuda(kv_env):
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    torch.cuda.init()

    def start(layout="interleaved", shape_kind="flash_attn", min_reserved=0, max_reserved=2, **env):
        kv_env(LAYOUT=layout, MIN_RESERVED_PAGES=min_reserved, MAX_RESERVED_PAGES=max_reserved, **env)
        init_kvcached(device="cuda")
        if shape_kind == "mla":
            kv = alloc_kv_cache((NUM_BLOCKS, BLOCK_SIZE, MLA_DIM), BLOCK_SIZE, DTYPE, "cuda", NUM_LAYERS,
                                attention_type="MLA")
            m = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, MLA_DIM * DTYPE.itemsize, NUM_LAYERS, num_kv_buffers=1)
            return m, kv, 1
        blk = (BLOCK_SIZE, HEADS, HEAD_DIM)
        shape = (2, NUM_BLOCKS, *blk) if shape_kind == "flash_attn" else (NUM_BLOCKS, 2, *blk)
        kv = alloc_kv_cache(shape, BLOCK_SIZE, DTYPE, "cuda", NUM_LAYERS)
        m = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, HEADS * HEAD_DIM * DTYPE.itemsize, NUM_LAYERS)
        return m, kv, 2

    yield start
    torch.cuda.synchronize()


def rows(kv, shape_kind, layer, buffer, ids):
    idx = torch.tensor(ids, dtype=torch.long, device=kv[layer].device)
    t = kv[layer]
    if shape_kind == "flash_attn":
        return t[buffer].index_select(0, idx)
    if shape_kind == "flashinfer":
        return t.index_select(0, idx)[:, buffer]
    return t.index_select(0, idx)


def write(kv, shape_kind, layer, buffer, ids):
    idx = torch.tensor(ids, dtype=torch.long, device=kv[layer].device)
    values = (idx * NUM_LAYERS + layer) * 2 + buffer + 1
    t = kv[layer]
    if shape_kind == "flash_attn":
        target, dim = t[buffer], 0
    elif shape_kind == "flashinfer":
        target, dim = t.select(1, buffer), 0
    else:
        target, dim = t, 0
    shape = (len(ids),) + (1,) * (target.dim() - 1)
    target.index_copy_(dim, idx, values.to(DTYPE).view(shape).expand((len(ids),) + tuple(target.shape[1:])))


def check(kv, shape_kind, buffers, live):
    if not live:
        return
    torch.cuda.synchronize()
    idx = torch.tensor(live, dtype=torch.long, device=kv[0].device)
    for layer in range(NUM_LAYERS):
        for buffer in range(buffers):
            got = rows(kv, shape_kind, layer, buffer, live).reshape(len(live), -1)
            want = ((idx * NUM_LAYERS + layer) * 2 + buffer + 1).to(DTYPE)[:, None]
            assert bool((got == want).all()), f"layer {layer} buffer {buffer}: a live block changed"
    spans = []
    for layer in range(NUM_LAYERS):
        for buffer in range(buffers):
            for b in live:
                t = kv[layer]
                v = t[buffer, b] if shape_kind == "flash_attn" else (t[b, buffer] if shape_kind == "flashinfer"
                                                                     else t[b])
                spans.append((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()))
    spans.sort()
    assert all(e0 <= s1 for (_, e0), (s1, _) in zip(spans, spans[1:])), "two live blocks share memory"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_contract(cuda, layout):
    m, kv, _ = cuda(layout)
    assert m._group.page_table.backend.kind == "cuda"
    a = m.available_size()
    assert a == NUM_BLOCKS
    assert m.alloc(a + 1) is None
    ids = m.alloc(a)
    assert len(set(ids)) == a and m.alloc(1) is None
    assert all(0 <= b < kv[0].shape[1] for b in ids)
    if layout != "page_grouped":
        assert max(ids) < NUM_BLOCKS
    before = m._blocks.block_states().tolist()
    with pytest.raises(BlockStateError):
        m.free([ids[0], ids[0]])
    with pytest.raises(BlockStateError):
        m.free([ids[1], 10**9])
    assert m._blocks.block_states().tolist() == before
    m.free(ids)
    with pytest.raises(BlockStateError):
        m.free(ids[:1])
    buf = torch.zeros(100, dtype=torch.int32)
    assert m.alloc_into(buf) is True
    with pytest.raises(ValueError):
        m.alloc_into(torch.zeros(4, dtype=torch.int64))
    m.free_from(buf)
    assert m.try_to_reserve(100) and m.stats()["held"] == 100
    m.free_reserved()
    pb = m.page_bytes
    assert m.resize(pb) is True and m.available_size() == int(m._group.layout.page_num_blocks[0])
    assert m.resize(m.num_pages * pb) is True and m.available_size() == NUM_BLOCKS
    st = m.set_memory_limit(2 * pb, revision=1)
    assert st["status"] == "applied"
    # the pages over the limit leave once the fence of the work queued before them completes
    wait_until(lambda: m.get_mapped_memory_size() <= 2 * pb, timeout_s=60, what="the limit to be met")
    got = m.alloc(m.available_size())
    assert m.alloc(1) is None and m.get_mapped_memory_size() <= 2 * pb
    m.free(got)
    assert m.set_memory_limit(-1, revision=2)["status"] == "applied"
    torch.cuda.synchronize()
    m.trim()
    assert m.get_mapped_memory_size() == 0
    m.check_invariants()


@pytest.mark.parametrize("shape_kind", SHAPE_KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_integrity_churn(cuda, layout, shape_kind):
    m, kv, buffers = cuda(layout, shape_kind, max_reserved=1)
    rng = random.Random(f"{layout}/{shape_kind}")
    live = []
    for step in range(30):
        if step == 15 and live:                  # empty every page once: unmaps guaranteed
            torch.cuda.synchronize()
            m.free(live)
            live = []
        elif live and (rng.random() < 0.45 or m.available_size() == 0):
            rng.shuffle(live)
            k = rng.randint(1, len(live))
            torch.cuda.synchronize()
            m.free(live[:k])
            del live[:k]
        else:
            ids = m.alloc(rng.randint(1, min(200, m.available_size())))
            assert ids is not None and not set(ids) & set(live)
            for layer in range(NUM_LAYERS):
                for buffer in range(buffers):
                    write(kv, shape_kind, layer, buffer, ids)
            live += ids
        check(kv, shape_kind, buffers, live)
    assert m.stats()["pages"]["num_unmaps"] > 0
    m.free(live)
    m.check_invariants()


@pytest.mark.parametrize("layout", ["per_layer", "interleaved", "page_grouped"])
@pytest.mark.parametrize("path", ["free", *POOL_EXITS])
def test_unmap_waits_for_the_stream(cuda, layout, path):
    """Free blocks while a kernel queued on the manager's stream still reads them: the page is
    pending (not unmapped) until the stream has passed that point, and the read sees the data.
    `free`: the pool is off, the page leaves at once; the others: it goes to the pool with no
    fence, then leaves by that path (before: unmapped at once, an illegal address)."""
    pool = path != "free"
    env = {"IDLE_TRIM_S": 0.05} if path == "idle_trim" else {}
    m, kv, _ = cuda(layout, min_reserved=0, max_reserved=4 if pool else 0, **env)
    side = torch.cuda.Stream()
    m.set_stream(side.cuda_stream)
    ids = m.alloc(int(m._group.layout.page_num_blocks[0]))     # exactly page 0
    write(kv, "flash_attn", 0, 0, ids)
    torch.cuda.synchronize()
    out = torch.empty_like(kv[0][0, ids[0]])
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000 // 1000 * 500)        # ~0.5 s of spinning on the side stream
        out.copy_(kv[0][0, ids[0]])
    m.free(ids)
    if pool:
        assert m.stats()["pages"]["reserved"] == 1, m.stats()["pages"]
        take_out_of_the_pool(m, path)
    st = m.stats()["pages"]
    assert st["pending_unmap"] == 1 and st["in_use"] == st["reserved"] == 0, st
    m._pages.drain(False)
    assert m.stats()["pages"]["pending_unmap"] == 1, f"{path}: unmapped while the stream still reads the page"
    side.synchronize()
    deadline = time.monotonic() + 60
    while m.stats()["pages"]["pending_unmap"]:
        m._pages.drain(False)
        assert time.monotonic() < deadline
    assert m.get_mapped_memory_size() == 0
    want = (ids[0] * NUM_LAYERS) * 2 + 1
    assert bool((out == want).all()), "the kernel read the page after it was unmapped"
    m.check_invariants()


def test_set_stream(cuda):
    m, kv, _ = cuda("interleaved", max_reserved=0)
    default = torch.cuda.current_stream().cuda_stream
    assert m._pages.stream == default
    side = torch.cuda.Stream()
    m.set_stream(side.cuda_stream)
    assert m._pages.stream == side.cuda_stream
    ids = m.alloc(10)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
    m.free(ids)
    assert m.stats()["pages"]["pending_unmap"] == 1
    side.synchronize()
    m.trim()
    assert m.stats()["pages"]["pending_unmap"] == 0
    m.set_stream(0)
    assert m._pages.stream == 0
    ids = m.alloc(10)
    m.free(ids)
    torch.cuda.synchronize()
    m.trim()
    assert m.get_mapped_memory_size() == 0


def test_closed_manager_leaves_a_newer_one_alone(cuda):
    """On CUDA as on the host: a closed manager's kept alloc and its trim raise, and the newer
    manager's live blocks keep their data (an unmap under them would be an illegal address)."""
    from kvcached.errors import KVCachedError

    old, kv, buffers = cuda()
    old_alloc, old_trim = old.alloc, old.trim
    old.alloc(100)
    old.close()
    new = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, HEADS * HEAD_DIM * DTYPE.itemsize, NUM_LAYERS)
    ids = new.alloc(600)
    for layer in range(NUM_LAYERS):
        for buffer in range(buffers):
            write(kv, "flash_attn", layer, buffer, ids)
    new.free(ids[300:])
    ids = ids[:300]
    for call in (lambda: old_alloc(5), old_trim, lambda: old.alloc(5), old.trim):
        with pytest.raises(KVCachedError):
            call()
    check(kv, "flash_attn", buffers, ids)
    new.check_invariants()


def test_layout_choice_knows_the_memory_kind(cuda):
    """auto asks the device whether its memory is integrated (CU_DEVICE_ATTRIBUTE_INTEGRATED)."""
    from kvcached import runtime

    cuda(layout="auto")
    rt = runtime.runtime()
    group = rt.groups[0]
    integrated = rt.backend.integrated_memory
    assert integrated == torch.cuda.get_device_properties(rt.backend.device_id).is_integrated
    assert group.layout.name == ("per_layer" if integrated else "interleaved"), group.layout_reason
    assert ("integrated-memory" if integrated else "discrete-memory") in group.layout_reason
