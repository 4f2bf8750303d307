"""The padded decode runner (kvcached.serving.graphs) and the persistent step buffers
(kvcached.serving.buffers) against the plain eager loop and transformers' generate.

On the CPU ``cuda_graphs=True`` runs the runner eagerly over the same static, padded buffers a
CUDA graph reads: these tests check the padding lanes, the bucket sizes, the pad block and the
block-table rows on the tiny fp32 models of test_loop (token for token against generate).
The GPU tests (marked gpu) capture and replay real graphs in bf16.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import test_loop
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_loop import FAMILIES, NUM_BLOCKS, FitLimit, check_tokens, serving_model, workload
from test_loop_faults import Injected, failing, fault_points, serve_stepping

from kvcached import core, init_kvcached, shutdown_kvcached
from kvcached.serving import ATTENTION_NAME, ElasticKVCache, ServingLoop, StaticKVCache, StepBuffers, build_model, model_config
from kvcached.serving.graphs import decode_buckets

BATCHES = (1, 3, 8, 9, 17)
elastic = test_loop.elastic              # fixtures, used by name
one_thread = test_loop.one_thread


def together(seed: int, count: int, longest: int = 20, max_new: int = 16):
    """`count` requests arriving at step 0 (then decoding together: one bucket per batch size)."""
    return [(0, prompt, max(n, 4)) for _, prompt, n in workload(seed, count=count, longest=longest, max_new=max_new)]


def test_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(3) == [1, 2, 3]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(17) == [1, 2, 4, 8, 16, 17]
    assert decode_buckets(256)[-3:] == [240, 248, 256] and len(decode_buckets(256)) == 35


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("family", FAMILIES)
def test_runner_matches_eager_and_generate(family, batch):
    """`batch` requests decoding together over a static cache, max_running 17 (buckets 1, 2, 4,
    8, 16, 17: 3 and 9 are padded, and the batch shrinks through the buckets as requests
    finish): the runner's tokens are generate's and the eager loop's; every decode step went
    through the runner."""
    model = serving_model(family)
    requests = together(seed=batch, count=batch)
    loops = {}
    for graphs in (False, True):
        cache = StaticKVCache(model.config, NUM_BLOCKS, block_size=4)
        loops[graphs] = ServingLoop(model, cache, max_running=17, cuda_graphs=graphs)
    assert loops[False].runner is None and loops[False].pad_block is None
    results = {graphs: serve_stepping(loop, requests)[0] for graphs, loop in loops.items()}
    check_tokens(family, requests, results[True])
    assert results[True] == results[False]
    runner = loops[True].stats
    assert runner.runner_steps > 0 and runner.graph_replays == 0
    assert runner.runner_steps + runner.eager_steps == runner.steps
    assert loops[False].stats.runner_steps == 0
    assert runner.eager_steps < loops[False].stats.eager_steps
    assert loops[True].cache.available_blocks() == NUM_BLOCKS - 1       # the pad block
    loops[True].close()
    assert loops[True].cache.available_blocks() == NUM_BLOCKS


@pytest.mark.slow
@pytest.mark.parametrize("graphs", [False, True])
def test_compiled_model_matches_generate(graphs):
    """compile_model: every step runs torch.compile's program of the model (Mistral: sliding
    window in every layer), decode, prefill and mixed steps, with preemptions from a tight cache:
    generate's tokens (fullgraph: a graph break would raise)."""
    model = serving_model("mistral")
    requests = workload(seed=5, count=9, longest=20, max_new=24)
    cache = StaticKVCache(model.config, 16, block_size=4)
    with ServingLoop(model, cache, max_batch_tokens=24, max_running=8, cuda_graphs=graphs,
                     compile_model=True) as loop:
        results, _ = serve_stepping(loop, requests)
        stats = loop.stats
        assert stats.preemptions > 0 and stats.eager_steps > 0
        assert (stats.runner_steps > 0) == graphs
        assert loop.step_model is not model
    check_tokens("mistral", requests, results)


