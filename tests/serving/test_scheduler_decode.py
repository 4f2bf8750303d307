"""The decode fast path of the serving loop's scheduler (Note [Row counters] in
kvcached.serving.counters) against its general path.

The fast path builds a decode step's batch from the per-row counters and calls the cache's
alloc only for the requests whose next token starts a block. These tests run the same workload
through a loop with the fast path and one without it (``_decoding`` always declining) and
require the same thing after every step: the same requests running and waiting, with the same
tokens, cached counts and block ids (the allocs came in the same order), the same preemptions;
and the loop's invariants, the counters agreeing with the requests included.
"""

from __future__ import annotations

import random

import pytest
import test_loop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_loop import BLOCK_SIZE, FAMILIES, assert_generates, serving_model, workload

from kvcached.serving import ServingLoop, StaticKVCache
from kvcached.serving.scheduler import Scheduler

one_thread = test_loop.one_thread        # fixture, used by name


class GeneralScheduler(Scheduler):
    """A scheduler that never takes the decode fast path."""

    def _decoding(self, budget):
        return None


class GeneralLoop(ServingLoop):
    """A loop whose scheduler never takes the decode fast path."""

    scheduler_class = GeneralScheduler


class CountingScheduler(Scheduler):
    """A scheduler that counts the steps it took the decode fast path."""

    fast_steps = 0

    def _decoding(self, budget):
        cached = super()._decoding(budget)
        self.fast_steps += cached is not None
        return cached


class CountingLoop(ServingLoop):
    """A loop that counts the steps its scheduler took the decode fast path."""

    scheduler_class = CountingScheduler
    fast_steps = property(lambda self: self.scheduler.fast_steps)


def state(loop: ServingLoop) -> tuple:
    """What a step leaves of every request the loop holds."""
    def of(request):
        return request.id, tuple(request.tokens), request.num_cached, tuple(request.blocks), request.preemptions
    return (tuple(map(of, loop.running)), tuple(map(of, loop.waiting)), loop.stats.preemptions,
            loop.stats.step_tokens, loop.stats.runner_steps)


def lockstep(requests, first: ServingLoop, second: ServingLoop, aborts=(), after_step=None) -> dict[int, list[int]]:
    """Serve `requests` ((arrival step, prompt, max_new)) through two loops call for call,
    aborting the request of index i at step s for each (s, i) of `aborts`: every step() must hand
    out the same requests with the same tokens, and after_step(step), if given, checks more.
    Returns the first loop's results; its invariants hold at the end."""
    ids: dict[int, int] = {}
    results: dict[int, list[int]] = {}
    for step in range(10_000):
        for index, (at, prompt, max_new) in enumerate(requests):
            if at == step:
                request_id = first.add_request(prompt, max_new)
                assert second.add_request(prompt, max_new) == request_id
                ids[request_id] = index
        for at, index in aborts:
            if at == step:
                request_id = next((i for i, j in ids.items() if j == index), None)
                if request_id is not None:
                    assert first.abort(request_id) == second.abort(request_id)
        if len(ids) == len(requests) and not first.has_work():
            assert not second.has_work()
            first.check_invariants()
            return results
        finished, finished_second = first.step(), second.step()
        assert [(r.id, r.tokens) for r in finished] == [(r.id, r.tokens) for r in finished_second], \
            f"the loops differ at step {step}"
        for request in finished:
            results[ids[request.id]] = request.generated
        if after_step is not None:
            after_step(step)
    pytest.fail(f"not done after 10000 steps: {first.stats}")


def fast_and_general(requests, make_loop, aborts=()) -> tuple[CountingLoop, dict[int, list[int]]]:
    """lockstep of a CountingLoop and a GeneralLoop from make_loop(cls), which must also be the
    same after every step. Returns the fast loop and its results."""
    fast, general = make_loop(CountingLoop), make_loop(GeneralLoop)

    def same(step: int) -> None:
        assert state(fast) == state(general), f"the loops differ after step {step}"
        fast.check_invariants()
        general.check_invariants()

    return fast, lockstep(requests, fast, general, aborts, same)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 1 << 16), family=st.sampled_from(FAMILIES), max_running=st.integers(1, 12),
       max_batch_tokens=st.integers(1, 48), block_size=st.sampled_from([1, 2, 4, 16]),
       num_blocks=st.integers(8, 64), cuda_graphs=st.booleans(), abort=st.booleans())
