"""One demo instance: a process serving a model through kvcached.serving under the global budget.

The parent (kvcached.demo.run) starts it with ``multiprocessing`` (spawn) and talks to it over a
pipe. Parent to instance: ``("clients", n)`` and ``("stop", None)``. Instance to parent:
``("ready", info)`` once its model and KV cache exist, ``("stats", counters)`` about ten times a
second, ``("error", traceback)`` if anything fails. With n clients the instance keeps n requests
in its loop (a client sends its next request when the last one finished); with none it finishes
what it holds, and its pages go back to the budget (the pool is trimmed after
KVCACHED_IDLE_TRIM_S).
"""

from __future__ import annotations

import os
import random
import signal
import time
import traceback
from dataclasses import dataclass

REPORT_EVERY_S = 0.1
STALLED_WAIT_S = 0.001


@dataclass(frozen=True)
class Workload:
    """The model and the load of an instance on one kind of device (see kvcached.demo.run)."""

    preset: str                     # kvcached.serving.model.PRESETS
    dtype: str                      # torch dtype name
    page_size_bytes: int            # page of one KV buffer (init_kvcached's page_size_bytes)
    num_blocks: int                 # capacity of the KV cache, in blocks of block_size tokens
    block_size: int
    max_running: int                # requests decoded together
    clients: int                    # clients of the busiest instance (see kvcached.demo.schedule)
    prompt_tokens: tuple[int, int]  # uniform range of prompt lengths
    new_tokens: tuple[int, int]     # uniform range of tokens generated per request


@dataclass(frozen=True)
class InstanceSpec:
    """What the parent tells an instance at start."""

    name: str                       # shown in the view and the plot
    family: str                     # kvcached.serving.model.FAMILIES
    ipc_name: str                   # KVCACHED_IPC_NAME: its segment, as kvctl lists it
    device: str
    seed: int
    workload: Workload
    settings: dict                  # KVCACHED_* variables of this instance


def serve(spec: InstanceSpec, conn) -> None:
    """Entry point of the instance process; returns when told to stop or the parent is gone."""
    # Ctrl-C reaches the whole process group: the parent alone handles it and stops us in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(spec.settings)
    try:
        _serve(spec, conn)
    except (BrokenPipeError, EOFError):
        pass                                    # the parent is gone; shut down quietly
    except Exception:  # noqa: BLE001 - any failure is reported to the parent, which says it
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        from kvcached import shutdown_kvcached

        shutdown_kvcached()
        conn.close()


def _serve(spec: InstanceSpec, conn) -> None:
    import torch

    from kvcached import config, init_kvcached
    from kvcached.serving import ElasticKVCache, ServingLoop, build_model

    config.reload_settings()                    # the KVCACHED_* variables set above
    if spec.device == "cpu":
        torch.set_num_threads(1)                # two instances share the cores
    w = spec.workload
    dtype = getattr(torch, w.dtype)
    init_kvcached(device=spec.device, page_size_bytes=w.page_size_bytes)
    model = build_model(spec.family, preset=w.preset, dtype=dtype, device=spec.device, seed=spec.seed)
    cache = ElasticKVCache(model.config, w.num_blocks, block_size=w.block_size, dtype=dtype, device=spec.device)
    # On CUDA decode steps replay CUDA graphs (the loop's default), captured here before the load
    # comes; the loop's pad block keeps one page of the instance mapped while it is idle.
    loop = ServingLoop(model, cache, max_running=w.max_running)
    # Warm-up: kernels compile and load at their first use, so a prefill of the shortest and of
    # the longest prompt and a mixed step (a decode row beside a prefill) run now, before the load.
    shortest, longest = w.prompt_tokens
    loop.add_request([1] * longest, 2)
    loop.step()
    loop.add_request([1] * shortest, 2)
    loop.run_until_done()
    loop.capture_graphs()
    conn.send(("ready", {"pid": os.getpid(), "ipc_name": cache.manager.ipc_name,
                         "page_bytes": cache.manager.page_bytes,
                         "capacity_bytes": cache.manager.num_pages * cache.manager.page_bytes,
                         "token_bytes": 2 * cache.num_layers * cache.cell_bytes,
                         "layers": cache.num_layers}))
    rng = random.Random(spec.seed)
    vocab = model.config.vocab_size
    clients, next_report_s = 0, 0.0
    while True:
        while conn.poll():
            kind, value = conn.recv()
            if kind == "stop":
                return
            clients = value
        if clients:
            stats = loop.stats
            for _ in range(clients - stats.running - stats.waiting):
                prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(*w.prompt_tokens))]
                loop.add_request(prompt, rng.randint(*w.new_tokens))
        if loop.has_work():
            loop.step()
            if not loop.stats.step_tokens:
                conn.poll(STALLED_WAIT_S)       # no memory for any request: let the other instance run
        else:
            conn.poll(REPORT_EVERY_S)
        now = time.monotonic()
        if now >= next_report_s:
            stats = loop.stats
            conn.send(("stats", {"running": stats.running, "waiting": stats.waiting,
                                 "preemptions": stats.preemptions, "generated_tokens": stats.generated_tokens}))
            next_report_s = now + REPORT_EVERY_S
