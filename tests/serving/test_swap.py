"""Preempted requests kept on the host and copied back (Note [Swapping out] in kvcached.serving.swap).

With swapping, a preemption costs no recomputation: every token of every request runs through
the model exactly once, and the tokens are still generate's. Without room on the host (or when
the copy fails) the request is recomputed as before. Same tiny models as test_loop.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_loop import BLOCK_SIZE, FAMILIES, LAYOUTS, check_tokens, serving_model, settled_mapped_bytes, workload
from test_loop_faults import serve_stepping
from test_loop import elastic, one_thread  # noqa: F401 (fixtures, used by name)

from kvcached.serving import ServingLoop, StaticKVCache


def serve_counting(loop: ServingLoop, requests, during=None) -> tuple[dict[int, list[int]], int]:
    """serve_stepping (invariants checked after every step), also counting the tokens run
    through the model: ({index in requests: tokens}, tokens run). One commit per step here (no
    steps ahead on the CPU), so stats.step_tokens is read once after each."""
    seen = {"steps": 0, "run": 0}

    def count() -> None:
        if loop.stats.steps > seen["steps"]:
            seen["steps"], seen["run"] = loop.stats.steps, seen["run"] + loop.stats.step_tokens

    def before(steps: int) -> None:
        count()
        if during is not None:
            during(steps)

    results, _ = serve_stepping(loop, requests, during=before)
    count()
    return results, seen["run"]


def once_each(requests) -> int:
    """Tokens the model runs when none is recomputed: each prompt token and each generated token
    but the last."""
    return sum(len(prompt) + max_new - 1 for _, prompt, max_new in requests)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 1 << 16), family=st.sampled_from(FAMILIES), num_blocks=st.integers(10, 24),
       max_batch_tokens=st.sampled_from([8, 32, 256]))
def test_a_tight_cache_swaps_every_preemption_and_recomputes_nothing(seed, family, num_blocks, max_batch_tokens):
    """Random arrivals over a cache too small for them all (preemptions mid-prompt and
    mid-decode): every preempted request comes back from the host, no token runs twice, the
    tokens are generate's, and nothing stays on the host. The same run without swapping runs
    more tokens whenever it preempted."""
    requests = workload(seed, count=8, longest=30, max_new=12)
    model = serving_model(family)

    def loop(swap_bytes: int) -> ServingLoop:
        return ServingLoop(model, StaticKVCache(model.config, num_blocks, block_size=BLOCK_SIZE),
                           max_batch_tokens=max_batch_tokens, cuda_graphs=False, swap_bytes=swap_bytes)

    swapping = loop(1 << 30)
    results, run = serve_counting(swapping, requests)
    check_tokens(family, requests, results)
    stats = swapping.stats
    assert stats.swapped_out == stats.swapped_in == stats.preemptions
    assert run == once_each(requests)
    assert swapping.swapped_bytes == 0
    recomputing = loop(0)
    results, run = serve_counting(recomputing, requests)
    check_tokens(family, requests, results)
    assert recomputing.stats.swapped_out == 0
    assert (run > once_each(requests)) == (recomputing.stats.preemptions > 0)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 1 << 16), num_blocks=st.integers(10, 24), max_batch_tokens=st.sampled_from([8, 32, 256]),
       swap=st.booleans())
def test_requests_wait_in_the_order_they_began_to_wait(seed, num_blocks, max_batch_tokens, swap):
    """Before every step of a tight cache's run the queue is ordered by when each request began
    to wait: at its arrival, or, for one preempted after its first token, during the step that
    preempted it (after the requests that were waiting then, before the next arrivals). A
    preempted request still in its prompt keeps its arrival. Tokens are generate's, swapped or
    recomputed."""
    requests = workload(seed, count=8, longest=30, max_new=12)
    model = serving_model("llama")
    loop = ServingLoop(model, StaticKVCache(model.config, num_blocks, block_size=BLOCK_SIZE),
                       max_batch_tokens=max_batch_tokens, cuda_graphs=False, swap_bytes=(1 << 30) * swap)
    arrived: dict[int, float] = {}
    began: dict[int, float] = {}
    preemptions: dict[int, int] = {}

    def check(steps: int) -> None:
        for request in [*loop.waiting, *loop.running]:
            arrived.setdefault(request.id, steps)
            if request.preemptions != preemptions.get(request.id, 0):
                preemptions[request.id] = request.preemptions
                began[request.id] = steps - 0.5 if request.generated else arrived[request.id]
        order = [began.get(r.id, arrived[r.id]) for r in loop.waiting]
        assert order == sorted(order), [(r.id, len(r.generated), t) for r, t in zip(loop.waiting, order)]

    results, _ = serve_stepping(loop, requests, during=check)
    check_tokens("llama", requests, results)
    assert loop.stats.preemptions == sum(preemptions.values())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_a_lowered_limit_swaps_out_of_kvcached_memory(elastic, layout, kv_layout):
    """A limit of 3 pages under 8 running requests on kvcached's tensors, in every layout: the
    preempted requests' K/V go to the host before their pages are unmapped and come back into
    pages mapped again; tokens are generate's, no token is recomputed, the limit holds."""
    requests = [(0, prompt, 30) for _, prompt, _ in workload(seed=11, count=8)]
    cache = elastic("llama", layout=layout, kv_layout=kv_layout)
    loop = ServingLoop(serving_model("llama"), cache)

    def lower(step: int) -> None:
        if step == 6:
            cache.manager.set_memory_limit(3 * cache.manager.page_bytes, revision=1)

    results, run = serve_counting(loop, requests, during=lower)
    check_tokens("llama", requests, results)
    assert loop.stats.swapped_out == loop.stats.swapped_in == loop.stats.preemptions > 0
    assert run == once_each(requests)
    assert settled_mapped_bytes(cache, 3 * cache.manager.page_bytes) <= 3 * cache.manager.page_bytes


