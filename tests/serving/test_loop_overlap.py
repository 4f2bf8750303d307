"""The serving loop a step ahead (ServingLoop(overlap=True), Note [Steps ahead] in
kvcached.serving.loop): a decode step that leaves every request running is launched and left on
the device while the next one is scheduled, packed and launched, its input tokens fed from the
device, and only then are the earlier step's tokens read and committed.

The reference is the same workload through a loop without overlap, call for call: every step()
must hand out the same finished requests with the same tokens, and the tokens must be those of
transformers' generate. On the CPU the padded runner runs eagerly over the same buffers, so the
scheduling, the feed and the commits are what is checked here; tests/serving/test_graphs.py
replays CUDA graphs with it (marker gpu).
"""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_loop import FAMILIES, check_tokens, serving_model, workload
from test_loop import elastic, one_thread  # noqa: F401 (fixtures, used by name)
from test_loop_faults import ERRORS, failing, fault_points
from test_scheduler_decode import lockstep

from kvcached.serving import ServingLoop, StaticKVCache


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 1 << 16), family=st.sampled_from(FAMILIES), max_running=st.integers(1, 12),
       max_batch_tokens=st.integers(1, 48), block_size=st.sampled_from([1, 2, 4, 16]),
       num_blocks=st.integers(8, 64), abort=st.booleans())
