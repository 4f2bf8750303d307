"""Three serving instances under one global budget, bursty load: static split vs first_come vs fair.

    python benchmarks/bench_share.py            # CUDA: three Llama-3-8B-shaped instances, bf16
    python benchmarks/bench_share.py --quick    # tiny model on the CPU, ~5 s per setup
    python benchmarks/bench_share.py --seconds 60 --rate 8 --budget 24G --prompt 512 --new 256 \
        --json benchmarks/results/share-h200.json --png benchmarks/results/share-h200.png

Three processes each serve one model through kvcached.serving's ServingLoop over an
ElasticKVCache; they share one global budget that one instance alone could fill. Requests
arrive by the wall clock from one seeded trace: per model an on/off Poisson process (rate
--rate during its "on" phase, nothing while "off"), the bursts staggered across the models
(model m is on for the first --on fraction of every --period, shifted by m/3 of a period). The
same trace runs under three setups:

1. static: budget policy first_come, every instance limited to a third of the budget
   (``KVCacheManager.set_memory_limit``);
2. first_come: budget policy first_come, no limits (whoever allocates first keeps it);
3. fair: budget policy fair (weighted max-min, equal weights; the default of a new budget).

Per setup and model: TTFT p50/p99 (arrival to the first generated token), throughput (generated
tokens over the instance's run, first arrival to its last finish), preemptions (of which swapped out to the
host rather than recomputed), requests finished
vs arrived (the run drains the queue: every request finishes). The memory each instance maps over
time goes to a PNG (--png), one panel per setup. How much the bursts collide varies between runs of
one trace, so --repeats N runs it N times per setup, the setups taking turns, and pools the TTFTs
(the table also shows each run's p99).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import random
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

BLOCK_SIZE = 16
MODELS = 3
SETUPS = ("static", "first_come", "fair")
POLICY = {"static": "first_come", "first_come": "first_come", "fair": "fair"}


@dataclass
class Setup:
    device: str
    preset: str
    dtype: str                  # torch dtype name (picklable for spawn)
    seconds: float              # length of the arrival trace
    period: float               # on/off cycle of one model's arrivals
    on: float                   # fraction of the period a model is "on"
    rate: float                 # arrivals per second while "on"
    budget: int                 # global budget, bytes
    prompt: int
    new: int
    max_running: int
    max_batch_tokens: int
    page_bytes: int | None      # None: the default (KVCACHED_PAGE_SIZE_MB)
    threads: int | None
    sample_s: float             # memory sampling interval
    seed: int


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def setup_from(args) -> Setup:
    cuda = torch.cuda.is_available() and args.device != "cpu" and not args.quick
    if cuda:
        defaults = dict(device="cuda:0", preset="llama3-8b", dtype="bfloat16", seconds=60.0, period=20.0, rate=8.0,
                        budget=24 << 30, prompt=512, new=256, max_running=256, max_batch_tokens=4096,
                        page_bytes=None, threads=None, sample_s=0.05)
    else:
        defaults = dict(device="cpu", preset="tiny", dtype="float32", seconds=4.0, period=2.0, rate=40.0,
                        budget=320 << 10, prompt=32, new=32, max_running=64, max_batch_tokens=1024,
                        page_bytes=8 << 10, threads=1, sample_s=0.01)
    for key in ("seconds", "period", "rate", "prompt", "new"):
        if getattr(args, key) is not None:
            defaults[key] = getattr(args, key)
    if args.budget is not None:
        defaults["budget"] = parse_size(args.budget)
    return Setup(on=args.on, seed=args.seed, **defaults)


def arrival_trace(setup: Setup) -> list[list[float]]:
    """Arrival times (s from the start) per model: an on/off Poisson process, bursts staggered."""
    rng = random.Random(setup.seed)
    trace = []
    for m in range(MODELS):
        offset, on_s = m * setup.period / MODELS, setup.on * setup.period
        times, t = [], 0.0
        while True:
            t += rng.expovariate(setup.rate)        # Poisson arrivals on the "on" clock
            cycle, within = divmod(t, on_s)         # map "on" time to wall time
            wall = offset + cycle * setup.period + within
            if wall >= setup.seconds:
                break
            times.append(wall)
        trace.append(times)
    return trace


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


# -- one instance -----------------------------------------------------------------------------------

def instance(index: int, setup: Setup, env: dict, limit: int | None, arrivals: list[float], start, ready, results) -> None:
    """Serve the arrivals of one model from shared start time `start`; put its records on `results`."""
    os.environ.update(env)
    if setup.threads:
        torch.set_num_threads(setup.threads)
    from kvcached import config, init_kvcached
    from kvcached.limits import I64_MAX
    from kvcached.serving import ElasticKVCache, ServingLoop, build_model, kv_geometry

    config.reload_settings()
    dtype = getattr(torch, setup.dtype)
    model = build_model("llama", preset=setup.preset, dtype=dtype, device=setup.device)
    init_kvcached(device=setup.device, page_size_bytes=setup.page_bytes)
    layers, heads, dim = kv_geometry(model.config)
    block_bytes = layers * 2 * heads * dim * dtype.itemsize * BLOCK_SIZE
    per_request = -(-(setup.prompt + setup.new) // BLOCK_SIZE)
    # Room for the whole budget and more: only the budget (or the static limit) binds.
    num_blocks = max(2 * setup.budget // block_bytes, 2 * per_request) + 1
    cache = ElasticKVCache(model.config, num_blocks, block_size=BLOCK_SIZE, dtype=dtype, device=setup.device)
    if limit is not None:
        cache.manager.set_memory_limit(limit, revision=1)
    loop = ServingLoop(model, cache, max_batch_tokens=setup.max_batch_tokens, max_running=setup.max_running)
    loop.capture_graphs()               # at start-up, as an engine does (CUDA only)
    rng = random.Random(setup.seed * 1000 + index)
    prompts = [[rng.randrange(1, model.config.vocab_size) for _ in range(setup.prompt)] for _ in arrivals]
    samples: list[tuple[float, int]] = []
    caps: list[tuple[float, int | None]] = []       # the budget's cap on this instance; None: uncapped
    stop = threading.Event()
    ready.set()
    while start.value == 0.0:
        time.sleep(0.001)
    t0 = start.value

    def sample() -> None:
        while not stop.is_set():
            share = cache.manager.share()
            now = time.monotonic() - t0
            samples.append((now, cache.mapped_bytes()))
            caps.append((now, None if share is None or share["cap_bytes"] >= I64_MAX else share["cap_bytes"]))
            time.sleep(setup.sample_s)

    while time.monotonic() < t0:
        time.sleep(0.0005)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    ids: dict[int, int] = {}            # request id -> index into arrivals
    first: dict[int, float] = {}
    finish: dict[int, float] = {}
    preempted: dict[int, int] = {}
    tokens = 0
    added = 0
    try:
        while added < len(arrivals) or loop.has_work():
            now = time.monotonic() - t0
            while added < len(arrivals) and arrivals[added] <= now:
                ids[loop.add_request(prompts[added], setup.new)] = added
                added += 1
            if not loop.has_work():
                if added < len(arrivals):
                    time.sleep(max(0.0, min(0.005, arrivals[added] - now)))
                continue
            done = loop.step()
            now = time.monotonic() - t0
            for r in loop.running:
                if r.id not in first and len(r.generated) >= 1:
                    first[r.id] = now
            for r in done:
                first.setdefault(r.id, now)
                finish[r.id] = now
                preempted[r.id] = r.preemptions
                tokens += len(r.generated)
            if loop.stats.step_tokens == 0 and not done:
                time.sleep(0.001)       # nothing ran: waiting for memory another instance holds
    finally:
        stop.set()
        sampler.join()
        preemptions, moved, swapped = loop.stats.preemptions, loop.stats.blocks_moved, loop.stats.swapped_out
        loop.close()
        cache.close()
    requests = [{"arrival": arrivals[i], "first": first.get(rid), "finish": finish.get(rid),
                 "preemptions": preempted.get(rid, 0)} for rid, i in ids.items()]
    results.put({"model": index, "requests": requests, "tokens": tokens, "preemptions": preemptions,
                 "swapped_out": swapped, "blocks_moved": moved, "samples": samples, "caps": caps})


# -- one setup --------------------------------------------------------------------------------------

def run_setup(name: str, setup: Setup, trace: list[list[float]], timeout: float) -> dict[int, dict]:
    """One run of the trace under setup `name`: {model: what its instance reported}."""
    from kvcached.shm.budget import delete_budget, set_budget

    ctx = mp.get_context("spawn")
    budget_name = f"bench-share-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    set_budget(budget_name, setup.budget, policy=POLICY[name])
    env = {"KVCACHED_GLOBAL_BUDGET": budget_name, "KVCACHED_MIN_RESERVED_PAGES": "0",
           "KVCACHED_MAX_RESERVED_PAGES": "0", "KVCACHED_TRACKER": "0", "KVCACHED_LAYOUT": "interleaved"}
    limit = setup.budget // MODELS if name == "static" else None
    start = ctx.Value("d", 0.0)
    ready = [ctx.Event() for _ in range(MODELS)]
    results = ctx.Queue()
    procs = [ctx.Process(target=instance, args=(m, setup, env, limit, trace[m], start, ready[m], results))
             for m in range(MODELS)]
    for p in procs:
        p.start()
    out: dict[int, dict] = {}
    try:
        deadline = time.monotonic() + timeout
        for m in range(MODELS):
            while not ready[m].wait(0.1):
                _check(procs, deadline, f"instance {m} to start")
        start.value = time.monotonic() + 0.2
        while len(out) < MODELS:
            try:
                r = results.get(timeout=0.5)
                out[r["model"]] = r
            except queue.Empty:
                _check(procs, deadline, "the instances to drain their requests", allow_exit=True)
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        delete_budget(budget_name, force=True)
    return out


def _check(procs, deadline: float, what: str, allow_exit: bool = False) -> None:
    bad = [p.exitcode for p in procs if not p.is_alive() and (p.exitcode != 0 or not allow_exit)]
    if bad:
        raise RuntimeError(f"an instance died (exit codes {[p.exitcode for p in procs]}) while waiting for {what}")
    if time.monotonic() > deadline:
        raise RuntimeError(f"timed out waiting for {what}")


def summarize(name: str, runs: list[dict[int, dict]], trace: list[list[float]]) -> dict:
    """Per model, over every run of setup `name`: TTFT percentiles of all their requests pooled
    (and each run's p99), tokens over the runs' summed spans, counts summed. The memory samples
    and caps are the first run's; each request record names its run."""
    pooled = {m: [dict(q, run=i) for i, out in enumerate(runs) for q in out[m]["requests"]] for m in range(MODELS)}
    rows = []
    for m in range(MODELS):
        ttft_of = [[1000 * (q["first"] - q["arrival"]) for q in out[m]["requests"] if q["first"] is not None]
                   for out in runs]
        finishes_of = [[q["finish"] for q in out[m]["requests"] if q["finish"] is not None] for out in runs]
        ttft = [t for times in ttft_of for t in times]
        span = sum(max(finishes) - min(trace[m]) for finishes in finishes_of if finishes)
        tokens = sum(out[m]["tokens"] for out in runs)
        rows.append({"setup": name, "model": m, "runs": len(runs), "arrived": len(trace[m]) * len(runs),
                     "finished": sum(map(len, finishes_of)), "ttft_p50_ms": _percentile(ttft, 50),
                     "ttft_p99_ms": _percentile(ttft, 99), "ttft_p99_ms_per_run": [_percentile(t, 99) for t in ttft_of],
                     "tokens": tokens, "tokens_per_s": tokens / span if span > 0 else None,
                     **{key: sum(out[m][key] for out in runs) for key in ("preemptions", "swapped_out", "blocks_moved")},
                     "peak_mapped": max((b for out in runs for _, b in out[m]["samples"]), default=0)})
    return {"setup": name, "rows": rows, "samples": {m: runs[0][m]["samples"] for m in range(MODELS)},
            "caps": {m: runs[0][m]["caps"] for m in range(MODELS)}, "requests": pooled}


# -- report -----------------------------------------------------------------------------------------

def print_table(results: list[dict], setup: Setup) -> None:
    print(f"\n3 instances, budget {setup.budget / (1 << 20):.1f} MiB, on/off Poisson {setup.rate:g}/s "
          f"(on {setup.on:.0%} of {setup.period:g} s, staggered), {setup.seconds:g} s of arrivals, "
          f"prompt {setup.prompt} + {setup.new} new")
    print("| setup | model | TTFT p50 (ms) | TTFT p99 (ms; each run's) | tokens/s | preemptions (swapped out) | blocks moved | "
          "finished / arrived | peak mapped (MiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")

    def ms(v):
        return "-" if v is None else f"{v:.0f}"
    for res in results:
        for r in res["rows"]:
            rate = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f}"
            p99 = ms(r["ttft_p99_ms"])
            if r["runs"] > 1:
                p99 += " (" + ", ".join(map(ms, r["ttft_p99_ms_per_run"])) + ")"
            print(f"| {r['setup']} | {r['model']} | {ms(r['ttft_p50_ms'])} | {p99} | {rate} | "
                  f"{r['preemptions']} ({r['swapped_out']}) | {r['blocks_moved']} | {r['finished']} / {r['arrived']} | {r['peak_mapped'] / (1 << 20):.2f} |")


