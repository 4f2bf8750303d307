"""vLLM's Scheduler over vLLM's own BlockPool and over kvcached's ElasticBlockPool, on a CPU.

    python benchmarks/bench_vllm_scheduler.py [--steps N] [--rounds R] [--num-blocks B] [--no-lockstep]
                                              [--json PATH] [--quick]

Needs vLLM 0.32 or 0.33 (a venv that .ci/vllm_env.sh builds). No model runs: after each ``schedule()`` the
benchmark hands ``update_from_output()`` a ModelRunnerOutput with one sampled token for every
request whose prefill is complete, as a model runner would, so requests prefill (chunked), decode
and finish. The request stream is seeded and identical for both pools: arrivals rise, peak and
stop (the last 40 % of the steps drain), prompts share one of a few system prompts (prefix
caching on by default) and have a random suffix, outputs have random lengths.

Measured over R rounds, each on a fresh Scheduler per pool; within a round the two pools run in
lockstep, step i of one then step i of the other (which goes first alternates every step), so
load from other processes falls on both alike (--no-lockstep: one pool's pass, then the other's):
  time per step       schedule() and update_from_output(), µs, median and p90 over the steps
                      of all rounds, and over each step's best round (the steps are the same in
                      every round); ratio kvcached / stock (the goal: within 5 %)
  memory over time    vLLM's pool holds num_gpu_blocks x block bytes for the whole run; kvcached
                      maps pages as blocks are taken and unmaps them as they empty
                      (manager.get_mapped_memory_size(), which includes its reserve of pages),
                      read after every step of one more, untimed, pass

The model is bench_manager's: 32 layers, 8 KV heads x 128, bf16, block_size 16 (2 MiB per block
over all layers and K and V), kvcached on the host backend with 2 MiB pages (memfd pages, never
touched, so the sizes are those of a GPU run). A benchmark, never a test.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

NUM_LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE_BYTES = 32, 8, 128, 16, 2
BLOCK_BYTES = 2 * BLOCK_SIZE * HEADS * HEAD_DIM * DTYPE_BYTES * NUM_LAYERS     # K and V, all layers
HOST_CAPACITY = 1 << 45                 # host backend: slots only, never touched
VOCAB = 32000
SAMPLED_TOKEN = 7                       # never the EOS token; requests stop on max_tokens


@dataclass(frozen=True)
class Arrival:
    step: int
    prompt: tuple[int, ...]
    max_tokens: int


def request_stream(steps: int, peak_rate: float, seed: int) -> list[Arrival]:
    """Arrivals over the first 60 % of the steps at a rate rising and falling as a half sine."""
    rng = random.Random(seed)
    system_prompts = [tuple(rng.randrange(VOCAB) for _ in range(rng.choice((128, 256, 384)))) for _ in range(6)]
    arrival_steps = int(steps * 0.6)
    arrivals = []
    for step in range(arrival_steps):
        rate = peak_rate * math.sin(math.pi * (step + 0.5) / arrival_steps)
        for _ in range(_poisson(rng, rate)):
            prefix = rng.choice(system_prompts) if rng.random() < 0.7 else ()
            suffix = tuple(rng.randrange(VOCAB) for _ in range(rng.randint(16, 768)))
            arrivals.append(Arrival(step, prefix + suffix, rng.randint(16, 320)))
    return arrivals


def _poisson(rng: random.Random, rate: float) -> int:
    limit, k, p = math.exp(-rate), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


# -- vLLM side ------------------------------------------------------------------------------------


def make_config(model_dir: Path, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int,
                prefix_caching: bool):
    """A VllmConfig and a one-group KVCacheConfig for the model, as the engine would build them."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                               max_model_len=4096)
    scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                       max_model_len=4096, enable_chunked_prefill=True, async_scheduling=False,
                                       is_encoder_decoder=False)
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching)
    cache_config.num_gpu_blocks = num_blocks
    vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                             cache_config=cache_config)
    register_all_kvcache_specs(vllm_config)
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
    assert spec.page_size_bytes * NUM_LAYERS == BLOCK_BYTES
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.self_attn" for i in range(NUM_LAYERS)], spec)])
    return vllm_config, kv_cache_config


