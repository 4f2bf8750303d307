"""The serving loop at tensor parallelism 2 and 4 (kvcached.serving.tp, .shard, .plan).

Each rank is a real process (torch.multiprocessing spawn) in a gloo group on CPU; every rank
builds the same tiny float32 model with seeded random weights and keeps its heads and MLP
columns; rank 0 schedules. The reference is the same workload through ServingLoop at TP = 1
(itself checked against transformers' generate in test_loop): the greedy tokens must be the
same, with a cache small enough that requests are preempted (swapped out on every rank).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_loop import FitLimit, serve, serving_model, workload
from test_loop_faults import serve_stepping
from test_swap import FailingSwaps

from kvcached import init_kvcached, shutdown_kvcached
from kvcached.config import reload_settings
from kvcached.serving import (
    ElasticKVCache,
    ServingLoop,
    StaticKVCache,
    StepPlan,
    TensorParallelLoop,
    TensorParallelWorker,
    build_model,
    model_config,
    shard_config,
    shard_model,
)
from kvcached.serving.shard import RowParallelLinear, plan_shard

BLOCK_SIZE = 4
NUM_BLOCKS = 24                 # 96 tokens: 6 requests of up to 53 tokens do not fit at once
MAX_BATCH_TOKENS = 32
PAGE_BYTES = 4096               # kvcached pages of the elastic runs: a few requests fill one
ELASTIC_BLOCKS = 256
ELASTIC_ENV = {"LAYOUT": "interleaved", "MIN_RESERVED_PAGES": "0", "MAX_RESERVED_PAGES": "1", "TRACKER": "0"}
ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 600.0           # spawning 4 interpreters that import torch on a loaded 2-core machine
GROUP_TIMEOUT_S = 300.0


# The ranks fork from one server that has imported torch, transformers and this module once
# (a spawned rank spends most of its 20 s importing them on a loaded 2-core machine).
mp.get_context("forkserver").set_forkserver_preload(["torch", "transformers", "kvcached.serving", __name__])


def tp_workload(seed: int) -> list[tuple[int, list[int], int]]:
    """6 requests of 1-29 prompt tokens and 24 new ones, arriving over 12 steps."""
    return [(at, prompt, 24) for at, prompt, _ in workload(seed, count=6, longest=30)]


def tp1_tokens(family: str, requests, *, num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE,
               max_batch_tokens: int = MAX_BATCH_TOKENS) -> tuple[dict[int, list[int]], int]:
    """(tokens, preemptions) of the same workload through ServingLoop at TP = 1."""
    model = serving_model(family)
    loop = ServingLoop(model, StaticKVCache(model.config, num_blocks, block_size=block_size),
                       max_batch_tokens=max_batch_tokens)
    return serve(loop, requests), loop.stats.preemptions


@dataclass(frozen=True)
class Scenario:
    """What every rank of one spawned run does."""

    family: str
    requests: list
    backend: str = "gloo"
    device_type: str = "cpu"
    elastic: bool = False               # kvcached's cache (init_kvcached on every rank) instead of a static one
    limit_pages_at: tuple[int, int] | None = None   # (step, pages): rank 0 lowers the memory limit then
                                                    # (the cache gets ELASTIC_BLOCKS), else num_blocks
    num_blocks: int = NUM_BLOCKS
    block_size: int = BLOCK_SIZE
    max_batch_tokens: int = MAX_BATCH_TOKENS
    fail_at_step: int | None = None     # rank 0 raises inside the loop's with block at this step
    budget: str | None = None           # a global budget (elastic): rank 0 applies FitLimit, blocks move
    swap_bytes: int = 1 << 30           # the leader's swap_bytes (0: preempted requests are recomputed)
    worker_fails: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())    # rank 1's swap_out / swap_in calls that raise


class LeaderFailure(Exception):
    pass


def _rank(rank: int, world_size: int, store: str, out: str, scenario: Scenario) -> None:
    """One rank: join the group, split the model, run the loop (rank 0) or follow it."""
    torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}" if scenario.device_type == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(scenario.backend, init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        model = shard_model(build_model(scenario.family, device=device), rank, world_size)
        config = shard_config(model.config, model.kvcached_shard)
        if scenario.elastic:
            env = ELASTIC_ENV | ({"GLOBAL_BUDGET": scenario.budget, "GLOBAL_BUDGET_BYTES": "1G"} if scenario.budget else {})
            for name, value in env.items():
                os.environ[f"KVCACHED_{name}"] = value
            reload_settings()
            init_kvcached(tp_rank=rank, world_size=world_size, device=str(device),
                          page_size_bytes=PAGE_BYTES if device.type == "cpu" else None)
            num_blocks = ELASTIC_BLOCKS if scenario.limit_pages_at or scenario.budget else scenario.num_blocks
            cache = ElasticKVCache(config, num_blocks, block_size=scenario.block_size, device=device)
        elif rank == 1 and any(scenario.worker_fails):
            cache = FailingSwaps(config, scenario.num_blocks, block_size=scenario.block_size, device=device,
                                 fail_out=scenario.worker_fails[0], fail_in=scenario.worker_fails[1])
        else:
            cache = StaticKVCache(config, scenario.num_blocks, block_size=scenario.block_size, device=device)
        if rank == 0:
            report = _lead(model, cache, scenario)
        else:
            worker = TensorParallelWorker(model, cache)
            report = {"steps": worker.run(), "swapped_left": len(worker.swapped)}
        cache.close()
        Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        shutdown_kvcached()             # before the group goes: rank 0 tells the others to unmap
        dist.destroy_process_group()


def _lead(model, cache, scenario: Scenario) -> dict:
    limit = []
    squeeze = None

    def during(step: int) -> None:
        if step == scenario.fail_at_step:
            raise LeaderFailure(f"failed at step {step}")
        if scenario.limit_pages_at and step == scenario.limit_pages_at[0]:
            limit.append(scenario.limit_pages_at[1] * cache.manager.page_bytes)
            assert cache.mapped_bytes() > limit[0], f"the limit must bite: {cache.mapped_bytes()} bytes mapped"
            cache.manager.set_memory_limit(limit[0], revision=1)
        if squeeze is not None:
            squeeze(step)

    try:
        with TensorParallelLoop(model, cache, max_batch_tokens=scenario.max_batch_tokens,
                                swap_bytes=scenario.swap_bytes) as loop:
            squeeze = FitLimit(loop, cache) if scenario.budget else None
            if any(scenario.worker_fails):      # a failed swap-in raises from its step: step again
                results, failed_steps = serve_stepping(loop, scenario.requests, catch=(RuntimeError,), during=during)
            else:
                results, failed_steps = serve(loop, scenario.requests, during=during), 0
    except LeaderFailure as exc:
        return {"raised": str(exc), "steps": loop.steps_sent}
    report = {"results": results, "preemptions": loop.stats.preemptions, "swapped_out": loop.stats.swapped_out,
              "swapped_in": loop.stats.swapped_in, "failed_steps": failed_steps, "steps": loop.steps_sent,
              "free_blocks": cache.available_blocks()}
    if scenario.elastic:
        report.update(allocated=cache.manager.stats()["allocated"], mapped=cache.mapped_bytes(),
                      limit=limit[0] if limit else None)
    if squeeze is not None:
        report["squeeze"] = squeeze.seen
    return report


def run_tp(tmp_path: Path, world_size: int, scenario: Scenario) -> list[dict]:
    """Spawn `world_size` ranks running `scenario`; the per-rank reports. A rank that raises
    fails the test with its traceback; ranks still running after RUN_TIMEOUT_S are killed."""
    context = mp.start_processes(_rank, args=(world_size, str(tmp_path / "store"), str(tmp_path), scenario),
                                 nprocs=world_size, join=False, start_method="forkserver")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"TP={world_size} ranks still running after {RUN_TIMEOUT_S} s")
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]
    if "results" in reports[0]:
        reports[0]["results"] = {int(k): v for k, v in reports[0]["results"].items()}
    return reports


def check_against_tp1(family: str, requests, reports: list[dict]) -> None:
    expected, tp1_preemptions = tp1_tokens(family, requests)
    leader = reports[0]
    assert tp1_preemptions > 0 and leader["preemptions"] > 0, "the cache must be small enough to preempt"
    assert leader["swapped_out"] == leader["swapped_in"] == leader["preemptions"], "every preemption swaps"
    assert leader["results"] == expected
    assert leader["free_blocks"] == NUM_BLOCKS
    assert all(report["steps"] == leader["steps"] for report in reports[1:]), "a worker missed a step"
    assert all(report["swapped_left"] == 0 for report in reports[1:]), "a worker kept a host copy"


# -- TP = 2 and 4 against TP = 1 ----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_tp2_matches_tp1(tmp_path, family):
    """Two ranks (Qwen2: biased q/k/v; Mistral and Qwen2: a sliding window): TP = 1's tokens."""
    requests = tp_workload(seed=40 + len(family))
    check_against_tp1(family, requests, run_tp(tmp_path, 2, Scenario(family, requests)))


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 1 << 16), world_size=st.sampled_from([2, 4]), family=st.sampled_from(["llama", "qwen2"]),
       max_batch_tokens=st.integers(1, 48), block_size=st.sampled_from([1, 3, 4, 16]), num_blocks=st.integers(24, 64))
