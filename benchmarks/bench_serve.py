"""Serving benchmark: the kvcached.serving loop over kvcached memory against the same loop over a
static torch cache, transformers' own continuous batching as the anchor, and the elastic handover.

    python benchmarks/bench_serve.py            # CUDA: Llama-3-8B-shaped model, bf16, batch 1-256
    python benchmarks/bench_serve.py --quick    # tiny model on the CPU (the smoke test runs this)
    python benchmarks/bench_serve.py --skip handover --requests 256 --prompt 512 --new 256 \
        --json benchmarks/results/serve-h200.json                   # the end-to-end target run

Every loop runs in the modes --modes lists: "eager" (every step a plain model call), "graphs"
(decode-only steps replay a CUDA graph per padded batch size; on the CPU the same padded runner
without capture), "compiled" (graphs, over torch.compile's program of the model: every step
compiled, the small ops fused; its first steps compile) and "overlap" (compiled, each decode step
launched before the last one's tokens are read: Note [Steps ahead] in kvcached.serving.loop; the
loop's default on CUDA, turned off in the other modes).
Prints three tables:
1. decode step: time per decode step of `batch` requests (every request one new token, contexts
   of --prompt tokens), --steps steps back to back with one device sync at the end, divided by
   --steps (a step launched ahead finishes inside the next call), the median over the rounds;
   static cache vs kvcached in alternating rounds, each mode; tokens/s = batch / step time, and
   the host time of a step outside its model call (the step() call's time less the launch of the
   model call or graph replay and the wait for the device's tokens); with --profile (CUDA) also
   the device's busy time per step, split into GEMMs, kvcached's kernels and the rest, beside the
   span from its first kernel to its last: the step's floor under these kernels;
2. end to end: --requests requests of --prompt + --new tokens, greedy, tokens/s of the loop over
   each cache in each mode and of ``model.generate_batch`` (transformers' paged cache with its
   built-in sdpa attention, on the same weights) where this transformers runs it;
3. handover: two processes, each serving the same model through the loop, share one global
   budget; the load moves from one to the other and back. Times from the shift to the losing
   instance having unmapped its memory, and to the receiving one having mapped most of the budget.
"""

from __future__ import annotations

import argparse
import inspect
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

BLOCK_SIZE = 16
# the end-to-end warm-up serves the whole run's prompts with this many new tokens: every prefill
# and mixed step shape the timed run meets is compiled before it (a compiled model recompiles
# for a new shape class, seconds each; an engine does that at start-up)
WARMUP_NEW_TOKENS = 4
PROFILE_STEPS = 4               # decode steps under torch.profiler per decode row (--profile)
# ServingLoop's options per mode
MODES = {"eager": {"cuda_graphs": False}, "graphs": {"cuda_graphs": True, "overlap": False},
         "compiled": {"cuda_graphs": True, "compile_model": True, "overlap": False},
         "overlap": {"cuda_graphs": True, "compile_model": True, "overlap": True}}


def mixed_prompt(setup) -> int:
    """The prompt a mixed step prefills beside the decoding batch: 512 tokens (4 prompts' worth
    on the CPU's quick run)."""
    return min(512, 4 * setup.prompt)


@dataclass
class Setup:
    device: str
    preset: str
    dtype: torch.dtype
    batches: list[int]
    prompt: int
    steps: int
    rounds: int
    requests: int
    new: int
    page_bytes: int | None          # None: the default (KVCACHED_PAGE_SIZE_MB)
    budget_pages: int
    threads: int | None
    modes: tuple[str, ...] = ("eager", "graphs")
    batch_tokens: int = 4096        # the end-to-end loops' max_batch_tokens
    profile: bool = False           # decode rows: the device's busy time per step (CUDA)


def setup_from(args) -> Setup:
    modes = tuple(args.modes.split(","))
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        raise SystemExit(f"--modes {args.modes}: {', '.join(unknown)} unknown; use a comma list of {', '.join(MODES)}")
    if args.quick:
        return Setup("cpu", "tiny", torch.float32, [1, 4], 8, 3, 2, 4, 8, 64 << 10, 16, 1, modes)
    cuda = torch.cuda.is_available() and args.device != "cpu"
    batches = [int(b) for b in args.batches.split(",")]
    if cuda:
        return Setup("cuda:0", "llama3-8b", torch.bfloat16, batches, args.prompt, args.steps, args.rounds,
                     args.requests, args.new, None, args.budget_pages, None, modes)
    return Setup("cpu", "tiny", torch.float32, batches, args.prompt, args.steps, args.rounds, args.requests,
                 args.new, 64 << 10, args.budget_pages, 1, modes)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(count)]