def write_model_dir(path: Path) -> Path:
    """config.json of a Llama-shaped model with bench_manager's KV geometry (no weights needed)."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * HEAD_DIM * 4,
              "intermediate_size": 14336, "num_hidden_layers": NUM_LAYERS, "num_attention_heads": HEADS * 4,
              "num_key_value_heads": HEADS, "head_dim": HEAD_DIM, "max_position_embeddings": 8192,
              "vocab_size": VOCAB, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "rope_theta": 500000.0}
    (path / "config.json").write_text(json.dumps(config))
    return path


@dataclass
class RoundResult:
    pool: str
    schedule_ns: list[int]
    update_ns: list[int]
    running: list[int]
    blocks_used: list[int]
    mapped: list[int]           # bytes kvcached has mapped after each step (stock: what it holds)
    tokens: int                 # tokens scheduled over the stream: both pools must schedule the same
    preemptions: int
    stock_bytes: int            # what vLLM's pool holds all along: num_gpu_blocks x block bytes


class SchedulerRun:
    """One pass of the stream through a fresh Scheduler whose pool is vLLM's or ours, one engine
    step per step() call, so that two runs can go in lockstep; with sample_memory, the pool's
    occupancy and mapped memory after every step (for a separate pass: reading kvcached's page
    counters between the timed calls would disturb them)."""

    def __init__(self, pool: str, configs, arrivals: list[Arrival], steps: int, sample_memory: bool = False):
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from kvcached.integration import vllm as kvcached_vllm

        vllm_config, kv_cache_config = configs
        if pool == "kvcached":
            kvcached_vllm.set_pool_geometry(kvcached_vllm.PoolGeometry(
                block_size=BLOCK_SIZE, cell_size=HEADS * HEAD_DIM * DTYPE_BYTES, num_layers=NUM_LAYERS))
            kvcached_vllm.enable(worker=False)
        try:
            self.scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                                       structured_output_manager=StructuredOutputManager(vllm_config),
                                       block_size=BLOCK_SIZE, log_stats=False)
        finally:
            kvcached_vllm.disable()
            kvcached_vllm.set_pool_geometry(None)
        self.block_pool = self.scheduler.kv_cache_manager.block_pool
        self.manager = getattr(self.block_pool, "manager", None)
        assert (self.manager is not None) == (pool == "kvcached"), \
            f"{pool} round built {type(self.block_pool).__name__}"
        self.num_blocks = kv_cache_config.num_blocks
        self.hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self.result = RoundResult(pool, [], [], [], [], [], 0, 0, self.num_blocks * BLOCK_BYTES)
        self.pending = iter(enumerate(arrivals))
        self.upcoming = next(self.pending, (None, None))
        self.steps, self.step_index, self.sample_memory = steps, 0, sample_memory
        self.done = False

    def step(self) -> None:
        """One engine step: admit this step's arrivals, then the timed schedule() and
        update_from_output(). Sets done at the end of the stream (the pool is closed then)."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request

        scheduler, result = self.scheduler, self.result
        index, upcoming = self.upcoming
        while upcoming is not None and upcoming.step <= self.step_index:
            params = SamplingParams(max_tokens=upcoming.max_tokens, ignore_eos=True)
            scheduler.add_request(Request(str(index), list(upcoming.prompt), params, None, block_hasher=self.hasher))
            index, upcoming = next(self.pending, (None, None))
        self.upcoming = (index, upcoming)
        t0 = time.perf_counter_ns()
        output = scheduler.schedule()
        t1 = time.perf_counter_ns()
        req_ids = list(output.num_scheduled_tokens)
        requests = scheduler.requests
        sampled = [[SAMPLED_TOKEN] if requests[r].num_computed_tokens >= requests[r].num_tokens else []
                   for r in req_ids]
        runner_output = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                          sampled_token_ids=sampled)
        t2 = time.perf_counter_ns()
        scheduler.update_from_output(output, runner_output)
        t3 = time.perf_counter_ns()
        result.schedule_ns.append(t1 - t0)
        result.update_ns.append(t3 - t2)
        result.tokens += output.total_num_scheduled_tokens
        result.preemptions += len(output.preempted_req_ids or ())
        if self.sample_memory:
            result.running.append(len(scheduler.running))
            result.blocks_used.append(self.num_blocks - 1 - self.block_pool.get_num_free_blocks())
            result.mapped.append(self.num_blocks * BLOCK_BYTES if self.manager is None
                                 else self.manager.get_mapped_memory_size())
        self.step_index += 1
        if self.step_index >= self.steps or (upcoming is None and not scheduler.has_requests()):
            self.done = True
            if self.manager is not None:
                self.block_pool.close()


