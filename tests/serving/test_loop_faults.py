"""The serving loop when something fails (kvcached.serving.loop, .cache): a step that raises, a
stall, a request that no limit lets finish, a closed cache, a bad free.

Failures are injected into the real tiny models of test_loop (seeded random weights,
initializer_range 0.5) with torch module hooks: at the model's entry (no K/V of the step
written), before and after each layer's attention (the step's K/V written up to that layer) and
after the LM head (all of it written, logits computed); into kvcached's host backend (the
cache's alloc raises DriverError); and as real SIGINTs. The reference is the same workload
through an undisturbed loop: the tokens must be the same, and the loop's invariants must hold
after every step, failed ones included. See Note [Failed steps] and Note [Stalls] in
kvcached.serving.loop.
"""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_loop import BLOCK_SIZE, FAMILIES, LAYOUTS, FitLimit, check_tokens, serving_model, workload
from test_loop import elastic, one_thread  # noqa: F401 (fixtures, used by name)

from kvcached import shutdown_kvcached
from kvcached.errors import BlockStateError, DriverError, KVCachedClosedError
from kvcached.runtime import runtime
from kvcached.serving import LoopStalledError, ServingLoop, StaticKVCache


class Injected(RuntimeError):
    """The failure the tests inject (a kernel error, say)."""


class InjectedInterrupt(KeyboardInterrupt):
    """Ctrl-C as the tests inject it: a subclass, so that a real Ctrl-C still ends the run."""


ERRORS = (Injected, InjectedInterrupt, torch.OutOfMemoryError)


def fault_points(model) -> list[str]:
    """Every place of a forward pass a fault can be injected at, in the order they run."""
    points = ["entry"]
    for j in range(model.config.num_hidden_layers):
        points += [f"attention{j}:before", f"attention{j}:after"]
    return points + ["logits"]


@dataclass
class Faults:
    """What `failing` did so far."""

    calls: int = 0                                  # forward calls begun
    raised: list[tuple[int, str]] = field(default_factory=list)


@contextlib.contextmanager
def failing(model, faults=(), error: type[BaseException] = Injected):
    """Raise `error` at each (forward call, point) of `faults`, calls counted from 0 at the
    model's entry; yields a Faults. The hooks go on exit."""
    done = Faults()
    faults = set(faults)

    def at(point: str):
        def hook(*_):
            if point == "entry":
                done.calls += 1
            if (done.calls - 1, point) in faults:
                done.raised.append((done.calls - 1, point))
                raise error(f"injected at {point} of forward call {done.calls - 1}")
        return hook

    handles = [model.register_forward_pre_hook(at("entry"))]
    for j, layer in enumerate(model.model.layers):
        handles.append(layer.self_attn.register_forward_pre_hook(at(f"attention{j}:before")))
        handles.append(layer.self_attn.register_forward_hook(at(f"attention{j}:after")))
    handles.append(model.lm_head.register_forward_hook(at("logits")))
    try:
        yield done
    finally:
        for handle in handles:
            handle.remove()


def serve_stepping(loop: ServingLoop, requests, catch=(), during=None) -> tuple[dict[int, list[int]], int]:
    """Add each request once the loop has run as many steps as its arrival says, call step()
    until every one finished, again after each exception of the `catch` types, checking the
    loop's invariants after every step; `during(steps)` runs before each. Returns ({index in
    requests: tokens}, failed steps)."""
    ids: dict[int, int] = {}
    results: dict[int, list[int]] = {}
    failures = 0
    for _ in range(10_000):
        while len(ids) < len(requests) and requests[len(ids)][0] <= loop.stats.steps:
            _, prompt, max_new = requests[len(ids)]
            ids[loop.add_request(prompt, max_new)] = len(ids)
        if len(ids) == len(requests) and not loop.has_work():
            return results, failures
        if during is not None:
            during(loop.stats.steps)
        try:
            finished = loop.step()
        except catch:
            failures += 1
        else:
            for request in finished:
                results[ids[request.id]] = request.generated
        loop.check_invariants()
    pytest.fail(f"not done after 10000 steps: {loop.stats}")


