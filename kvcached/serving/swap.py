"""Host swap: preempted requests' K/V kept in host memory, within a byte bound.

Its state is the bound and the bytes held (``swap_bytes``, ``swapped_bytes``) and each waiting
request's host copy (``Request.swapped``); the scheduler decides when a request goes out and
comes back, this room decides whether a copy may be kept and counts it. The copies themselves
are the cache's (PagedKVCache.swap_out and swap_in, queued on the model's stream). It imports
no torch: a host copy is only held and measured here. See Note [Swapping out].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SWAP_BYTES = 4 << 30            # host memory a loop may keep preempted requests' K/V in, by default


@dataclass
class SwappedKV:
    """A preempted request's K/V kept on the host (Note [Swapping out]): the first `cached`
    tokens' blocks, as PagedKVCache.swap_out copied them."""

    host: torch.Tensor
    cached: int


class HostSwap:
    """The host copies of one loop's preempted requests: at most ``swap_bytes`` bytes of them.

    ``copy_out`` makes a copy (or declines), ``keep`` counts one a request holds, ``drop``
    forgets it; ``swapped_bytes`` is always the sum over the requests that hold one."""

    def __init__(self, cache, swap_bytes: int):
        self.cache = cache
        self.swap_bytes = swap_bytes
        self.swapped_bytes = 0                  # host bytes the waiting requests' SwappedKV hold

    def copy_out(self, request) -> SwappedKV | None:
        """A host copy of what the request has cached, or None (recompute it) when it has
        nothing cached, the copy would pass swap_bytes, or the host memory for it cannot be had."""
        cache = self.cache
        blocks = -(-request.num_cached // cache.block_size)
        if not request.num_cached or self.swapped_bytes + cache.swap_bytes(blocks) > self.swap_bytes:
            return None
        try:
            host = cache.swap_out(request.blocks[:blocks])
        except RuntimeError:                    # host memory short (pinned or not): recomputing still works
            return None
        return SwappedKV(host, request.num_cached)

    def copy_in(self, host: torch.Tensor, ids: list[int]) -> None:
        """Queue the write of a host copy into blocks `ids`, on the model's stream."""
        self.cache.swap_in(host, ids)

    def keep(self, request, swapped: SwappedKV) -> None:
        """`request` (just preempted) holds `swapped` while it waits."""
        request.swapped = swapped
        self.swapped_bytes += swapped.host.nbytes

    def drop(self, request) -> None:
        """Forget the request's host copy, if it has one."""
        if request.swapped is not None:
            self.swapped_bytes -= request.swapped.host.nbytes
            request.swapped = None

    def problems(self, requests) -> list[str]:
        """What disagrees between `requests` (every request of the loop) and the bytes counted:
        for check_invariants."""
        swapped = sum(r.swapped.host.nbytes for r in requests if r.swapped is not None)
        if swapped != self.swapped_bytes or swapped > self.swap_bytes:
            return [f"the swapped-out requests hold {swapped} bytes, the loop counts {self.swapped_bytes} "
                    f"(swap_bytes={self.swap_bytes})"]
        return []


# Note [Swapping out]
# Recomputing a preempted request costs a prefill of everything it had: a 4,096-token prefill
# step of Llama-3-8B shapes took ~194 ms on the H200, so a 512-token prompt and its tokens so far
# take ~25-30 ms of the device, while its 64-96 MB of K/V cross PCIe to pinned host memory and
# back in a few ms. Under a fair budget every cap is met by preempting: the fair setup of
# bench_share preempted ~95 times in 30 s against ~12 under first come, its recomputation taking
# device time from all three instances (with swapping: 57 preemptions, 2279 tokens/s against
# 2176-2238 before; benchmarks/README.md). So Scheduler._preempt first
# queues a copy of the blocks that hold the request's cached tokens to the host (swap_out, on the
# stream the model runs on), then frees them as before: whatever later writes those blocks, or
# the fence before their page is unmapped, comes after the copy on the same stream. The request
# waits in the queue as before (Note [Preemption]), holding no block; when admitted it is given blocks
# for its cached tokens and the step's new ones, the host copy is written into them (swap_in,
# again on the stream, so the step that reads them comes after), and it goes on from its cached
# count, usually as one more decode row. The host bytes are bounded by swap_bytes; a preemption
# beyond them, one with nothing cached, or one whose host memory cannot be had is recomputed.
# An abort drops the copy. At tensor parallelism every rank copies its own shard (Note
# [Swapping out at TP] in kvcached.serving.tp).