def run_round(pool: str, configs, arrivals: list[Arrival], steps: int, sample_memory: bool = False) -> RoundResult:
    """One pool's pass of the stream by itself."""
    run = SchedulerRun(pool, configs, arrivals, steps, sample_memory)
    gc.collect()
    while not run.done:
        run.step()
    return run.result


def run_lockstep(first: str, second: str, configs, arrivals: list[Arrival], steps: int) -> list[RoundResult]:
    """The two pools' passes in lockstep: step i of one, then step i of the other, so that both
    see the same interference from the rest of the machine (the schedules are the same). The
    pool that goes first alternates every step: the second runs vLLM's code with warmer caches."""
    runs = [SchedulerRun(pool, configs, arrivals, steps) for pool in (first, second)]
    gc.collect()
    while not all(run.done for run in runs):
        for run in runs:
            if not run.done:
                run.step()
        runs.reverse()
    return [run.result for run in (runs if runs[0].result.pool == first else runs[::-1])]


# -- report ---------------------------------------------------------------------------------------


def _pct(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timing_rows(results: list[RoundResult]) -> list[dict]:
    """Median and p90 over the steps, of all rounds and of each step's best round.

    Every round runs the same steps (the schedules are checked identical), so the fastest of the
    R runs of a step is that step's cost with the least interference from other processes: the
    "best of rounds" rows are the comparison to trust on a busy machine."""
    rows = []
    for name, pick in (("schedule()", lambda r: r.schedule_ns), ("update_from_output()", lambda r: r.update_ns),
                       ("step (both)", lambda r: [a + b for a, b in zip(r.schedule_ns, r.update_ns)])):
        for over in ("all rounds", "best of rounds"):
            row = {"measure": name, "over": over}
            for pool in ("stock", "kvcached"):
                runs = [pick(r) for r in results if r.pool == pool]
                values = [v for run in runs for v in run] if over == "all rounds" else [min(v) for v in zip(*runs)]
                row[pool] = {"median_us": statistics.median(values) / 1e3, "p90_us": _pct(values, 0.9) / 1e3}
            row["ratio_median"] = row["kvcached"]["median_us"] / row["stock"]["median_us"]
            row["ratio_p90"] = row["kvcached"]["p90_us"] / row["stock"]["p90_us"]
            rows.append(row)
    return rows


def memory_rows(ours: RoundResult, samples: int) -> list[dict]:
    n = len(ours.mapped)
    picks = sorted({min(n - 1, round(i * (n - 1) / (samples - 1))) for i in range(samples)})
    return [{"step": i, "running": ours.running[i], "blocks_used": ours.blocks_used[i],
             "in_use_bytes": ours.blocks_used[i] * BLOCK_BYTES, "stock_bytes": ours.stock_bytes,
             "kvcached_bytes": ours.mapped[i]} for i in picks]


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f}"