def serve_until_done(loop: ServingLoop, requests, catch=()) -> tuple[dict[int, list[int]], int]:
    """Add every request, then run_until_done again after each exception of the `catch` types,
    keeping what each call hands out. Returns ({index in requests: tokens}, exceptions)."""
    ids = {loop.add_request(prompt, max_new): index for index, (_, prompt, max_new) in enumerate(requests)}
    results: dict[int, list[int]] = {}
    for failures in range(1000):
        try:
            results.update(loop.run_until_done(stall_timeout_s=60))
            return {ids[i]: tokens for i, tokens in results.items()}, failures
        except catch:
            loop.check_invariants()
    pytest.fail("run_until_done raised 1000 times")


def static_loop(family: str, max_batch_tokens: int, num_blocks: int = 64) -> ServingLoop:
    model = serving_model(family)
    return ServingLoop(model, StaticKVCache(model.config, num_blocks, block_size=BLOCK_SIZE),
                       max_batch_tokens=max_batch_tokens)


def undisturbed(family: str, requests, max_batch_tokens: int) -> tuple[dict[int, list[int]], int]:
    """(tokens, forward calls) of the workload through a loop that nothing disturbs."""
    with failing(serving_model(family)) as count:
        results, _ = serve_stepping(static_loop(family, max_batch_tokens), requests)
    assert sorted(results) == list(range(len(requests)))
    return results, count.calls


def draw_faults(data, model, num_calls: int, max_size: int) -> list[tuple[int, str]]:
    """Faults at distinct forward calls of an undisturbed run (so each one is reached)."""
    return data.draw(st.lists(st.tuples(st.integers(0, num_calls - 1), st.sampled_from(fault_points(model))),
                              min_size=1, max_size=max_size, unique_by=lambda fault: fault[0]))


# -- a step that raises is redone, with the same tokens -----------------------------------------

@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(data=st.data(), seed=st.integers(0, 1 << 16), family=st.sampled_from(FAMILIES),
       max_batch_tokens=st.integers(4, 24), error=st.sampled_from(ERRORS))
def test_failed_steps_anywhere_are_redone_with_the_same_tokens(data, seed, family, max_batch_tokens, error):
    """Faults at any forward calls and points (before any K/V of the step is written, between
    layers, after the logits), chunked prefills and decodes in the failing steps: every request
    ends with the undisturbed run's tokens. Before, the cached count moved before the model
    call: a prefill chunk was skipped (other tokens) or a decoding request wedged the loop."""
    requests = workload(seed, count=5, longest=30, max_new=12)
    expected, num_calls = undisturbed(family, requests, max_batch_tokens)
    model = serving_model(family)
    faults = draw_faults(data, model, num_calls, 6)
    loop = static_loop(family, max_batch_tokens)
    with failing(model, faults, error) as done:
        results, failures = serve_stepping(loop, requests, catch=error)
    assert failures == len(done.raised) == len(faults)
    assert results == expected
    assert loop.cache.available_blocks() == loop.cache.num_blocks


@pytest.mark.parametrize("point", ["alloc", *fault_points(serving_model("llama"))])
def test_failed_steps_over_kvcached_memory_are_redone(elastic, point):
    """The same over kvcached's cache, a fault at every point in turn, three times a run; at
    "alloc" the backend's third map and the two after it fail, so the cache's alloc raises
    DriverError mid-schedule, three steps in a row."""
    requests = workload(seed=17, count=6, longest=30, max_new=12)
    expected, _ = undisturbed("llama", requests, 8)
    cache = elastic("llama")
    model = serving_model("llama")
    loop = ServingLoop(model, cache, max_batch_tokens=8)
    if point == "alloc":
        backend = runtime().backend
        backend.inject_fault("map", after=2, times=3)
        try:
            results, failures = serve_stepping(loop, requests, catch=DriverError)
        finally:
            backend.inject_fault("map", after=-1)
        assert failures == 3
    else:
        with failing(model, [(3, point), (4, point), (9, point)]) as done:
            results, failures = serve_stepping(loop, requests, catch=Injected)
        assert failures == len(done.raised) == 3
    assert results == expected
    assert cache.manager.stats()["allocated"] == 0