def test_a_step_ahead_changes_no_step(seed, family, max_running, max_batch_tokens, block_size, num_blocks, abort):
    """Random arrivals, lengths, caps, block sizes and cache sizes (tight ones preempt), aborts
    (which wait for the step ahead): the loop with overlap hands out what the one without does,
    step for step."""
    requests = workload(seed, count=10, longest=20, max_new=14)
    num_blocks = max(num_blocks, -(-(20 + 14) // block_size) + 2)
    rng = random.Random(seed)
    aborts = [(rng.randrange(30), rng.randrange(len(requests))) for _ in range(2)] if abort else []
    model = serving_model(family)

    def make(overlap: bool) -> ServingLoop:
        cache = StaticKVCache(model.config, num_blocks, block_size=block_size)
        return ServingLoop(model, cache, max_batch_tokens=max_batch_tokens, max_running=max_running,
                           cuda_graphs=True, overlap=overlap)

    results = lockstep(requests, make(True), make(False), aborts)
    assert set(results) | {index for _, index in aborts} >= set(range(len(requests)))


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_steps_run_ahead_with_generates_tokens(family):
    """Requests decoding together for many steps: most steps are launched ahead of the last
    one's tokens, and every request ends with generate's tokens."""
    requests = [(0, prompt, 16) for _, prompt, _ in workload(7, count=6, longest=20)]
    model = serving_model(family)

    def make(overlap: bool) -> ServingLoop:
        return ServingLoop(model, StaticKVCache(model.config, 64, block_size=4), cuda_graphs=True, overlap=overlap)

    loop = make(True)
    results = lockstep(requests, loop, make(False))
    check_tokens(family, requests, results)
    assert loop.stats.steps_ahead >= 8, loop.stats
    assert make(False).stats.steps_ahead == 0


def test_overlap_is_off_by_default_on_the_cpu():
    """The padded runner on the CPU runs eagerly: nothing to overlap, so overlap stays off unless
    asked for (on CUDA it is on by default: tests/serving/test_graphs.py)."""
    model = serving_model("llama")
    cache = StaticKVCache(model.config, 16, block_size=4)
    for kwargs, overlap in [({}, False), ({"overlap": True}, True)]:
        loop = ServingLoop(model, cache, cuda_graphs=True, **kwargs)
        assert loop.overlap is overlap, kwargs
        loop.close()


@pytest.mark.parametrize("max_new", [2, 3, 10])
def test_every_step_launched_ahead_is_counted(max_new):
    """Requests admitted together: their prefill gives token 1 and a plain decode step token 2,
    which stays ahead while more are to come; each later decode step is launched before the
    last one's tokens are read, the one that finishes them included: max_new - 2 of them."""
    model = serving_model("llama")
    loop = ServingLoop(model, StaticKVCache(model.config, 64, block_size=4), cuda_graphs=True, overlap=True)
    for _, prompt, _ in workload(3, count=3, longest=10):
        loop.add_request(prompt, max_new)
    loop.run_until_done()
    assert loop.stats.steps_ahead == max(0, max_new - 2), loop.stats


def test_step_times_do_not_overlap_a_step_ahead():
    """A step ahead is committed during the next step() call, after that call launched its own
    step: its time counts from the last commit, so the step times of a run add up to no more
    than the run's wall time, and tokens_per_s is tokens over time spent, not over overlapping
    intervals counted twice."""
    model = serving_model("llama")
    loop = ServingLoop(model, StaticKVCache(model.config, 64, block_size=4), cuda_graphs=True, overlap=True)
    for _, prompt, _ in workload(4, count=3, longest=10):
        loop.add_request(prompt, 12)
    steps, total = 0, 0.0
    start = time.perf_counter()
    while loop.has_work():
        loop.step()
        if loop.stats.steps != steps:
            steps, total = loop.stats.steps, total + loop.stats.last_step_s
    wall = time.perf_counter() - start
    assert loop.stats.steps_ahead > 0
    assert total <= wall, (total, wall, loop.stats)


def test_nothing_runs_ahead_without_the_runner_or_the_option():
    """Eager decode steps, or overlap off: every step is committed before step() returns."""
    requests = [(0, prompt, 10) for _, prompt, _ in workload(2, count=3, longest=10)]
    model = serving_model("llama")
    for cuda_graphs, overlap in [(False, True), (True, False)]:
        loop = ServingLoop(model, StaticKVCache(model.config, 64, block_size=4), cuda_graphs=cuda_graphs,
                           overlap=overlap)
        for _, prompt, max_new in requests:
            loop.add_request(prompt, max_new)
        while loop.has_work():
            loop.step()
            assert loop._ahead is None
        assert loop.stats.steps_ahead == 0


def test_the_commands_that_change_requests_wait_for_the_step_ahead(elastic):
    """abort, check_invariants, capture_graphs and close each commit the step ahead first: the
    requests agree with the loop's counters after each, and close loses no token."""
    requests = [(0, prompt, 12) for _, prompt, _ in workload(5, count=4, longest=12)]
    model = serving_model("llama")
    loop = ServingLoop(model, elastic(), cuda_graphs=True, overlap=True)
    ids = {loop.add_request(prompt, max_new): index for index, (_, prompt, max_new) in enumerate(requests)}
    commands = [lambda: loop.abort(next(iter(ids))), loop.check_invariants, loop.capture_graphs, loop.close]
    for command in commands:
        for _ in range(100):
            if loop._ahead is not None:
                break
            loop.step()
        assert loop._ahead is not None, "no decode step went ahead"
        command()
        assert loop._ahead is None
        for request in loop.running:
            row = request.row if request.row >= 0 else None
            assert row is None or loop.counters.length[row] == len(request.tokens)
    assert all(len(r.tokens) > r.prompt_len for r in loop.running)


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 1 << 16), family=st.sampled_from(FAMILIES), error=st.sampled_from(ERRORS))
def test_failed_steps_with_a_step_ahead_are_redone(data, seed, family, error):
    """Faults at any forward call and point of a run whose decode steps run ahead: the step
    ahead is committed, the failed one changes nothing, and stepping on ends every request with
    generate's tokens."""
    requests = [(0, prompt, 12) for _, prompt, _ in workload(seed, count=4, longest=16)]
    model = serving_model(family)
    faults = data.draw(st.lists(st.tuples(st.integers(0, 30), st.sampled_from(fault_points(model))),
                                min_size=1, max_size=4, unique_by=lambda fault: fault[0]))
    loop = ServingLoop(model, StaticKVCache(model.config, 64, block_size=4), cuda_graphs=True, overlap=True)
    ids = {loop.add_request(prompt, max_new): index for index, (_, prompt, max_new) in enumerate(requests)}
    results: dict[int, list[int]] = {}
    failures = 0
    with failing(model, faults, error) as done:
        while loop.has_work():
            try:
                finished = loop.step()
            except error:
                failures += 1
                assert loop._ahead is None
                loop.check_invariants()
                continue
            for request in finished:
                results[ids[request.id]] = request.generated
    assert failures == len(done.raised)
    check_tokens(family, requests, results)
    loop.check_invariants()
    assert loop.cache.available_blocks() == loop.cache.num_blocks - 1      # the pad block