def test_swap_bytes_bounds_the_host_copies():
    """swap_bytes of two blocks' copies: a preempted request with more cached is recomputed, the
    loop never holds more than that on the host (check_invariants after every step), and the
    tokens are generate's."""
    requests = [(0, prompt, 20) for _, prompt, _ in workload(4, count=6, longest=10)]
    model = serving_model("llama")
    cache = StaticKVCache(model.config, 10, block_size=BLOCK_SIZE)
    loop = ServingLoop(model, cache, max_batch_tokens=32, cuda_graphs=False, swap_bytes=cache.swap_bytes(2))
    results, run = serve_counting(loop, requests)
    check_tokens("llama", requests, results)
    assert 0 < loop.stats.swapped_out < loop.stats.preemptions
    assert run > once_each(requests)


def test_aborting_a_swapped_out_request_drops_its_copy():
    """A request preempted to the host, then aborted while it waits: its host bytes go, and the
    others finish with generate's tokens."""
    model = serving_model("qwen2")
    cache = StaticKVCache(model.config, 12, block_size=BLOCK_SIZE)
    loop = ServingLoop(model, cache, max_batch_tokens=64, cuda_graphs=False)
    requests = [(0, prompt, 20) for _, prompt, _ in workload(3, count=4, longest=16)]
    ids = [loop.add_request(prompt, max_new) for _, prompt, max_new in requests]
    while not any(r.swapped is not None for r in loop.waiting):
        loop.step()
        assert loop.has_work()
    victim = next(r for r in loop.waiting if r.swapped is not None)
    assert loop.swapped_bytes == victim.swapped.host.nbytes > 0
    assert loop.abort(victim.id)
    assert loop.swapped_bytes == 0
    loop.check_invariants()
    finished = {r.id: r.generated for r in loop.step()}
    finished.update(loop.run_until_done())
    kept = [i for i, request_id in enumerate(ids) if request_id != victim.id]
    check_tokens("qwen2", [requests[i] for i in kept], {n: finished[ids[i]] for n, i in enumerate(kept)})


class FailingSwaps(StaticKVCache):
    """A static cache whose swap_out / swap_in raise at the calls named (counted from 0), as a
    host out of memory or a failed copy would."""

    def __init__(self, *args, fail_out=(), fail_in=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.fail_out, self.fail_in = set(fail_out), set(fail_in)
        self.outs = self.ins = 0

    def swap_out(self, ids):
        self.outs += 1
        if self.outs - 1 in self.fail_out:
            raise torch.OutOfMemoryError("injected: no pinned host memory")
        return super().swap_out(ids)

    def swap_in(self, host, ids):
        self.ins += 1
        if self.ins - 1 in self.fail_in:
            raise RuntimeError("injected: the copy to the device failed")
        super().swap_in(host, ids)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fail_out=st.sets(st.integers(0, 9), max_size=4), fail_in=st.sets(st.integers(0, 9), max_size=4))
def test_failed_swaps_fall_back_to_recomputing(fail_out, fail_in):
    """swap_out failing at any calls: those preemptions recompute. swap_in failing at any calls:
    that step raises, the request waits holding no block and no host copy, and is recomputed.
    Either way every request finishes with generate's tokens and the invariants hold after every
    step, failed ones included."""
    requests = [(0, prompt, 20) for _, prompt, _ in workload(4, count=6, longest=10)]
    model = serving_model("llama")
    cache = FailingSwaps(model.config, 10, block_size=BLOCK_SIZE, fail_out=fail_out, fail_in=fail_in)
    loop = ServingLoop(model, cache, max_batch_tokens=32, cuda_graphs=False)
    ids = {loop.add_request(prompt, max_new): i for i, (_, prompt, max_new) in enumerate(requests)}
    results: dict[int, list[int]] = {}
    raised = 0
    while loop.has_work():
        try:
            finished = loop.step()
        except RuntimeError as exc:
            assert "injected: the copy" in str(exc)
            raised += 1
            assert loop.waiting[0].swapped is None and not loop.waiting[0].blocks
            finished = []
        loop.check_invariants()
        results.update((ids[r.id], r.generated) for r in finished)
    check_tokens("llama", requests, results)
    assert cache.outs > 3, "the workload must preempt"
    assert raised == len({i for i in fail_in if i < cache.ins})
    assert loop.stats.swapped_out == cache.outs - len({i for i in fail_out if i < cache.outs})
    assert loop.swapped_bytes == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1G"])
def test_swap_bytes_must_be_a_count(bad):
    model = serving_model("llama")
    with pytest.raises((ValueError, TypeError), match="swap_bytes"):
        ServingLoop(model, StaticKVCache(model.config, 16, block_size=BLOCK_SIZE), swap_bytes=bad)