def plot(results: list[dict], setup: Setup, trace: list[list[float]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.6 * len(results)), sharex=True, squeeze=False)
    for ax, res in zip(axes[:, 0], results):
        for m in range(MODELS):
            samples = res["samples"][m]
            ax.plot([t for t, _ in samples], [b / (1 << 20) for _, b in samples], label=f"model {m}", lw=1)
            capped = [(t, c / (1 << 20)) for t, c in res["caps"][m] if c is not None]
            if capped:
                ax.scatter(*zip(*capped), s=2, color=f"C{m}", marker=".", label=f"model {m} cap")
        ax.axhline(setup.budget / (1 << 20), color="k", ls="--", lw=0.8, label="budget")
        if res["setup"] == "static":
            ax.axhline(setup.budget / MODELS / (1 << 20), color="grey", ls=":", lw=0.8, label="static limit")
        for m in range(MODELS):     # the "on" phases, as ticks under the axis
            offset = m * setup.period / MODELS
            t = offset
            while t < setup.seconds:
                ax.axvspan(t, min(t + setup.on * setup.period, setup.seconds), ymin=0.0, ymax=0.03,
                           color=f"C{m}", alpha=0.6)
                t += setup.period
        ax.set_title(f"{res['setup']} (policy {POLICY[res['setup']]})", fontsize=10)
        ax.set_ylabel("mapped MiB")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model on the CPU, ~5 s per setup")
    parser.add_argument("--device", default="cuda", help="cuda (default where there is one) or cpu")
    parser.add_argument("--seconds", type=float, help="seconds of arrivals per setup (then the queues drain)")
    parser.add_argument("--period", type=float, help="on/off cycle of one model's arrivals, s")
    parser.add_argument("--on", type=float, default=0.5, help="fraction of the period a model receives requests")
    parser.add_argument("--rate", type=float, help="arrivals per second of one model while on")
    parser.add_argument("--budget", help="global budget, e.g. 24G, 2M (bytes without a unit)")
    parser.add_argument("--prompt", type=int, help="prompt tokens of every request")
    parser.add_argument("--new", type=int, help="new tokens of every request")
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma list of: " + ",".join(SETUPS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of the trace per setup, the setups taking turns; TTFT percentiles pool them")
    parser.add_argument("--timeout", type=float, default=None, help="seconds a setup may take (default 10x --seconds + 300)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--png", metavar="PATH", help="plot each instance's mapped memory over time to PATH")
    args = parser.parse_args()
    setup = setup_from(args)
    names = [s for s in args.setups.split(",") if s]
    unknown = set(names) - set(SETUPS)
    if unknown:
        parser.error(f"unknown setups {sorted(unknown)}; pick from {SETUPS}")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give 1 or more runs per setup")
    trace = arrival_trace(setup)
    timeout = args.timeout or 10 * setup.seconds + 300
    print(f"bench_share: {MODELS} x {setup.preset} ({setup.dtype}) on {setup.device}, torch {torch.__version__}; "
          f"arrivals per model {[len(t) for t in trace]}", flush=True)
    runs: dict[str, list[dict[int, dict]]] = {name: [] for name in names}
    for turn in range(args.repeats):            # the setups take turns: a drift of the machine hits each alike
        for name in names:
            began = time.perf_counter()
            runs[name].append(run_setup(name, setup, trace, timeout))
            print(f"{name} (run {turn + 1} of {args.repeats}): {time.perf_counter() - began:.1f} s", flush=True)
    results = [summarize(name, runs[name], trace) for name in names]
    print_table(results, setup)
    lost = [(r["setup"], r["model"]) for res in results for r in res["rows"] if r["finished"] != r["arrived"]]
    if args.png:
        plot(results, setup, trace, args.png)
        print(f"memory over time written to {args.png}")
    if args.json:
        Path(args.json).write_text(json.dumps({"setup": asdict(setup), "trace": trace, "results": results}) + "\n")
        print(f"results written to {args.json}")
    if lost:
        raise SystemExit(f"requests lost (finished != arrived) in {lost}")


if __name__ == "__main__":
    main()