def test_cuda_graphs_default_is_off_on_the_cpu():
    model = serving_model("llama")
    cache = StaticKVCache(model.config, 16, block_size=4)
    loop = ServingLoop(model, cache)
    assert loop.runner is None and loop.pad_block is None and cache.available_blocks() == 16


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 1 << 16), family=st.sampled_from(FAMILIES), max_running=st.integers(1, 17),
       max_batch_tokens=st.integers(4, 64), block_size=st.sampled_from([1, 4, 16]), num_blocks=st.integers(12, 64))
def test_random_arrivals_match_generate(seed, family, max_running, max_batch_tokens, block_size, num_blocks):
    """Random arrivals, lengths, caps, block sizes and cache sizes (tight ones preempt: blocks
    go back and come again between runner calls): generate's tokens, the invariants after
    every step, and every block but the pad block back in the pool."""
    requests = workload(seed, count=10, longest=20, max_new=12)
    num_blocks = max(num_blocks, 2 * -(-(20 + 12) // block_size))
    model = serving_model(family)
    cache = StaticKVCache(model.config, num_blocks, block_size=block_size)
    with ServingLoop(model, cache, max_batch_tokens=max_batch_tokens, max_running=max_running,
                     cuda_graphs=True) as loop:
        results, _ = serve_stepping(loop, requests)
        check_tokens(family, requests, results)
        assert cache.available_blocks() == num_blocks - 1
    assert cache.available_blocks() == num_blocks


@pytest.mark.parametrize("family", FAMILIES)
def test_limit_drop_unmaps_between_runner_calls(elastic, family):
    """17 requests decode together over kvcached memory; after 8 steps the limit drops to 3
    pages: requests are preempted, their pages unmapped, and they come back (mapped again) in
    later runner calls; the limit is lifted after 40 steps. generate's tokens, the invariants
    after every step, the pad block held throughout and the limit met while it holds."""
    cache = elastic(family)
    page = cache.manager.page_bytes
    loop = ServingLoop(serving_model(family), cache, max_running=17, cuda_graphs=True)
    pad = loop.pad_block
    assert pad is not None and cache.manager.stats()["allocated"] == 1
    requests = together(seed=40 + FAMILIES.index(family), count=17, max_new=30)
    ids = {loop.add_request(prompt, n): index for index, (_, prompt, n) in enumerate(requests)}
    results: dict[int, list[int]] = {}
    step = 0
    while loop.has_work():
        if step == 8:
            assert cache.mapped_bytes() > 3 * page
            cache.manager.set_memory_limit(3 * page, revision=1)
        if step == 48:
            cache.manager.set_memory_limit(-1, revision=2)
        for request in loop.step():
            results[ids[request.id]] = request.generated
        loop.check_invariants()
        assert loop.pad_block == pad
        if 8 < step < 48 and cache.manager.memory_limit()["status"] == "applied":
            assert test_loop.settled_mapped_bytes(cache, 3 * page) <= 3 * page
        step += 1
    check_tokens(family, requests, results)
    assert loop.stats.preemptions > 0 and loop.stats.runner_steps > 0
    assert cache.manager.stats()["allocated"] == 1
    loop.close()
    loop.close()
    assert cache.manager.stats()["allocated"] == 0 and loop.pad_block is None


def test_pad_block_comes_once_the_cache_has_room(elastic):
    """A limit of 0 at construction: no pad block, so the loop takes it at its first decode
    step once the limit is lifted; the tokens are generate's."""
    cache = elastic("llama")
    cache.manager.set_memory_limit(0, revision=1)
    loop = ServingLoop(serving_model("llama"), cache, cuda_graphs=True)
    assert loop.pad_block is None
    cache.manager.set_memory_limit(-1, revision=2)
    requests = together(seed=9, count=4)
    results, _ = serve_stepping(loop, requests)
    check_tokens("llama", requests, results)
    assert loop.pad_block is not None and loop.stats.runner_steps > 0
    loop.close()
    assert cache.manager.stats()["allocated"] == 0


def test_close_after_the_cache_closed(elastic):
    cache = elastic("llama")
    loop = ServingLoop(serving_model("llama"), cache, cuda_graphs=True)
    cache.close()
    loop.close()
    assert loop.pad_block is None and loop.runner is None


@pytest.mark.parametrize("point", ["entry", "attention1:before", "logits"])
def test_failed_runner_steps_are_redone(elastic, point):
    """A fault inside the runner's model call (three decode steps, at `point`): every request as
    before the step (Note [Failed steps]), the next step redoes it, the tokens are generate's."""
    model = serving_model("llama")
    cache = elastic("llama")
    loop = ServingLoop(model, cache, max_running=9, cuda_graphs=True)
    requests = together(seed=23, count=9, longest=12)
    assert point in fault_points(model)
    with failing(model, [(3, point), (4, point), (8, point)]) as done:
        results, failures = serve_stepping(loop, requests, catch=Injected)
    assert failures == len(done.raised) == 3
    check_tokens("llama", requests, results)
    assert loop.stats.runner_steps > 3


def test_block_table_rows_follow_the_requests():
    """Rows are taken on admission and given back on finish, preemption and abort; a row holds
    its request's blocks, the rest the pad block."""
    model = serving_model("llama")
    cache = StaticKVCache(model.config, 24, block_size=4)
    loop = ServingLoop(model, cache, max_running=3, cuda_graphs=True)
    ids = [loop.add_request([1 + i] * (5 + i), 20) for i in range(5)]
    loop.step()
    running = {request.id: request.row for request in loop.running}
    assert sorted(running.values()) == [0, 1, 2] and all(r.row == -1 for r in loop.waiting)
    for request in loop.running:
        row = loop.buffers.row(request.row)
        assert row[:len(request.blocks)].tolist() == request.blocks
        assert (row[len(request.blocks):] == loop.pad_block).all()
    assert loop.abort(ids[1])
    loop.check_invariants()
    loop.step()
    assert ids[3] in {request.id for request in loop.running}
    loop.run_until_done()
    assert sorted(loop.buffers._free_rows) == [0, 1, 2]
    assert (loop.buffers.tables.numpy() == loop.pad_block).all()


@settings(max_examples=50, deadline=None)
@given(counts=st.lists(st.integers(1, 4), min_size=1, max_size=6))
def test_packed_plan_counts_its_leading_decode_rows(counts):
    """num_decodes of a packed step is the run of one-token requests at its front (what the
    attention sends through the decode kernel), whatever follows."""
    buffers = StepBuffers(max_running=6, max_tokens_per_step=24, width=2, block_size=4, device=torch.device("cpu"),
                          pad_block=9)
    rows = np.array([buffers.take_row([r]) for r in range(len(counts))])
    plan = buffers.pack(rows, np.zeros(len(counts), np.int64), np.array(counts), np.ones(len(counts), bool),
                        list(range(sum(counts))))
    assert plan.num_decodes == next((i for i, n in enumerate(counts) if n != 1), len(counts))


def test_repeated_sizes_reuse_the_plan_with_the_new_values():
    """Consecutive packs of equal sizes hand out one StepPlan (views of the same buffer) that
    shows the last pack's values; after a pack of other sizes the views are those sizes' again."""
    buffers = StepBuffers(max_running=4, max_tokens_per_step=8, width=3, block_size=4, device=torch.device("cpu"),
                          pad_block=9)
    rows = np.array([buffers.take_row(blocks) for blocks in ([1], [2, 3])])
    ones, sampled = np.ones(2, np.int64), np.ones(2, bool)
    first = buffers.pack(rows, np.array([1, 5]), ones, sampled, [7, 8])
    mixed = buffers.pack(rows, np.array([0, 4]), np.array([1, 2]), sampled, [1, 2, 3])
    assert mixed.sizes != first.sizes and mixed.input_ids.tolist() == [1, 2, 3]
    again = buffers.pack(rows, np.array([2, 6]), ones, sampled, [17, 18])
    assert again.sizes == first.sizes and again.input_ids.tolist() == [17, 18] and again.positions.tolist() == [2, 6]
    assert again.slot_mapping.tolist() == [1 * 4 + 2, 3 * 4 + 2] and again.seq_lens.tolist() == [3, 7]
    assert buffers.pack(rows, np.array([3, 7]), ones, sampled, [27, 28]) is again
    assert again.input_ids.tolist() == [27, 28] and again.logits_index.tolist() == [0, 1]


def test_padded_plan_lanes():
    """A decode step of 3 requests padded to 4 lanes: the real lanes first (their slots from the
    rows), then a lane of token 0 at position 0, slot -1, length 1 and a row of pad blocks."""
    buffers = StepBuffers(max_running=4, max_tokens_per_step=8, width=3, block_size=4, device=torch.device("cpu"),
                          pad_block=9)
    rows = [buffers.take_row(blocks) for blocks in ([1], [2, 3], [4, 5, 6])]
    plan = buffers.pack(np.array(rows), np.array([2, 5, 8]), np.ones(3, np.int64), np.ones(3, bool), [7, 8, 9],
                        lanes=4)
    assert plan.sizes == (4, 4, 3, 4, 4)           # every lane a decode row
    assert plan.input_ids.tolist() == [7, 8, 9, 0] and plan.positions.tolist() == [2, 5, 8, 0]
    assert plan.slot_mapping.tolist() == [1 * 4 + 2, 3 * 4 + 1, 6 * 4 + 0, -1]
    assert plan.seq_lens.tolist() == [3, 6, 9, 1] and plan.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert plan.logits_index.tolist() == [0, 1, 2, 3]
    assert plan.block_tables.tolist() == [[1, 9, 9], [2, 3, 9], [4, 5, 6], [9, 9, 9]]
    with pytest.raises(ValueError, match="decode-only"):
        buffers.pack(np.array(rows[:1]), np.array([0]), np.array([2]), np.ones(1, bool), [1, 2], lanes=2)


# -- GPU: captured graphs ------------------------------------------------------------------------

gpu = pytest.mark.skipif(core.cuda_unavailable_reason() is not None or not torch.cuda.is_available(),
                         reason="CUDA is not usable here")


def gpu_workload(seed: int, count: int = 24) -> list[tuple[int, list[int], int]]:
    rng = random.Random(seed)
    vocab = serving_model("llama").config.vocab_size
    return [(rng.randrange(20), [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))], rng.randrange(8, 48))
            for _ in range(count)]


