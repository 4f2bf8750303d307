"""A short tour of kvcached: a KV cache that grows with its load and shrinks back.

Run ``python -m kvcached.demo`` (``--device cpu`` forces the host backend). It creates the KV
tensors of a small model, serves a burst of requests, checks that every block holds what was
written to it, frees them, caps the memory as an operator would, and shuts down.
"""

from __future__ import annotations

import argparse
import time

from .sizes import format_bytes


def _say(step: str, text: str) -> None:
    print(f"[{step}] {text}")


def _mapped(manager) -> str:
    pages = manager.stats()["pages"]
    used, pool = pages["in_use"] * manager.page_bytes, pages["reserved"] * manager.page_bytes
    return (f"{format_bytes(int(manager.get_mapped_memory_size()))} mapped ({format_bytes(used)} in pages with "
            f"live blocks, {format_bytes(pool)} in the reserved pool)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcached.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: CUDA if usable, else cpu)")
    parser.add_argument("--layers", type=int, default=8, help="model layers (default 8)")
    parser.add_argument("--blocks", type=int, default=8192, help="KV blocks of the cache (default 8192)")
    parser.add_argument("--requests", type=int, default=32, help="requests in the burst (default 32)")
    args = parser.parse_args(argv)

    import torch

    from . import KVCacheManager, alloc_kv_cache, init_kvcached, shutdown_kvcached
    from .runtime import runtime

    init_kvcached(device=args.device)
    rt = runtime()
    backend = rt.backend
    _say("init", f"device {rt.device}: {backend.kind} backend, granularity {format_bytes(backend.granularity)}, "
                 f"pages of {format_bytes(rt.page_bytes)} per KV buffer")

    block_size, heads, head_dim, dtype = 16, 8, 64, torch.float16
    shape = (2, args.blocks, block_size, heads, head_dim)
    t0 = time.perf_counter()
    kv = alloc_kv_cache(shape, block_size, dtype, rt.device, args.layers)
    created_ms = (time.perf_counter() - t0) * 1e3
    group = rt.groups[0]
    virtual = sum(r.size_bytes for r in group.ranges)
    _say("tensors", f"{args.layers} layers of shape {tuple(kv[0].shape)} {dtype}: {format_bytes(virtual)} of "
                    f"virtual memory reserved in {created_ms:.1f} ms, {group.layout.name} layout "
                    f"({group.layout_reason.split(':')[0]})")

    cell_size = heads * head_dim * dtype.itemsize
    manager = KVCacheManager(args.blocks, block_size, cell_size, args.layers)
    manager.trim()
    _say("manager", f"{manager.available_size()} blocks available, {_mapped(manager)}; "
                    f"segment {manager.ipc_name} (see it with `kvctl list`)")

    generator = torch.Generator().manual_seed(0)
    requests = []
    for r in range(args.requests):
        tokens = int(torch.randint(64, 2048, (1,), generator=generator))
        ids = manager.alloc(-(-tokens // block_size))
        if ids is None:
            _say("burst", f"request {r} did not fit; stopping the burst")
            break
        for layer in (0, args.layers - 1):
            index = torch.tensor(ids, device=kv[layer].device)
            kv[layer][0].index_fill_(0, index, float(r + 1))
            kv[layer][1].index_fill_(0, index, -float(r + 1))
        requests.append(ids)
    blocks = sum(len(ids) for ids in requests)
    _say("burst", f"{len(requests)} requests hold {blocks} blocks: {_mapped(manager)}; "
                  f"{manager.available_size()} blocks still available")

    for r, ids in enumerate(requests):
        index = torch.tensor(ids, device=kv[0].device)
        for layer in (0, args.layers - 1):
            k, v = kv[layer][0].index_select(0, index), kv[layer][1].index_select(0, index)
            assert bool((k == r + 1).all()) and bool((v == -(r + 1)).all()), f"request {r}'s blocks changed"
    _say("check", f"every block of every request reads back what was written ({blocks} blocks, 2 layers, K and V)")

    half = len(requests) // 2
    for ids in requests[:half]:
        manager.free(ids)
    _say("free", f"freed the first {half} requests: {_mapped(manager)}; the pages they emptied went to the "
                 f"pool up to its maximum, the rest were unmapped")
    for ids in requests[half:]:
        manager.free(ids)
    manager.trim()
    _say("free", f"freed the rest and trimmed the pool: {_mapped(manager)}")

    limit = 16 * manager.page_bytes
    state = manager.set_memory_limit(limit, revision=1)
    capped = manager.available_size()
    held = manager.alloc(capped)
    refused = manager.alloc(1)
    _say("limit", f"limit {format_bytes(limit)} ({state['status']}): {capped} blocks available, alloc({capped}) "
                  f"{'succeeded' if held else 'failed'}, one more {'was refused' if refused is None else 'fit'}")
    manager.free(held)
    manager.set_memory_limit(-1, revision=2)
    _say("limit", f"limit removed: {manager.available_size()} blocks available again")

    shutdown_kvcached()
    _say("done", "shut down: every page unmapped and every physical handle released")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
