"""A lowered limit on an idle instance: the pages over it leave behind the fence of the work queued
before (Note [Deferred unmap]), and nothing but the page allocator's background thread is left to
unmap them once that fence completes: no alloc, no free, no step comes. The limit must be met
then, on the host backend and on CUDA with the fence held open by a long kernel.

Tests that measure memory after a fenced unmap wait for it like this (``wait_until`` on the
mapped bytes, a generous timeout), never for a number of steps: on a GPU other processes keep
busy, the fence of one step's work may complete several steps later."""

from __future__ import annotations

import pytest
import torch
from _procs import wait_until

from kvcached import KVCacheManager, init_kvcached

NUM_BLOCKS, BLOCK_SIZE, NUM_LAYERS = 4096, 16, 2
BLOCK_BYTES = BLOCK_SIZE * 8 * 64 * 2          # 8 KV heads of dim 64 in bf16
HOLD_NS = 500_000_000                          # the kernel that holds the fence open: ~0.5 s


def _manager(kv_env, device: str) -> KVCacheManager:
    kv_env(LAYOUT="interleaved", MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=4)
    init_kvcached(device=device)
    return KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, BLOCK_BYTES, NUM_LAYERS)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_lowered_limit_is_met_once_the_fences_complete_on_an_idle_instance(kv_env, device):
    """Three pages in use, two of them emptied (into the pool, which may hold more); the limit drops to one page while a
    kernel queued on the manager's stream still runs (CUDA): the two pages wait behind its fence
    (mapped, pending), then leave with nobody calling the manager again."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    m = _manager(kv_env, device)
    per_page = m.stats()["total_blocks"] // m.num_pages
    page = m.page_bytes
    ids = m.alloc(3 * per_page)
    held = None
    if device == "cuda":
        side = torch.cuda.Stream()
        m.set_stream(side.cuda_stream)
        held = torch.cuda.Event()
        with torch.cuda.stream(side):
            torch.cuda._sleep(HOLD_NS)   # cycles, ~0.25-0.5 s; the fence below is recorded after it
            held.record()
    m.free(ids[per_page:])
    assert m.set_memory_limit(page, revision=1)["status"] == "applied"
    pages = m.stats()["pages"]
    if held is not None and not held.query():
        # the kernel was still running after the stats were read: nothing over the limit may
        # have been unmapped yet (its pages may still be read by the kernels queued before)
        assert pages["pending_unmap"] >= 2 and m.get_mapped_memory_size() >= 3 * page, pages
    activity = pages["num_take_return"]
    wait_until(lambda: m.get_mapped_memory_size() <= page, timeout_s=60,
               what=f"the limit of one page to be met ({m.stats()['pages']})")
    pages = m.stats()["pages"]
    assert pages["pending_unmap"] == 0 and pages["in_use"] == 1 and pages["reserved"] == 0, pages
    assert pages["num_take_return"] == activity, "the instance was not idle"
    assert held is None or held.query(), "unmapped before the kernel queued before it completed"
    m.free(ids[:per_page])
    m.check_invariants()
    m.close()