def blocks_for(requests: int, tokens: int) -> int:
    return requests * -(-tokens // BLOCK_SIZE)


def make_caches(model, setup: Setup, num_blocks: int):
    from kvcached import init_kvcached
    from kvcached.serving import ElasticKVCache, StaticKVCache

    init_kvcached(device=setup.device, page_size_bytes=setup.page_bytes)
    static = StaticKVCache(model.config, num_blocks, block_size=BLOCK_SIZE, dtype=setup.dtype, device=setup.device)
    elastic = ElasticKVCache(model.config, num_blocks, block_size=BLOCK_SIZE, dtype=setup.dtype, device=setup.device)
    return {"static": static, "kvcached": elastic}


# -- 1. decode step ------------------------------------------------------------------------------

def decode_step_times(model, cache, setup: Setup, batch: int, mode: str) -> tuple[list[tuple[float, float]], dict]:
    """(seconds, host seconds outside the model call) of each of setup.steps decode steps of
    `batch` requests (after prefill and 2 warm-up steps, which capture the batch's graph), and
    with setup.profile the device_profile of PROFILE_STEPS more steps (else {}). The
    steps run back to back and the device is synchronised once, after the last: with overlap a
    step launched ahead finishes inside the next call, so a sync before each step would absorb
    its device time. The seconds are the total, final sync included, / setup.steps (the
    steady-state time per step, the same in every mode); the host seconds are each call's own."""
    from kvcached.serving import ServingLoop

    warmup = 2
    profiled = PROFILE_STEPS if setup.profile else 0
    new = 1 + warmup + setup.steps + profiled
    loop = ServingLoop(model, cache, max_batch_tokens=max(setup.prompt * batch, 1), max_running=batch,
                       max_tokens=setup.prompt + new, **MODES[mode])
    try:
        for prompt in prompts(batch, setup.prompt, model.config.vocab_size, seed=batch):
            loop.add_request(prompt, new)
        while loop.stats.generated_tokens < batch:      # prefill: every request has its first token
            loop.step()
        for _ in range(warmup):
            loop.step()
        host = []
        sync(setup.device)
        first = time.perf_counter()
        for _ in range(setup.steps):
            start = time.perf_counter()
            loop.step()                                 # with overlap, returns with its step still running
            elapsed = time.perf_counter() - start
            s = loop.stats
            host.append(elapsed - s.last_forward_s - s.last_wait_s)
        sync(setup.device)
        step = (time.perf_counter() - first) / setup.steps
        profile = device_profile(loop.step, profiled) if profiled else {}
        assert not loop.has_work(), loop.stats
        assert mode == "eager" or loop.stats.runner_steps >= setup.steps, loop.stats
        return [(step, h) for h in host], profile
    finally:
        loop.close()


def device_profile(step, steps: int) -> dict:
    """Milliseconds per step of `steps` calls of step() under torch.profiler (CUDA): the device's
    busy time (kernels and copies, those inside CUDA graphs included), split into cuBLAS GEMMs,
    kvcached's attention kernels (write, decode, combine, prefill) and the rest, and the span from
    the first kernel's start to the last one's end. A busy time close to the step time says the
    step runs at the device's pace: only fewer or faster kernels make it shorter."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for start, end, name in spans:
        busy[_kernel_group(name)] += end - start
    per_step = {f"{group}_ms": us / steps / 1e3 for group, us in busy.items()}
    per_step["busy_ms"] = sum(busy.values()) / steps / 1e3
    per_step["span_ms"] = (max(e for _, e, _ in spans) - min(s for s, _, _ in spans)) / steps / 1e3 if spans else 0.0
    return per_step


def _kernel_group(name: str) -> str:
    """gemm (cuBLAS's kernels and its split-K reduction), attention (kvcached.ops' kernels) or other."""
    lowered = name.lower()
    if any(word in lowered for word in ("gemm", "nvjet", "cutlass", "splitkreduce")):
        return "gemm"
    if name.startswith(("_write_kernel", "_decode_kernel", "_combine_kernel", "_prefill_kernel")):
        return "attention"
    return "other"


def mixed_step_times(model, cache, setup: Setup, batch: int, mode: str) -> list[tuple[float, float, float]]:
    """(seconds, launch seconds, wait seconds) of setup.steps mixed steps: `batch` requests
    decoding and one new request's whole mixed_prompt(setup)-token prompt prefilled in the same
    step (the normal step of continuous batching; eager in every mode, the decode requests'
    graphs cannot take a prefill). The launch is the host time of the model call, the wait the
    time the step then waited for its tokens: a step whose wait is near 0 is bound by the host."""
    from kvcached.serving import ServingLoop

    new = 3 + 2 * setup.steps
    loop = ServingLoop(model, cache, max_batch_tokens=max(setup.prompt * batch, batch + mixed_prompt(setup) + setup.steps),
                       max_running=batch + setup.steps, max_tokens=max(setup.prompt, mixed_prompt(setup)) + new,
                       **MODES[mode])
    try:
        for prompt in prompts(batch, setup.prompt, model.config.vocab_size, seed=batch):
            loop.add_request(prompt, new)
        while loop.stats.generated_tokens < batch:      # prefill: every request has its first token
            loop.step()
        loop.step()
        joining = prompts(setup.steps + 1, mixed_prompt(setup), model.config.vocab_size, seed=-batch)
        loop.add_request(joining[-1], 2)
        loop.step()                                     # warm-up: the kernels of a mixed step compiled
        times = []
        for prompt in joining[:-1]:
            loop.add_request(prompt, 2)
            sync(setup.device)
            start = time.perf_counter()
            loop.step()
            times.append((time.perf_counter() - start, loop.stats.last_forward_s, loop.stats.last_wait_s))
            assert loop.stats.step_tokens >= mixed_prompt(setup), loop.stats
        return times
    finally:
        for request in [*loop.running, *loop.waiting]:
            loop.abort(request.id)
        loop.close()


def bench_decode(model, caches, setup: Setup) -> list[dict]:
    """Per batch size, setup.rounds rounds alternating the order of the runs (host-side drift
    falls on all), the median over the rounds' time per step and over every timed step's host
    time of a cache and mode."""
    rows = []
    names = [(cache, mode) for mode in setup.modes for cache in caches]
    for batch in setup.batches:
        times: dict[tuple[str, str], list[tuple[float, float]]] = {name: [] for name in names}
        profiles: dict[tuple[str, str], dict] = {}
        for round_ in range(setup.rounds):
            for cache, mode in names if round_ % 2 == 0 else names[::-1]:
                steps, profiles[cache, mode] = decode_step_times(model, caches[cache], setup, batch, mode)
                times[cache, mode] += steps
        for (cache, mode), t in times.items():
            mixed, launches, waits = zip(*mixed_step_times(model, caches[cache], setup, batch, mode))
            row = {"batch": batch, "cache": cache, "mode": mode, "step_s": statistics.median(x for x, _ in t),
                   "host_outside_s": statistics.median(h for _, h in t), "mixed_step_s": statistics.median(mixed),
                   "mixed_launch_s": statistics.median(launches), "mixed_wait_s": statistics.median(waits),
                   "device": profiles[cache, mode]}
            rows.append(row)
            print(f"  batch {batch}: {cache} {mode} {row['step_s'] * 1e3:.2f} ms "
                  f"(host outside the model call {row['host_outside_s'] * 1e3:.3f} ms); with a {mixed_prompt(setup)}-token "
                  f"prefill joined {row['mixed_step_s'] * 1e3:.2f} ms (launch {row['mixed_launch_s'] * 1e3:.2f}, "
                  f"wait {row['mixed_wait_s'] * 1e3:.2f})", flush=True)
            if row["device"]:
                d = row["device"]
                print(f"    device per decode step (last round): busy {d['busy_ms']:.2f} ms (GEMMs {d['gemm_ms']:.2f}, "
                      f"kvcached's kernels {d['attention_ms']:.2f}, other {d['other_ms']:.2f}), first kernel to "
                      f"last {d['span_ms']:.2f} ms", flush=True)
    return rows


def print_decode(rows: list[dict], setup: Setup) -> None:
    profiled = any(r["device"] for r in rows)
    device = " device busy ms (GEMMs / kvcached / other) | first to last kernel ms |" if profiled else ""
    print(f"\n| batch | cache | mode | ms/step | tok/s | host ms outside the model call | ms/step with a "
          f"{mixed_prompt(setup)}-token prefill joined | its launch ms | its wait ms |{device}")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if profiled else ""))
    for r in rows:
        d = r["device"]
        busy = (f" {d['busy_ms']:.2f} ({d['gemm_ms']:.2f} / {d['attention_ms']:.2f} / {d['other_ms']:.2f}) | "
                f"{d['span_ms']:.2f} |" if d else " | |") if profiled else ""
        print(f"| {r['batch']} | {r['cache']} | {r['mode']} | {r['step_s'] * 1e3:.2f} | {r['batch'] / r['step_s']:.0f} | "
              f"{r['host_outside_s'] * 1e3:.3f} | {r['mixed_step_s'] * 1e3:.2f} | {r['mixed_launch_s'] * 1e3:.2f} | "
              f"{r['mixed_wait_s'] * 1e3:.2f} |{busy}")


# -- 2. end to end, with transformers' continuous batching as the anchor --------------------------

def run_loop(model, cache, work: list[list[int]], new: int, mode: str, batch_tokens: int) -> tuple[float, dict, dict]:
    """(seconds, tokens by request, stats) of one loop serving `work` to the end; the stats
    split the time between the padded decode steps and the others (prefill and mixed)."""
    from kvcached.serving import ServingLoop

    loop = ServingLoop(model, cache, max_batch_tokens=batch_tokens, max_running=len(work),
                       max_tokens=max(map(len, work)) + new, **MODES[mode])
    try:
        ids = {loop.add_request(prompt, new): index for index, prompt in enumerate(work)}
        loop.capture_graphs()                           # at start-up, as an engine does (CUDA only)
        sync(str(next(model.parameters()).device))
        results = {}
        decode_s = 0.0
        start = time.perf_counter()
        while loop.has_work():
            began, runner_steps = time.perf_counter(), loop.stats.runner_steps
            for request in loop.step():
                results[ids[request.id]] = request.generated
            if loop.stats.runner_steps != runner_steps:
                decode_s += time.perf_counter() - began
        seconds = time.perf_counter() - start
        s = loop.stats
        return seconds, results, {"steps": s.steps, "runner_steps": s.runner_steps, "graph_replays": s.graph_replays,
                                  "preemptions": s.preemptions, "decode_s": decode_s, "steps_ahead": s.steps_ahead}
    finally:
        loop.close()


def run_generate_batch(model, work: list[list[int]], new: int, setup: Setup) -> tuple[float | None, str]:
    """transformers' continuous batching on the same weights with its built-in sdpa attention
    (it accepts only its own attention names). Returns (seconds or None, note)."""
    from transformers import GenerationConfig

    from kvcached.serving import ATTENTION_NAME

    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    kwargs = {}
    if "continuous_batching_config" in inspect.signature(model.generate_batch).parameters:
        from transformers import ContinuousBatchingConfig

        defaults = ContinuousBatchingConfig()
        # tokens per block there: page_size (5.2x), block_size, else its 256-token blocks
        page = getattr(defaults, "page_size", None) or getattr(defaults, "block_size", None) or 256
        sizing = {"num_blocks": len(work) * -(-(setup.prompt + new) // page) + 64, "max_batch_tokens": setup.batch_tokens}
        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(**sizing)
    model.set_attn_implementation("sdpa")
    try:
        model.generate_batch(work[:1], generation_config=config, **kwargs)     # warm-up, graphs if any
        sync(setup.device)
        start = time.perf_counter()
        out = model.generate_batch(work, generation_config=config, **kwargs)
        sync(setup.device)
        seconds = time.perf_counter() - start
        done = sum(len(o.generated_tokens) for o in out.values())
        return seconds, f"transformers {_transformers_version()}, {done} tokens"
    except Exception as exc:  # noqa: BLE001 -- reported in the table: the anchor is optional
        return None, f"did not run: {type(exc).__name__}: {str(exc)[:120]}"
    finally:
        model.set_attn_implementation(ATTENTION_NAME)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def bench_end_to_end(model, caches, setup: Setup, *, generate_batch: bool = True) -> list[dict]:
    work = prompts(setup.requests, setup.prompt, model.config.vocab_size, seed=1)
    tokens = setup.requests * setup.new
    rows = []
    outputs = {}
    for cache in caches.values():                       # warm-up: kernels compiled, allocator pools filled
        for mode in setup.modes:                        # (every prefill and mixed step shape of the run)
            run_loop(model, cache, work, WARMUP_NEW_TOKENS, mode, setup.batch_tokens)
    for mode in setup.modes:
        for name, cache in caches.items():
            seconds, outputs[name, mode], stats = run_loop(model, cache, work, setup.new, mode, setup.batch_tokens)
            rows.append({"runner": f"loop + {name}, {mode}", "tokens_per_s": tokens / seconds, "seconds": seconds,
                         "decode_s": stats["decode_s"],
                         "note": f"{seconds:.2f} s ({stats['decode_s']:.2f} s in {stats['runner_steps']} padded decode "
                                 f"steps, {stats['graph_replays']} of them graph replays, {stats['steps_ahead']} "
                                 f"launched a step ahead; "
                                 f"{stats['steps'] - stats['runner_steps']} other steps), "
                                 f"{stats['preemptions']} preemptions"})
    first = next(iter(outputs.values()))
    same = all(out == first for out in outputs.values())
    rows.append({"runner": f"(tokens identical across {', '.join('/'.join(k) for k in outputs)})",
                 "tokens_per_s": None, "note": str(same)})
    if not generate_batch:
        return rows
    seconds, note = run_generate_batch(model, work, setup.new, setup)
    rows.append({"runner": "generate_batch (paged, sdpa)", "tokens_per_s": tokens / seconds if seconds else None,
                 "seconds": seconds, "note": note})
    return rows


def print_end_to_end(rows, setup: Setup) -> None:
    print(f"\nend to end: {setup.requests} requests x ({setup.prompt} prompt + {setup.new} new) tokens, greedy, "
          f"{setup.batch_tokens} tokens per step at most")
    print("| runner | new tokens/s | note |")
    print("|---|---:|---|")
    for r in rows:
        rate = r["tokens_per_s"]
        print(f"| {r['runner']} | {'' if rate is None else f'{rate:.0f}'} | {r['note']} |")


# -- 3. elastic handover between two instances -----------------------------------------------------

@dataclass
class Shared:
    phase: object           # mp.Value("i"): which instance has the load (0 or 1; 2 none), -1 = stop
    mapped: list            # mp.Value('q') per instance: bytes mapped
    reached: list           # mp.Value('d') per instance: monotonic time its mapped memory first reached target
    released: list          # mp.Value('d') per instance: monotonic time its mapped memory first fell to <= low
    grew: list              # mp.Value('d') per instance: monotonic time its mapped memory first passed grow_from
    grow_from: list         # mp.Value('q') per instance: bytes mapped at the shift (-1: not watched)
    target: object          # mp.Value('q'): bytes a receiving instance must map
    low: object             # mp.Value('q'): bytes a losing instance must be down to
    ready: list             # mp.Event per instance


def instance(index: int, setup: Setup, env: dict, shared: Shared, requests: int, prompt: int) -> None:
    """One serving instance: take load while shared.phase names it, drop it (abort) otherwise."""
    os.environ.update(env)
    if setup.threads:
        torch.set_num_threads(setup.threads)
    from kvcached import config, init_kvcached
    from kvcached.serving import ElasticKVCache, ServingLoop, build_model

    config.reload_settings()
    model = build_model("llama", preset=setup.preset, dtype=setup.dtype, device=setup.device)
    init_kvcached(device=setup.device, page_size_bytes=setup.page_bytes)
    cache = ElasticKVCache(model.config, blocks_for(requests, prompt + 4096), block_size=BLOCK_SIZE, dtype=setup.dtype,
                           device=setup.device)
    loop = ServingLoop(model, cache, max_batch_tokens=4096, max_running=requests)
    stop = threading.Event()

    def sample() -> None:               # 0.2 ms resolution, independent of the step time
        while not stop.is_set():
            mapped = cache.mapped_bytes()
            shared.mapped[index].value = mapped
            now = time.monotonic()
            if mapped >= shared.target.value and shared.reached[index].value == 0.0:
                shared.reached[index].value = now
            if mapped <= shared.low.value and shared.released[index].value == 0.0:
                shared.released[index].value = now
            if 0 <= shared.grow_from[index].value < mapped and shared.grew[index].value == 0.0:
                shared.grew[index].value = now
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    shared.ready[index].set()
    live: list[int] = []
    work = prompts(requests, prompt, model.config.vocab_size, seed=index)
    try:
        while (phase := shared.phase.value) >= 0:
            if phase == index and not live:
                live = [loop.add_request(p, loop.max_tokens - prompt) for p in work]
            elif phase != index and live:
                for rid in live:
                    loop.abort(rid)
                live = []
            if loop.has_work():
                loop.step()
            else:
                time.sleep(0.0005)
    finally:
        stop.set()
        sampler.join()
        cache.close()


def bench_handover(setup: Setup, shifts: int = 2) -> list[dict]:
    from kvcached.shm.budget import delete_budget, read_budget, set_budget

    ctx = mp.get_context("spawn")
    name = f"bench-serve-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    shared = Shared(ctx.Value("i", 2), [ctx.Value("q", 0) for _ in range(2)],
                    [ctx.Value("d", 0.0) for _ in range(2)], [ctx.Value("d", 0.0) for _ in range(2)],
                    [ctx.Value("d", 0.0) for _ in range(2)], [ctx.Value("q", -1) for _ in range(2)],
                    ctx.Value("q", 1 << 62), ctx.Value("q", -1), [ctx.Event() for _ in range(2)])
    page = _compound_page_bytes(setup)
    budget = setup.budget_pages * page
    set_budget(name, budget)
    env = {"KVCACHED_GLOBAL_BUDGET": name, "KVCACHED_MIN_RESERVED_PAGES": "0", "KVCACHED_MAX_RESERVED_PAGES": "0",
           "KVCACHED_TRACKER": "0", "KVCACHED_LAYOUT": "interleaved"}
    # Each instance's load asks for about twice the budget: the one with the load takes it all.
    per_request = 512 if setup.preset != "tiny" else 256
    tokens_in_budget = budget // _token_bytes(setup)
    requests = max(2, 2 * tokens_in_budget // per_request)
    procs = [ctx.Process(target=instance, args=(i, setup, env, shared, requests, per_request)) for i in range(2)]
    for p in procs:
        p.start()
    rows = []
    try:
        for i, p in enumerate(procs):
            _wait(shared.ready[i].is_set, f"instance {i} to start", procs)
        shared.target.value, shared.low.value = int(0.75 * budget), int(0.05 * budget)
        shared.phase.value = 0
        _wait(lambda: shared.reached[0].value > 0.0, "instance 0 taking the budget", procs, lambda: (
            [m.value for m in shared.mapped], read_budget(name)))
        for shift in range(shifts):
            giver, taker = shift % 2, 1 - shift % 2
            shared.reached[taker].value = shared.released[giver].value = shared.grew[taker].value = 0.0
            shared.grow_from[giver].value = -1
            shared.grow_from[taker].value = shared.mapped[taker].value
            start = time.monotonic()
            shared.phase.value = taker
            _wait(lambda g=giver, t=taker: shared.reached[t].value > 0.0 and shared.released[g].value > 0.0,
                  f"instance {taker} taking the budget", procs, lambda: ([m.value for m in shared.mapped],
                                                                  read_budget(name)))
            rows.append({"from": giver, "to": taker, "released_s": shared.released[giver].value - start,
                         "first_s": shared.grew[taker].value - start,
                         "mapped_s": shared.reached[taker].value - start, "budget": budget,
                         "held": read_budget(name).held_bytes})
    finally:
        shared.phase.value = -1
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        delete_budget(name, force=True)
    return rows


def _wait(condition, what: str, procs, state=None, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if not all(p.is_alive() for p in procs):
            raise RuntimeError(f"an instance died (exit codes {[p.exitcode for p in procs]}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}: {state() if state else ''}")
        time.sleep(0.0005)


def _token_bytes(setup: Setup) -> int:
    from kvcached.serving import kv_geometry, model_config

    layers, heads, dim = kv_geometry(model_config("llama", setup.preset))
    return layers * 2 * heads * dim * setup.dtype.itemsize


def _compound_page_bytes(setup: Setup) -> int:
    """Bytes one page id maps with the interleaved layout: every layer's K and V page."""
    from kvcached import config
    from kvcached.serving import kv_geometry, model_config

    layers = kv_geometry(model_config("llama", setup.preset))[0]
    page = setup.page_bytes or config.settings().page_size_mb << 20
    return layers * 2 * page


def print_handover(rows: list[dict]) -> None:
    print("\nhandover: two processes, one global budget, the load moves (interleaved layout)")
    print("| shift | budget MiB | losing instance down to 5% (s) | receiving instance's first map (s) | "
          "receiving instance mapped 75% (s) |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['from']} -> {r['to']} | {r['budget'] >> 20} | {r['released_s']:.3f} | {r['first_s']:.3f} | "
              f"{r['mapped_s']:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model on the CPU, a few steps (smoke test)")
    parser.add_argument("--device", default="cuda", help="cuda (default where there is one) or cpu")
    parser.add_argument("--batches", default="1,8,32,64,128,256")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens of every request")
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps per batch size and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per batch size, alternating the caches")
    parser.add_argument("--requests", type=int, default=64, help="requests of the end-to-end run")
    parser.add_argument("--new", type=int, default=64, help="new tokens per request, end to end")
    parser.add_argument("--batch-tokens", type=int, default=4096,
                        help="tokens per step of the end-to-end loops (their max_batch_tokens)")
    parser.add_argument("--budget-pages", type=int, default=16, help="global budget of the handover, in page ids")
    parser.add_argument("--skip", default="",
                        help="comma list of sections to skip: decode, e2e, handover, generate_batch (the "
                             "end-to-end run of transformers' generate_batch)")
    parser.add_argument("--caches", default="static,kvcached",
                        help="comma list of the caches to run side by side: static, kvcached")
    parser.add_argument("--modes", default="eager,graphs",
                        help="comma list of loop modes to run side by side: " + ", ".join(MODES))
    parser.add_argument("--profile", action="store_true",
                        help=f"CUDA: after each decode row's last round, {PROFILE_STEPS} more steps under torch.profiler "
                             f"(the device's busy time per step: GEMMs, kvcached's kernels, the rest)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args()
    setup = setup_from(args)
    setup.batch_tokens = args.batch_tokens
    setup.profile = args.profile
    if setup.profile and not setup.device.startswith("cuda"):
        raise SystemExit("--profile times the device's kernels: it needs CUDA (drop --quick or --device cpu)")
    skip = set(filter(None, args.skip.split(",")))
    if setup.threads:
        torch.set_num_threads(setup.threads)
    os.environ.setdefault("KVCACHED_TRACKER", "0")
    from kvcached import shutdown_kvcached
    from kvcached.serving import build_model

    print(f"bench_serve: {setup.preset} ({setup.dtype}) on {setup.device}, torch {torch.__version__}, "
          f"transformers {_transformers_version()}, block size {BLOCK_SIZE}", flush=True)
    results: dict = {"setup": {"device": setup.device, "preset": setup.preset, "dtype": str(setup.dtype),
                               "batches": setup.batches, "prompt": setup.prompt, "steps": setup.steps,
                               "rounds": setup.rounds, "requests": setup.requests, "new": setup.new,
                               "modes": list(setup.modes), "batch_tokens": setup.batch_tokens,
                               "torch": torch.__version__,
                               "transformers": _transformers_version()}}
    if not {"decode", "e2e"} <= skip:
        start = time.perf_counter()
        model = build_model("llama", preset=setup.preset, dtype=setup.dtype, device=setup.device)
        print(f"model built in {time.perf_counter() - start:.1f} s", flush=True)
        mixed = blocks_for(max(setup.batches), setup.prompt + 2 * setup.steps + 3) \
            + blocks_for(setup.steps + 1, mixed_prompt(setup) + 2)                      # a mixed step's run
        num_blocks = max(mixed, blocks_for(setup.requests, setup.prompt + setup.new)) + 1     # + a loop's pad block
        caches = make_caches(model, setup, num_blocks)
        wanted = set(args.caches.split(","))
        if wanted - set(caches):
            raise SystemExit(f"--caches {args.caches}: {', '.join(sorted(wanted - set(caches)))} unknown; use static, "
                             f"kvcached")
        for name in set(caches) - wanted:
            caches.pop(name).close()
        if "kvcached" in caches:
            print(f"{num_blocks} blocks per cache; kvcached layout {caches['kvcached'].manager.layout}", flush=True)
        if "e2e" not in skip:
            results["end_to_end"] = bench_end_to_end(model, caches, setup,
                                                     generate_batch="generate_batch" not in skip)
            print_end_to_end(results["end_to_end"], setup)
        if "decode" not in skip:
            results["decode"] = bench_decode(model, caches, setup)
            print_decode(results["decode"], setup)
        for cache in caches.values():
            cache.close()
        del model, caches
        shutdown_kvcached()
        if setup.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if "handover" not in skip:
        results["handover"] = bench_handover(setup)
        print_handover(results["handover"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
        print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
