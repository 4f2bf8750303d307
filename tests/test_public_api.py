"""The public API's names and the arguments every entry point shares, checked once for all.

Every exception kvcached exports is a KVCachedError; ``kv_layout`` is refused by one check
(kvcached.checks) with one message through the runtime, the layouts, the ops and the serving
caches; the arguments kept for engines' compatibility (``pp_rank``, ``is_worker``) are accepted.
"""

from __future__ import annotations

import pytest
import torch

import kvcached
from kvcached import KVCacheManager, alloc_kv_cache, init_kvcached
from kvcached import runtime as rt_mod
from kvcached.checks import KV_LAYOUTS, check_kv_layout
from kvcached.errors import KVCachedArgumentError, KVCachedConfigError, KVCachedError
from kvcached.layout import make_layout
from kvcached.ops import write_kv
from kvcached.serving import StaticKVCache

from _stacks import KV_PAGE_BYTES

GRANULE = 2 << 20


def test_every_exported_exception_is_a_kvcached_error():
    exported = [getattr(kvcached, name) for name in kvcached.__all__]
    errors = [e for e in exported if isinstance(e, type) and issubclass(e, BaseException)]
    assert KVCachedError in errors and len(errors) >= 9
    assert all(issubclass(e, KVCachedError) for e in errors), [e for e in errors if not issubclass(e, KVCachedError)]
    assert "KVCachePoolExhausted" not in kvcached.__all__
    with pytest.raises(AttributeError, match="KVCachePoolExhausted"):
        kvcached.KVCachePoolExhausted   # noqa: B018  (removed: alloc returns None instead)


@pytest.mark.parametrize("bad", ["XYZ", "nhd", "", None, 1, ["NHD"]])
def test_one_kv_layout_check_for_every_entry_point(kv_env, bad):
    """The same class and message from the runtime, the layouts, the ops and the serving cache;
    a KVCachedArgumentError is both a KVCachedConfigError and a ValueError, what each promised."""
    with pytest.raises(KVCachedArgumentError) as direct:
        check_kv_layout(bad)
    message = str(direct.value)
    assert f"kv_layout={bad!r} is unknown" in message and "'NHD'" in message and "'HND'" in message

    lay = make_layout("interleaved", 2, 2, 16 << 10, GRANULE, 8, GRANULE)
    ranges = [torch.empty(size, dtype=torch.uint8) for size in lay.range_sizes()]
    k_cache = v_cache = torch.zeros(4, 16, 2, 32)
    key = torch.zeros(3, 2, 32)
    kv_env(LAYOUT="interleaved", MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=2)
    init_kvcached(device="cpu", page_size_bytes=KV_PAGE_BYTES)
    calls = [
        lambda: lay.views(ranges, "flash_attn", torch.float16, (16, 4, 128), bad),
        lambda: alloc_kv_cache((2, 100, 16, 2, 32), 16, torch.float16, "cpu", 2, kv_layout=bad),
        lambda: write_kv(key, key, k_cache, v_cache, torch.tensor([0, 1, 2]), kv_layout=bad),
        lambda: StaticKVCache(None, 8, kv_layout=bad),
    ]
    for call in calls:
        with pytest.raises(KVCachedArgumentError) as info:
            call()
        assert str(info.value) == message
        assert isinstance(info.value, KVCachedConfigError) and isinstance(info.value, ValueError)
    assert rt_mod.runtime().groups == {}, "a refused alloc_kv_cache left a group behind"


def test_hnd_is_refused_for_mla_only(kv_env):
    assert [check_kv_layout(k) for k in KV_LAYOUTS] == list(KV_LAYOUTS)
    assert check_kv_layout("NHD", has_heads=False) == "NHD"
    with pytest.raises(KVCachedArgumentError, match="no meaning for MLA"):
        check_kv_layout("HND", has_heads=False)
    kv_env(LAYOUT="interleaved", MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=2)
    init_kvcached(device="cpu", page_size_bytes=KV_PAGE_BYTES)
    with pytest.raises(KVCachedConfigError, match=r"kv_layout='HND' has no meaning for MLA .*use NHD"):
        alloc_kv_cache((100, 16, 64), 16, torch.float16, "cpu", 2, attention_type="MLA", kv_layout="HND")
    assert rt_mod.runtime().groups == {}
    kv = alloc_kv_cache((100, 16, 64), 16, torch.float16, "cpu", 2, attention_type="MLA")
    assert kv[0].shape == (100, 16, 64)


def test_pp_rank_and_is_worker_are_accepted_for_engines(kv_env):
    kv_env(LAYOUT="interleaved", MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=2)
    init_kvcached(device="cpu", page_size_bytes=KV_PAGE_BYTES, pp_rank=3, is_worker=True)
    alloc_kv_cache((2, 100, 16, 2, 32), 16, torch.float16, "cpu", 2)
    m = KVCacheManager(100, 16, 2 * 32 * 2, 2, pp_rank=3)
    ids = m.alloc(4)
    assert ids is not None and len(ids) == 4
    m.free(ids)
    for bad in (-1, 1.0, True):
        with pytest.raises(KVCachedConfigError, match="pp_rank"):
            KVCacheManager(100, 16, 2 * 32 * 2, 2, pp_rank=bad, group_id=1)