def gpu_serve(model, requests, *, graphs: bool, capture: bool = True, squeeze: bool = False, compile_model=False,
              overlap: bool = False):
    """Serve over an ElasticKVCache on cuda:0. `squeeze` gives it 48 blocks (a 2 MiB page holds
    every block of the tiny model, so a limit would not bite: a full cache preempts instead) and
    trims the pool every 5 steps. The loop's invariants are checked after every step, but with
    `overlap` (where that check would commit the step ahead) only at the end. Each call
    initialises kvcached and shuts it down (a group's tensors are made once per runtime).
    Returns (tokens by index, stats)."""
    init_kvcached(device="cuda:0")
    cache = ElasticKVCache(model.config, 48 if squeeze else 1024, block_size=16, dtype=torch.bfloat16,
                           device="cuda:0")
    loop = ServingLoop(model, cache, max_running=20, cuda_graphs=graphs, compile_model=compile_model, overlap=overlap)
    if loop.runner is not None:
        loop.runner.capture = capture
    ids: dict[int, int] = {}
    results: dict[int, list[int]] = {}
    step = 0
    try:
        while len(ids) < len(requests) or loop.has_work():
            for index, (at, prompt, n) in enumerate(requests):
                if at == step:
                    ids[loop.add_request(prompt, n)] = index
            if squeeze and step % 5 == 0:
                cache.manager.trim()
            for request in loop.step():
                results[ids[request.id]] = request.generated
            if not overlap:
                loop.check_invariants()
            step += 1
        loop.check_invariants()
        return results, loop.stats
    finally:
        loop.close()
        shutdown_kvcached()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("squeeze", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_graphs_match_the_uncaptured_runner(kv_env, family, squeeze):
    """bf16: replayed graphs against the same runner run eagerly (same kernels, same padded
    shapes, same order: bit-identical tokens), with preemptions (blocks freed and handed out
    again) and trims between replays when squeezed; the graphs did replay."""
    kv_env(LAYOUT="auto")
    model = build_model(family, dtype=torch.bfloat16, device="cuda")
    requests = gpu_workload(seed=FAMILIES.index(family))
    eager, _ = gpu_serve(model, requests, graphs=True, capture=False, squeeze=squeeze)
    replayed, stats = gpu_serve(model, requests, graphs=True, squeeze=squeeze)
    assert replayed == eager
    assert stats.graph_replays == stats.runner_steps > 0
    assert not squeeze or stats.swapped_in == stats.swapped_out == stats.preemptions > 0    # pinned copies


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("squeeze", [False, True])
def test_gpu_graphs_a_step_ahead_match_the_graphs_without(kv_env, squeeze):
    """bf16: replayed graphs with overlap (each decode step's input tokens fed on the device from
    the step still running, the tokens coming back through two buffers in turn) against the same
    graphs without: bit-identical tokens, with preemptions and trims between replays when
    squeezed; steps did run ahead. See Note [Steps ahead]."""
    kv_env(LAYOUT="auto")
    model = build_model("llama", dtype=torch.bfloat16, device="cuda")
    requests = gpu_workload(seed=11)
    plain, _ = gpu_serve(model, requests, graphs=True, squeeze=squeeze)
    ahead, stats = gpu_serve(model, requests, graphs=True, squeeze=squeeze, overlap=True)
    assert ahead == plain
    assert stats.steps_ahead > 0 and stats.graph_replays == stats.runner_steps
    assert not squeeze or stats.preemptions > 0


@pytest.mark.gpu
@gpu
def test_gpu_overlap_is_on_by_default_with_graphs(kv_env):
    """A model on CUDA: a loop that replays graphs runs steps ahead unless told not to; one
    without graphs has no runner to run ahead with."""
    kv_env(LAYOUT="auto")
    model = build_model("llama", dtype=torch.bfloat16, device="cuda")
    init_kvcached(device="cuda:0")
    cache = ElasticKVCache(model.config, 64, block_size=16, dtype=torch.bfloat16, device="cuda:0")
    try:
        for kwargs, overlap in [({}, True), ({"overlap": False}, False), ({"cuda_graphs": False}, False)]:
            loop = ServingLoop(model, cache, max_running=4, **kwargs)
            assert loop.overlap is overlap, kwargs
            loop.close()
    finally:
        shutdown_kvcached()


@pytest.mark.gpu
@gpu
def test_gpu_compiled_graphs_match_the_compiled_runner(kv_env):
    """bf16, compile_model: graphs captured over the compiled program (kvcached's operator inside)
    against the same program run uncaptured, with preemptions and trims between replays."""
    kv_env(LAYOUT="auto")
    model = build_model("qwen2", dtype=torch.bfloat16, device="cuda")
    requests = gpu_workload(seed=7)
    eager, _ = gpu_serve(model, requests, graphs=True, capture=False, squeeze=True, compile_model=True)
    replayed, stats = gpu_serve(model, requests, graphs=True, squeeze=True, compile_model=True)
    assert replayed == eager
    assert stats.graph_replays == stats.runner_steps > 0 and stats.preemptions > 0


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_graphs_match_the_eager_loop(kv_env, family):
    """bf16: the graph loop against the plain eager loop (unpadded decode batches). cuBLAS picks
    its GEMM kernel by the number of rows, so a padded batch may round a row differently from
    the unpadded one, and a near tie of two logits can then pick another token and the request
    goes on from there (on the H200 one request of 24 did so, after 6 equal tokens). Wrong
    tables, positions or lanes would change nearly every request at its first decode step, so
    all but two must match in full; bit-identical tokens are checked against the uncaptured
    runner, which pads the same way (test_gpu_graphs_match_the_uncaptured_runner)."""
    kv_env(LAYOUT="auto")
    model = build_model(family, dtype=torch.bfloat16, device="cuda")
    requests = gpu_workload(seed=10 + FAMILIES.index(family))
    eager, eager_stats = gpu_serve(model, requests, graphs=False, squeeze=True)
    replayed, stats = gpu_serve(model, requests, graphs=True, squeeze=True)
    assert eager_stats.runner_steps == 0 and stats.graph_replays > 0
    assert replayed.keys() == eager.keys()
    differing = [index for index in eager if replayed[index] != eager[index]]
    assert len(differing) <= 2, differing


def wide_kv_model():
    """The tiny Llama with 4 KV heads of 256 in bf16 on cuda:0: 32 KiB per layer's K of a
    16-token block, so that a 2 MiB page holds 16 block ids (interleaved, 2 layers) and a few
    requests fill one."""
    from transformers import AutoModelForCausalLM

    config = model_config("llama")
    config.num_attention_heads = config.num_key_value_heads = 4
    config.head_dim = 256
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=ATTENTION_NAME)
    return model.eval()