def test_moves_whose_unmaps_fail_lose_nothing(elastic, budget_name):
    """Blocks move under a lowered limit (FitLimit) while the backend's unmaps fail: the emptied
    pages stay pending (mapped, counted) until a later drain, every request finishes with
    generate's tokens, and the loop's and the allocator's invariants hold after every step."""
    cache = elastic("llama", GLOBAL_BUDGET=budget_name, GLOBAL_BUDGET_BYTES="1G")
    requests = workload(seed=11, count=24, longest=20, max_new=40)
    loop = ServingLoop(serving_model("llama"), cache)
    squeeze = FitLimit(loop, cache)
    backend = runtime().backend

    def during(step: int) -> None:
        limited = "limit" in squeeze.seen
        squeeze(step)
        if not limited and "limit" in squeeze.seen:
            backend.inject_fault("unmap", after=0, times=3)

    try:
        results, failures = serve_stepping(loop, requests, during=during)
    finally:
        backend.inject_fault("unmap", after=-1)
    check_tokens("llama", requests, results)
    assert squeeze.seen["moved"] > 0 and cache.manager._pages.stats()["num_unmap_failures"] >= 1
    assert cache.manager.stats()["allocated"] == 0


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(data=st.data(), seed=st.integers(0, 1 << 16), family=st.sampled_from(FAMILIES))
def test_keyboard_interrupts_in_run_until_done_lose_nothing(data, seed, family):
    """KeyboardInterrupts raised from inside the model at hypothesis-chosen steps and layers,
    run_until_done called again after each: every request comes out once, with the undisturbed
    run's tokens, and none that finished before an interrupt is lost."""
    requests = [(0, prompt, max_new) for _, prompt, max_new in workload(seed, count=6, longest=30, max_new=12)]
    expected, num_calls = undisturbed(family, requests, 16)
    model = serving_model(family)
    faults = draw_faults(data, model, num_calls, 8)
    loop = static_loop(family, 16)
    with failing(model, faults, InjectedInterrupt) as done:
        results, failures = serve_until_done(loop, requests, catch=InjectedInterrupt)
    assert failures == len(done.raised) == len(faults)
    assert results == expected


@pytest.mark.parametrize("overlap", [False, True])
def test_sigint_at_random_moments_loses_nothing(elastic, overlap):
    """Real SIGINTs every 0-10 ms while run_until_done runs (the handler raises KeyboardInterrupt
    only then): wherever they land, in the model call, while requests move between the queues
    or (overlap) while a step is counted ahead or committed behind the next one, every request
    finishes once, with the undisturbed run's tokens."""
    requests = [(0, prompt, max_new) for _, prompt, max_new in workload(seed=5, count=6, longest=30, max_new=16)]
    expected, _ = undisturbed("qwen2", requests, 16)
    loop = ServingLoop(serving_model("qwen2"), elastic("qwen2"), max_batch_tokens=16, cuda_graphs=overlap,
                       overlap=overlap)
    armed, stop = [False], threading.Event()

    def handler(signum, frame):
        # disarms itself: one raise per arming, so none lands in the except clause below
        if armed[0]:
            armed[0] = False
            raise InjectedInterrupt

    def sender():
        rng = random.Random(7)
        while not stop.wait(rng.uniform(0.0, 0.01)):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    ids = {loop.add_request(prompt, max_new): index for index, (_, prompt, max_new) in enumerate(requests)}
    results: dict[int, list[int]] = {}
    interrupts = 0
    previous = signal.signal(signal.SIGINT, handler)
    thread = threading.Thread(target=sender, daemon=True)
    try:
        thread.start()
        while loop.has_work():
            try:
                armed[0] = True
                try:
                    results.update(loop.run_until_done(stall_timeout_s=60))
                finally:
                    armed[0] = False
            except InjectedInterrupt:
                interrupts += 1
            loop.check_invariants()
        results.update(loop.run_until_done())
    finally:
        stop.set()
        thread.join()
        # A SIGINT delivered but not yet handled would run the handler current when Python gets
        # to it: the restored one, a KeyboardInterrupt in the test runner. Every backward jump
        # of this loop runs pending handlers, so the last ones reach the disarmed handler.
        for _ in range(100_000):
            pass
        signal.signal(signal.SIGINT, previous)
    assert interrupts > 0
    assert {ids[i]: tokens for i, tokens in results.items()} == expected