def print_report(timing: list[dict], memory: list[dict], ours: RoundResult, meta: dict) -> None:
    print(f"\nvLLM {meta['vllm']} Scheduler, {meta['steps_run']} steps, {meta['requests']} requests, "
          f"{meta['rounds']} rounds per pool ({'in lockstep' if meta['lockstep'] else 'one pool after the other'}), prefix caching {meta['prefix_caching']}, "
          f"num_gpu_blocks {meta['num_blocks']} x {BLOCK_BYTES >> 20} MiB; "
          f"{meta['date']}, commit {meta['commit']}, {meta['machine']}, load average "
          f"{meta['load_average'][0]:.2f} before the timed rounds, {meta['load_average'][1]:.2f} after")
    print(f"\n{'time per step (µs)':<38}{'stock median':>14}{'p90':>9}{'kvcached median':>17}{'p90':>9}"
          f"{'ratio median':>14}{'p90':>8}")
    for row in timing:
        s, k = row["stock"], row["kvcached"]
        label = f"{row['measure']}, {row['over']}"
        print(f"{label:<38}{s['median_us']:>14.1f}{s['p90_us']:>9.1f}{k['median_us']:>17.1f}"
              f"{k['p90_us']:>9.1f}{row['ratio_median']:>14.3f}{row['ratio_p90']:>8.3f}")
    print(f"\n{'step':>6}{'running':>9}{'blocks used':>13}{'KV in use GiB':>15}{'stock holds GiB':>17}"
          f"{'kvcached mapped GiB':>21}")
    for row in memory:
        print(f"{row['step']:>6}{row['running']:>9}{row['blocks_used']:>13}{_gib(row['in_use_bytes']):>15}"
              f"{_gib(row['stock_bytes']):>17}{_gib(row['kvcached_bytes']):>21}")
    mean_ours = statistics.fmean(ours.mapped)
    print(f"{'mean':>6}{'':>9}{statistics.fmean(ours.blocks_used):>13.0f}"
          f"{_gib(statistics.fmean(ours.blocks_used) * BLOCK_BYTES):>15}{_gib(ours.stock_bytes):>17}{_gib(mean_ours):>21}")
    print(f"{'peak':>6}{max(ours.running):>9}{max(ours.blocks_used):>13}{_gib(max(ours.blocks_used) * BLOCK_BYTES):>15}"
          f"{_gib(ours.stock_bytes):>17}{_gib(max(ours.mapped)):>21}")
    print(f"\nkvcached maps {mean_ours / ours.stock_bytes:.1%} of the stock pool's memory on average over the stream "
          f"(peak {max(ours.mapped) / ours.stock_bytes:.1%}); schedules identical: {meta['identical']}")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2400, help="engine steps of the stream (default 2400)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per pool, interleaved (default 3)")
    parser.add_argument("--num-blocks", type=int, default=8192, help="num_gpu_blocks (default 8192 = 16 GiB)")
    parser.add_argument("--peak-rate", type=float, default=0.5, help="peak arrivals per step (default 0.5)")
    parser.add_argument("--prefix-caching", choices=("on", "off"), default="on",
                        help="vLLM's prefix caching (default on): cached blocks stay mapped until evicted")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--quick", action="store_true", help="a short stream, one round (smoke test)")
    parser.add_argument("--lockstep", action=argparse.BooleanOptionalAction, default=True,
                        help="alternate the pools step by step within a round (default) rather than "
                             "round by round: on a busy machine both then see the same interference")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds, args.num_blocks = 200, 1, 2048

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import vllm
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from kvcached import init_kvcached
    from kvcached.integration.vllm import check_vllm_version

    check_vllm_version()
    init_kvcached(device="cpu", host_capacity_bytes=HOST_CAPACITY)
    init_none_hash(sha256)
    arrivals = request_stream(args.steps, args.peak_rate, args.seed)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        configs = make_config(write_model_dir(Path(tmp)), args.num_blocks, max_num_seqs=128,
                              max_num_batched_tokens=2048, prefix_caching=args.prefix_caching == "on")
        run_round("stock", configs, arrivals[:4], 20)          # warm-up: imports and first-call costs
        run_round("kvcached", configs, arrivals[:4], 20)
        results = []
        for r in range(args.rounds):
            order = ("stock", "kvcached") if r % 2 == 0 else ("kvcached", "stock")
            if args.lockstep:
                results += run_lockstep(*order, configs, arrivals, args.steps)
            else:
                results += [run_round(pool, configs, arrivals, args.steps) for pool in order]
        load_after = os.getloadavg()[0]
        ours = run_round("kvcached", configs, arrivals, args.steps, sample_memory=True)
    stock = next(r for r in results if r.pool == "stock")
    identical = all((r.tokens, len(r.schedule_ns), r.preemptions) == (stock.tokens, len(stock.schedule_ns),
                                                                     stock.preemptions) for r in results + [ours])
    meta = {"vllm": vllm.__version__, "prefix_caching": args.prefix_caching, "steps_run": len(stock.schedule_ns),
            "requests": len(arrivals),
            "rounds": args.rounds, "lockstep": args.lockstep, "num_blocks": args.num_blocks, "block_bytes": BLOCK_BYTES,
            "tokens": stock.tokens, "preemptions": stock.preemptions, "identical": identical,
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": _commit(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
            "load_average": [round(load_before, 2), round(load_after, 2)]}
    timing = timing_rows(results)
    memory = memory_rows(ours, samples=13)
    print_report(timing, memory, ours, meta)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "timing": timing, "memory": memory}, indent=2) + "\n")
    if not identical:
        sys.exit("the two pools scheduled different work: the comparison is void")


if __name__ == "__main__":
    main()