def serve_squeezed(model, requests, squeeze: bool) -> tuple[dict[int, list[int]], FitLimit | None]:
    """Serve over a budgeted ElasticKVCache on cuda:0 with graphs, FitLimit applied if `squeeze`."""
    init_kvcached(device="cuda:0")
    cache = ElasticKVCache(model.config, 512, block_size=16, dtype=torch.bfloat16, device="cuda:0")
    loop = ServingLoop(model, cache, max_running=20)
    hook = FitLimit(loop, cache) if squeeze else None
    try:
        results = test_loop.serve(loop, requests, during=hook)
        loop.check_invariants()
        assert loop.stats.graph_replays > 0
        return results, hook
    finally:
        loop.close()
        shutdown_kvcached()


@pytest.mark.gpu
@gpu
def test_gpu_moved_blocks_give_the_same_tokens(kv_env, budget_name):
    """bf16 with graphs: blocks moved under a lowered limit (FitLimit: copies on the loop's
    stream, then the old pages unmapped behind their fence) give the tokens of the same run
    without the limit, bit for bit (the same batches, the same kernels; only block ids differ)."""
    kv_env(LAYOUT="auto", MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=1, GLOBAL_BUDGET=budget_name,
           GLOBAL_BUDGET_BYTES="4G")
    model = wide_kv_model()
    requests = gpu_workload(seed=21)
    plain, _ = serve_squeezed(model, requests, squeeze=False)
    moved, hook = serve_squeezed(model, requests, squeeze=True)
    hook.check()
    assert moved == plain


@pytest.mark.gpu
@gpu
def test_gpu_capture_graphs_up_front(kv_env):
    """capture_graphs() captures every bucket (largest first, one pool); the steps then only replay."""
    kv_env(LAYOUT="auto")
    init_kvcached(device="cuda:0")
    model = build_model("llama", dtype=torch.bfloat16, device="cuda")
    cache = ElasticKVCache(model.config, 256, block_size=16, dtype=torch.bfloat16, device="cuda:0")
    try:
        with ServingLoop(model, cache, max_running=12) as loop:
            assert loop.runner is not None and loop.runner.capture
            assert loop.capture_graphs() == len(loop.runner.buckets) == 5
            for prompt in ([5, 6, 7], [8] * 20, [9] * 33):
                loop.add_request(prompt, 10)
            loop.run_until_done()
            assert loop.stats.graph_replays == loop.stats.runner_steps > 0
            assert len(loop.runner.graphs) == 5
    finally:
        cache.close()