def test_random_budgets_match_tp1(tmp_path_factory, seed, world_size, family, max_batch_tokens, block_size,
                                  num_blocks):
    """Any token budget, block size and cache size at TP = 2 or 4: TP = 1's tokens, and every
    worker ran every step."""
    requests = workload(seed, count=5, longest=20, max_new=12)
    num_blocks = max(num_blocks, -(-(20 + 12) // block_size))
    shape = {"num_blocks": num_blocks, "block_size": block_size, "max_batch_tokens": max_batch_tokens}
    reports = run_tp(tmp_path_factory.mktemp("tp"), world_size, Scenario(family, requests, **shape))
    assert reports[0]["results"] == tp1_tokens(family, requests, **shape)[0]
    assert reports[0]["free_blocks"] == num_blocks
    assert all(report["steps"] == reports[0]["steps"] for report in reports[1:])


@pytest.mark.slow
def test_tp4_matches_tp1_with_replicated_kv_heads(tmp_path):
    """Four ranks over a model of 2 KV heads: each rank keeps one query head and one KV head,
    each KV head on two ranks."""
    assert plan_shard(model_config(), 3, 4).num_kv_heads == 1
    requests = tp_workload(seed=44)
    check_against_tp1("llama", requests, run_tp(tmp_path, 4, Scenario("llama", requests)))


@pytest.mark.slow
def test_tp2_over_elastic_kvcached_matches_tp1(tmp_path):
    """kvcached's TP mode: rank 0's manager maps every block on both ranks; at step 6 the limit
    drops to one page id (16 blocks on each rank), requests are preempted and swapped out, and the tokens are
    still TP = 1's. A block the worker's rank did not map would fault on the worker."""
    requests = [(0, prompt, 24) for _, prompt, _ in tp_workload(seed=46)]
    reports = run_tp(tmp_path, 2, Scenario("llama", requests, elastic=True, limit_pages_at=(6, 1)))
    leader = reports[0]
    assert leader["results"] == tp1_tokens("llama", requests)[0]
    assert leader["preemptions"] > 0 and leader["allocated"] == 0
    assert leader["swapped_out"] == leader["swapped_in"] == leader["preemptions"]
    assert leader["mapped"] <= leader["limit"]
    assert reports[1]["steps"] == leader["steps"]


@pytest.mark.slow
def test_tp2_moves_blocks_on_every_rank(tmp_path, budget_name):
    """Under a fair budget at TP = 2 the leader empties pages by moving blocks (FitLimit): every
    rank copies them before the old pages go, so the tokens are still TP = 1's. A worker that
    did not copy would read stale K/V, one that still read an unmapped page would fault."""
    requests = workload(seed=11, count=24, longest=20, max_new=40)
    reports = run_tp(tmp_path, 2, Scenario("llama", requests, elastic=True, budget=budget_name))
    leader = reports[0]
    seen = leader["squeeze"]
    assert seen["moved"] > 0 and seen["preempted_after"] == seen["preempted"], seen
    assert seen["after"] <= seen["limit"] < seen["mapped"], seen
    assert leader["results"] == tp1_tokens("llama", requests, num_blocks=ELASTIC_BLOCKS)[0]
    assert reports[1]["steps"] == leader["steps"]


@pytest.mark.slow
def test_tp2_recomputes_what_a_worker_could_not_swap(tmp_path):
    """Rank 1's host copies fail at some swap-outs and one swap-in: those preemptions are
    recomputed (the leader drops its own copy), the failed swap-in raises from its step and the
    next step recomputes the request; the tokens are still TP = 1's, every worker ran every step."""
    requests = tp_workload(seed=43)
    reports = run_tp(tmp_path, 2, Scenario("llama", requests, worker_fails=((0, 2), (1,))))
    leader = reports[0]
    assert leader["results"] == tp1_tokens("llama", requests)[0]
    assert leader["failed_steps"] == 1
    assert 0 < leader["swapped_in"] < leader["swapped_out"] < leader["preemptions"]
    assert leader["free_blocks"] == NUM_BLOCKS and reports[1]["steps"] == leader["steps"]
    assert reports[1]["swapped_left"] == 0


@pytest.mark.slow
def test_tp2_without_swapping_recomputes(tmp_path):
    """swap_bytes=0 at TP = 2: every preemption is recomputed, the tokens are TP = 1's."""
    requests = tp_workload(seed=42)
    leader = run_tp(tmp_path, 2, Scenario("llama", requests, swap_bytes=0))[0]
    assert leader["preemptions"] > 0 and leader["swapped_out"] == 0
    assert leader["results"] == tp1_tokens("llama", requests)[0]


@pytest.mark.slow
def test_leader_failing_between_steps_stops_the_workers(tmp_path):
    """An exception in rank 0's loop between steps (here a client callback) leaves the with
    block, whose close() tells the workers to return: they end after the steps they were sent."""
    reports = run_tp(tmp_path, 2, Scenario("llama", tp_workload(seed=45), fail_at_step=9))
    assert reports[0]["raised"] == "failed at step 9"
    assert 0 < reports[1]["steps"] == reports[0]["steps"]


# -- the pieces, in one process ----------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 5)), min_size=1, max_size=6), seed=st.integers(0, 99))
def test_step_plan_views_give_back_what_was_packed(rows, seed):
    """Any batch of requests (new tokens, blocks): each view of the flat tensor is its list."""
    rng = torch.Generator().manual_seed(seed)
    width = max(blocks for _, blocks in rows)
    fields = {"input_ids": [], "positions": [], "slot_mapping": [], "seq_lens": [], "query_start_loc": [0],
              "logits_index": [], "block_tables": []}
    for tokens, blocks in rows:
        fields["input_ids"] += torch.randint(0, 500, (tokens,), generator=rng).tolist()
        fields["positions"] += list(range(tokens))
        fields["slot_mapping"] += torch.randint(0, 1 << 40, (tokens,), generator=rng).tolist()
        fields["seq_lens"].append(tokens + blocks)
        fields["query_start_loc"].append(fields["query_start_loc"][-1] + tokens)
        fields["logits_index"].append(fields["query_start_loc"][-1] - 1)
        fields["block_tables"].append(torch.randint(0, 1 << 31, (blocks,), generator=rng).tolist() + [0] * (width - blocks))
    plan = StepPlan.build(**fields, device="cpu")
    copy = StepPlan(plan.sizes, plan.data.clone())
    for name, values in fields.items():
        assert getattr(copy, name).tolist() == values, name
    leading_ones = next((i for i, (tokens, _) in enumerate(rows) if tokens != 1), len(rows))
    assert copy.num_decodes == leading_ones


def test_bad_splits_are_refused():
    config = model_config()                        # 4 heads, 2 KV heads, intermediate 128
    with pytest.raises(ValueError, match="num_attention_heads=4 does not divide by world_size=3"):
        plan_shard(config, 0, 3)
    with pytest.raises(ValueError, match="rank"):
        plan_shard(config, 2, 2)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 12, 3, 16
    with pytest.raises(ValueError, match="num_key_value_heads=3 and world_size=2"):
        plan_shard(config, 0, 2)
    model = shard_model(build_model(), 0, 2)
    weight = model.model.layers[0].self_attn.q_proj.weight
    with pytest.raises(ValueError, match="split already"):
        shard_model(model, 0, 2)
    assert model.model.layers[0].self_attn.q_proj.weight is weight


@pytest.fixture
def single_rank_group(tmp_path):
    """A gloo group of this process alone (TP = 1 through the tensor-parallel classes)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_tp_loop_of_one_rank_is_the_serving_loop(single_rank_group):
    """shard_model(model, 0, 1) + TensorParallelLoop alone: ServingLoop's tokens (the all-reduce
    of one rank and the plan broadcast change nothing)."""
    requests = tp_workload(seed=3)
    model = shard_model(build_model(), 0, 1)
    cache = StaticKVCache(shard_config(model.config, model.kvcached_shard), NUM_BLOCKS, block_size=BLOCK_SIZE)
    with TensorParallelLoop(model, cache, max_batch_tokens=MAX_BATCH_TOKENS) as loop:
        assert serve(loop, requests) == tp1_tokens("llama", requests)[0]
    with pytest.raises(RuntimeError, match="closed"):
        loop.add_request([1, 2], 2)
        loop.step()


def test_tp_loop_refuses_steps_after_one_failed_once_sent(single_rank_group):
    """A step that raised inside the model after its broadcast: the workers would be waiting
    inside it, so a redo (as ServingLoop does) would start collectives they do not expect.
    Every later step raises instead, naming the failure, with the requests as they were."""
    model = shard_model(build_model(), 0, 1)
    cache = StaticKVCache(shard_config(model.config, model.kvcached_shard), NUM_BLOCKS, block_size=BLOCK_SIZE)
    loop = TensorParallelLoop(model, cache, max_batch_tokens=MAX_BATCH_TOKENS)
    for _, prompt, max_new in tp_workload(seed=3):
        loop.add_request(prompt, max_new)
    loop.step()

    def fail(*_):
        raise LeaderFailure("injected after layer 1")

    handle = model.model.layers[1].register_forward_hook(fail)
    try:
        with pytest.raises(LeaderFailure):
            loop.step()
    finally:
        handle.remove()
    state = [(request.id, list(request.tokens), request.num_cached) for request in loop.running]
    for _ in range(2):
        with pytest.raises(RuntimeError, match="LeaderFailure.*unusable"):
            loop.step()
    assert [(request.id, list(request.tokens), request.num_cached) for request in loop.running] == state
    assert loop.steps_sent == 2
    loop.close()


def test_row_parallel_linear_sums_in_its_reduce_dtype(single_rank_group):
    """bfloat16 in, float32 partial sums: one rounding after the sum (bias included), which
    differs from rounding the partial output first."""
    torch.manual_seed(0)
    full = torch.nn.Linear(64, 32).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    wide = RowParallelLinear(full, slice(0, 64), reduce_dtype=torch.float32)(x)
    narrow = RowParallelLinear(full, slice(0, 64))(x)
    assert wide.dtype == narrow.dtype == torch.bfloat16
    assert torch.equal(wide, (x.float() @ full.weight.float().t() + full.bias.float()).to(torch.bfloat16))
    assert torch.equal(narrow, torch.nn.functional.linear(x, full.weight) + full.bias)
    assert not torch.equal(wide, narrow)


def test_unsplit_or_mismatched_models_are_refused(single_rank_group):
    plain = build_model()
    with pytest.raises(ValueError, match="shard_model"):
        TensorParallelLoop(plain, StaticKVCache(plain.config, 8))
    split = shard_model(build_model(), 0, 1)
    config = model_config()
    config.num_key_value_heads = 1
    with pytest.raises(ValueError, match="KV heads"):
        TensorParallelLoop(split, StaticKVCache(config, 8))
    with pytest.raises(ValueError, match="rank 0 schedules"):
        TensorParallelWorker(split, StaticKVCache(split.config, 8))
    other = shard_model(build_model(), 1, 2)
    with pytest.raises(ValueError, match="shard 1 of 2"):
        TensorParallelLoop(other, StaticKVCache(shard_config(other.config, other.kvcached_shard), 8))


# -- the benchmark's quick run -----------------------------------------------------------------

@pytest.mark.slow
def test_bench_serve_tp_quick_runs():
    """Two CPU ranks over kvcached's TP mode through the launcher; it exits 1 when float32 tokens
    differ from TP = 1's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_serve_tp.py"), "--quick", "--cache", "elastic"],
                          check=False, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TP = 1's tokens: 4 of 4" in proc.stdout


# -- GPU: NCCL between two devices ---------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("elastic", [False, True], ids=["static", "elastic"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gpu_tp2_nccl_matches_tp1(tmp_path, family, elastic):
    """float32 on two GPUs, NCCL for the plan and the all-reduces, a static cache or kvcached's
    TP mode (2 MiB pages mapped on both GPUs); the reference runs on cuda:0."""
    requests = tp_workload(seed=50)
    reports = run_tp(tmp_path, 2, Scenario(family, requests, backend="nccl", device_type="cuda", elastic=elastic))
    model = build_model(family, device="cuda:0")
    loop = ServingLoop(model, StaticKVCache(model.config, NUM_BLOCKS, block_size=BLOCK_SIZE, device="cuda:0"),
                       max_batch_tokens=MAX_BATCH_TOKENS)
    assert reports[0]["results"] == serve(loop, requests)
    assert reports[0]["preemptions"] > 0
    assert reports[1]["steps"] == reports[0]["steps"]