def test_fast_path_matches_the_general_path(seed, family, max_running, max_batch_tokens, block_size, num_blocks,
                                            cuda_graphs, abort):
    """Random arrivals, lengths, caps, block sizes, cache sizes (tight ones preempt, in decode
    steps too), aborts, with and without the padded runner: the fast loop and the general one
    are the same after every step."""
    requests = workload(seed, count=10, longest=20, max_new=14)
    num_blocks = max(num_blocks, -(-(20 + 14) // block_size) + 1)
    rng = random.Random(seed)
    aborts = [(rng.randrange(30), rng.randrange(len(requests))) for _ in range(2)] if abort else []
    model = serving_model(family)

    def make(cls):
        cache = StaticKVCache(model.config, num_blocks, block_size=block_size)
        return cls(model, cache, max_batch_tokens=max_batch_tokens, max_running=max_running,
                   cuda_graphs=cuda_graphs)

    make_results = fast_and_general(requests, make, aborts)[1]
    aborted = {index for _, index in aborts}
    assert set(make_results) | aborted >= set(range(len(requests)))


def test_fast_path_runs_and_preempts_under_a_tight_cache():
    """Decoding requests that outgrow a small cache: the fast path schedules most decode steps,
    an alloc that returns None in it hands the step to the general path, which preempts; every
    request still ends with generate's tokens."""
    requests = [(0, prompt, 12) for _, prompt, _ in workload(3, count=6, longest=12)]
    model = serving_model("llama")

    def make(cls):
        return cls(model, StaticKVCache(model.config, 14, block_size=BLOCK_SIZE), max_batch_tokens=64)

    loop, results = fast_and_general(requests, make)
    assert loop.fast_steps > 10 and loop.stats.preemptions > 0
    for index, (_, prompt, max_new) in enumerate(requests):
        assert_generates("llama", prompt, max_new, results[index])


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_fast_path_allocates_the_block_a_token_starts(cuda_graphs):
    """Prompts ending at every offset of a block, decoding across several block boundaries on
    the fast path: each boundary's step takes a block for the request that crosses it (before
    its K/V are written: a skipped alloc writes them into another block and breaks the tokens,
    and leaves more tokens cached than the blocks hold, which check_invariants reports)."""
    size = 4
    model = serving_model("qwen2")
    rng = random.Random(11)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(size + offset)] for offset in range(size)]
    cache = StaticKVCache(model.config, 64, block_size=size)
    loop = CountingLoop(model, cache, max_batch_tokens=64, cuda_graphs=cuda_graphs)
    allocs: list[int] = []
    alloc = cache.alloc
    cache.alloc = lambda n: allocs.append(n) or alloc(n)
    ids = [loop.add_request(prompt, 3 * size) for prompt in prompts]
    results: dict[int, list[int]] = {}
    loop.step()                                         # the prefill: every request has its first token
    while loop.has_work():
        blocks = {request.id: len(request.blocks) for request in loop.running}
        crossing = [request.id for request in loop.running if request.num_cached % size == 0]
        allocs.clear()
        fast = loop.fast_steps
        for request in loop.step():
            results[request.id] = request.generated
        loop.check_invariants()
        assert loop.fast_steps == fast + 1
        assert allocs == [1] * len(crossing)
        for request in loop.running:
            assert len(request.blocks) == blocks[request.id] + (request.id in crossing)
    for request_id, prompt in zip(ids, prompts):
        assert_generates("qwen2", prompt, 3 * size, results[request_id])
    loop.close()
    assert cache.available_blocks() == 64