def test_a_free_that_raises_in_the_commit_leaves_the_others_intact():
    """Two requests finish in one step and the first one's free raises (a block of it freed
    behind the loop's back): the second still finishes with its own tokens and its blocks freed,
    both are handed out, and the loop goes on. Before, the second had its K/V counted but not its
    token: every later step saw it with nothing to run."""
    model = serving_model("llama")
    cache = StaticKVCache(model.config, 64, block_size=BLOCK_SIZE)
    requests = [(0, [5, 6, 7], 4), (0, [9, 10, 11, 12, 13], 4), (0, list(range(14, 22)), 12)]
    expected, _ = undisturbed("llama", requests, 16)
    loop = ServingLoop(model, cache, max_batch_tokens=16)
    first, second, third = (loop.add_request(prompt, n) for _, prompt, n in requests)
    for _ in range(3):
        assert loop.step() == []
    stolen = loop.running[0].blocks[0]
    cache.free([stolen])
    with pytest.raises(BlockStateError, match=f"block id {stolen} is not allocated"):
        loop.step()
    finished = loop.take_finished()
    assert [request.id for request in finished] == [first, second]
    assert [request.generated for request in finished] == [expected[0], expected[1]]
    assert finished[1].blocks == [] and finished[0].blocks        # the failed free kept its ids
    assert loop.run_until_done() == {third: expected[2]}
    cache.free([b for b in finished[0].blocks if b != stolen])
    assert cache.available_blocks() == cache.num_blocks


# -- finished requests survive a stall ----------------------------------------------------------

def stalling_run(elastic):
    """12 requests: 11 short ones finish, then (inside the same run_until_done) the limit drops
    to 0 under a long one, which preempts itself: run_until_done raises. Returns (loop, cache,
    {request id: index}, the requests)."""
    requests = [(0, prompt, max_new) for _, prompt, max_new in workload(seed=3, count=11, longest=10, max_new=8)]
    requests.append((0, workload(seed=4, count=1, longest=30)[0][1], 200))       # outlives the others
    cache = elastic("llama")
    model = serving_model("llama")
    loop = ServingLoop(model, cache)
    ids = {loop.add_request(prompt, n): i for i, (_, prompt, n) in enumerate(requests)}

    def drop_the_limit(*_):
        if loop.stats.finished == 11 and cache.manager.memory_limit()["limit_bytes"] != 0:
            cache.manager.set_memory_limit(0, revision=1)

    handle = model.register_forward_pre_hook(drop_the_limit)
    try:
        with pytest.raises(RuntimeError, match="no memory for any request"):
            loop.run_until_done(stall_timeout_s=0.3)
    finally:
        handle.remove()
    assert loop.stats.finished == 11 and loop.waiting
    return loop, cache, ids, requests


def test_results_finished_before_a_stall_come_with_the_next_run(elastic):
    """Before: the 11 were lost with the exception; now the next run_until_done hands them out."""
    loop, cache, ids, requests = stalling_run(elastic)
    cache.manager.set_memory_limit(-1, revision=2)
    results = loop.run_until_done()
    assert sorted(ids[i] for i in results) == list(range(12)), "a request was lost"
    assert {ids[i]: tokens for i, tokens in results.items()} == undisturbed("llama", requests, 2048)[0]
    assert loop.take_finished() == [] and loop.run_until_done() == {}


def test_results_finished_before_a_stall_can_be_taken(elastic):
    """take_finished() hands them out without running the loop (the long request stays)."""
    loop, _, ids, requests = stalling_run(elastic)
    with pytest.raises(LoopStalledError, match="11 finished request"):
        loop.run_until_done(stall_timeout_s=0.1)
    finished = loop.take_finished()
    expected = undisturbed("llama", requests, 2048)[0]
    assert {ids[r.id]: r.generated for r in finished} == {i: expected[i] for i in range(11)}
    assert loop.take_finished() == [] and loop.has_work()


# -- a request the limit cannot hold: an error within the stall timeout, not a livelock ---------

def blocks_within_one_page(cache) -> int:
    """How many blocks the first page holds: alloc one at a time under a one-page limit."""
    cache.manager.set_memory_limit(cache.manager.page_bytes, revision=1)
    held = []
    while (ids := cache.alloc(1)) is not None:
        held += ids
    cache.free(held)
    return len(held)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_request_the_limit_cannot_hold_raises_instead_of_livelocking(elastic, layout):
    """A prompt longer than max_batch_tokens under a limit that holds its first chunks but not
    all of it: before, it prefilled, preempted itself and was admitted again forever (a step ran
    every other step, so the stall timer never fired); now run_until_done raises within the stall
    timeout. The model gives up after 60 s, so the old loop fails instead of hanging."""
    cache = elastic("llama", layout=layout)
    per_page = blocks_within_one_page(cache) * BLOCK_SIZE
    model = serving_model("llama")
    loop = ServingLoop(model, cache, max_batch_tokens=per_page // 2)
    loop.add_request([1] * (per_page + 5), 4)
    started = time.monotonic()

    def give_up(*_):
        if time.monotonic() - started > 60:
            raise AssertionError(f"still running after 60 s: {loop.stats}")

    handle = model.register_forward_pre_hook(give_up)
    try:
        with pytest.raises(RuntimeError, match="below what one request needs"):
            loop.run_until_done(stall_timeout_s=0.5)
    finally:
        handle.remove()
    assert loop.stats.preemptions > 0 and loop.stats.generated_tokens == 0
    loop.check_invariants()
    cache.manager.set_memory_limit(-1, revision=2)          # the same request, with room: it finishes
    assert [len(tokens) for tokens in loop.run_until_done().values()] == [4]


# -- a closed cache -----------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["close", "shutdown"])
def test_a_step_over_a_closed_elastic_cache_raises(elastic, how):
    """A decoding request whose next token fits its block (the step allocates nothing): before,
    the step wrote K/V into the unmapped pages (SIGSEGV). Now KVCachedClosedError, from step,
    run_until_done and abort, with the request where it was."""
    cache = elastic("llama")
    loop = ServingLoop(serving_model("llama"), cache)
    first = loop.add_request([1, 2, 3], 8)
    loop.step()
    cache.close() if how == "close" else shutdown_kvcached()
    for call in (loop.step, loop.run_until_done, lambda: loop.abort(first)):
        with pytest.raises(KVCachedClosedError, match="closed"):
            call()
    assert [r.id for r in loop.running] == [first] and not loop.waiting
    assert loop.running[0].num_cached == 3 and len(loop.running[0].tokens) == 4


def test_a_step_over_a_closed_static_cache_raises():
    model = serving_model("llama")
    cache = StaticKVCache(model.config, 16, block_size=BLOCK_SIZE)
    loop = ServingLoop(model, cache)
    loop.add_request([1, 2, 3], 8)
    loop.step()
    cache.close()
    for call in (loop.step, lambda: cache.alloc(1), lambda: cache.free([0]), cache.available_blocks):
        with pytest.raises(KVCachedClosedError, match="StaticKVCache was closed"):
            call()
    assert loop.running[0].num_cached == 3


# -- StaticKVCache refuses bad frees as kvcached's allocator does -------------------------------

BAD_FREES = [
    ("double", BlockStateError, r"block id {freed} is not allocated \(never allocated"),
    ("repeat", BlockStateError, r"block id {a} appears more than once in this call; nothing was freed\."),
    ("never", BlockStateError, r"block id {never} is not allocated \(never allocated"),
    ("past_end", BlockStateError, r"block id {n} is not a block id of this allocator \(valid: \[0, {n}\)\)"),
    ("negative", BlockStateError, r"block id -1 is not a block id of this allocator"),
    ("bool", TypeError, r"block id True is a bool, not a block id; nothing was freed\."),
    ("float", TypeError, r"float"),
]


def bad_ids(kind: str, held: list[int], freed: int, never: int, num_blocks: int) -> list:
    return {"double": [held[0], freed], "repeat": [held[0], held[0]], "never": [held[0], never],
            "past_end": [held[0], num_blocks], "negative": [-1], "bool": [True], "float": [1.0]}[kind]


@pytest.mark.parametrize("kind", [kind for kind, _, _ in BAD_FREES])
@pytest.mark.parametrize("which", ["static", "elastic"])
def test_bad_frees_are_refused_alike(elastic, which, kind):
    """A double free, a repeat, an id never handed out, out of range, a bool, a float: the same
    exception and message from both caches, nothing freed. Before, StaticKVCache took a double
    free and then handed one block out twice ([0, 1, 0, 1, 2])."""
    config = serving_model("llama").config
    cache = StaticKVCache(config, 64, block_size=BLOCK_SIZE) if which == "static" else elastic("llama", num_blocks=64)
    held = cache.alloc(3)
    freed = cache.alloc(1)[0]
    cache.free([freed])
    never = next(b for b in range(64) if b not in held and b != freed)
    before = cache.available_blocks()
    _, error, pattern = next(entry for entry in BAD_FREES if entry[0] == kind)
    with pytest.raises(error, match=pattern.format(a=held[0], freed=freed, never=never, n=64)):
        cache.free(bad_ids(kind, held, freed, never, 64))
    assert cache.available_blocks() == before
    cache.check_invariants()
    cache.free([np.int64(held[0])] + held[1:])                  # numpy ints are block ids
    assert cache.available_blocks() == 64


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "free", "bad"]), st.integers(0, 9),
                              st.sampled_from([kind for kind, _, _ in BAD_FREES])), max_size=40))
def test_static_cache_against_a_model(ops):
    """Random allocs, frees and bad frees against a set of the ids handed out: alloc hands out
    only free ids, a bad free raises and changes nothing, every block comes back once."""
    cache = StaticKVCache(serving_model("llama").config, 12, block_size=BLOCK_SIZE)
    held: list[int] = []
    freed: list[int] = []
    for op, n, kind in ops:
        if op == "alloc":
            ids = cache.alloc(n)
            assert ids is None if n > 12 - len(held) else (len(ids) == n and not set(ids) & set(held))
            held += ids or []
        elif op == "free" and held:
            cache.free(held[:n])
            freed += held[:n]
            held = held[n:]
        elif op == "bad" and held and (again := [b for b in freed if b not in held]):
            never = next(b for b in range(12) if b not in held)
            _, error, _ = next(entry for entry in BAD_FREES if entry[0] == kind)
            with pytest.raises(error):
                cache.free(bad_ids(kind, held, again[0], never, 12))
        assert cache.available_blocks() == 12 - len(held)
        cache.check_invariants()
    cache.free(held)
    assert sorted(cache.alloc(12)) == list(range(12))
