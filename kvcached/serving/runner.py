"""The serving loop's model runner: runs a SchedulerOutput on the device, tokens in and out.

Its state is what the device reads: the persistent step buffers (kvcached.serving.buffers), the
decode runner and its CUDA graphs (kvcached.serving.graphs), and the pad block padded lanes
read (Note [Pad block]). ``run`` packs a step into the buffers, launches the model call and the
greedy argmax and starts copying the tokens to the host; ``receive`` waits for them (Note
[Device sync]). It never reads a Request: the scheduler's output carries the rows, positions,
counts and input tokens, so the runner knows nothing of queues or policy.
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvcached.sizes import format_bytes

from .buffers import StepBuffers
from .counters import RowCounters
from .graphs import DecodeRunner
from .plan import StepPlan
from .scheduler import SchedulerOutput
from .stats import LoopStats


def step_buffer_bytes(tokens: int, rows: int, width: int) -> int:
    """Host bytes a loop allocates when it is made, for steps of `tokens` tokens (the larger of
    max_batch_tokens and max_running) of at most `rows` requests (max_running) whose block
    tables are `width` wide: its StepBuffers and RowCounters, each counted by its own class.
    See Note [Step buffer bounds]. O(1)."""
    return (StepBuffers.host_bytes(max_running=rows, max_tokens_per_step=tokens, width=width)
            + RowCounters.host_bytes(rows))


def _refuse_buffers_beyond_memory(max_batch_tokens: int, max_running: int, width: int,
                                  device: torch.device) -> None:
    """Raise ValueError, naming both arguments and the largest value of each that fits with the
    other, if the loop's step buffers would not fit in the host's physical memory (on CUDA, the
    smaller of it and the device's). See Note [Step buffer bounds]."""
    have, where = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this host's memory"
    if device.type == "cuda":
        have, where = min((have, where), (torch.cuda.get_device_properties(device).total_memory, f"{device}'s memory"))

    def need(tokens: int, rows: int) -> int:
        return step_buffer_bytes(max(tokens, rows), rows, width)

    wanted = need(max_batch_tokens, max_running)
    if wanted <= have:
        return
    most = {name: bisect.bisect_right(range(have + 1), have, key=key) - 1 for name, key in (
        ("max_batch_tokens", lambda tokens: need(tokens, max_running)),
        ("max_running", lambda rows: need(max_batch_tokens, rows)))}
    fixes = " or ".join(f"{name} <= {value}" for name, value in most.items() if value >= 1) or "lower both"
    raise ValueError(f"max_batch_tokens={max_batch_tokens} with max_running={max_running} needs {wanted} bytes "
                     f"({format_bytes(wanted)}) of step buffers, allocated when the loop is made (block tables "
                     f"{width} wide), more than the {format_bytes(have)} of {where}: pass {fixes}")


@dataclass
class Launched:
    """A step on the device: the scheduler's output it ran, the token buffer its tokens come
    back in, its tokens on the device when the decode runner ran it (what a step ahead feeds
    the next one: Note [Steps ahead]), and when the loop began it (perf_counter)."""

    output: SchedulerOutput
    slot: int
    device_tokens: torch.Tensor | None
    started: float = 0.0


class ModelRunner:
    """Runs one loop's steps: ``max_running`` requests of at most ``max_tokens_per_step`` tokens
    each step, block tables ``width`` wide.

    ``cuda_graphs``: decode-only steps run through a DecodeRunner (``decode``; graphs where
    ``device`` is CUDA), and the runner holds the pad block until close() (Note [Pad block]).
    ``forward(plan)`` is the loop's eager model call (the tensor-parallel leader sends the plan
    first). Raises ValueError if the step buffers would not fit in memory (Note [Step buffer
    bounds]).
    """

    def __init__(self, step_model, cache, stats: LoopStats, *, max_batch_tokens: int, max_running: int,
                 width: int, device: torch.device, cuda_graphs: bool,
                 forward: Callable[[StepPlan], torch.Tensor]):
        _refuse_buffers_beyond_memory(max_batch_tokens, max_running, width, device)
        self.cache = cache
        self.stats = stats
        self.forward = forward
        self.buffers = StepBuffers(max_running=max_running,
                                   max_tokens_per_step=max(max_batch_tokens, max_running),
                                   width=width, block_size=cache.block_size, device=device)
        self.decode = DecodeRunner(step_model, cache, max_running, capture=device.type == "cuda") \
            if cuda_graphs else None
        self.pad_block: int | None = None       # See Note [Pad block]
        if self.decode is not None:
            self.take_pad_block()

    def take_pad_block(self) -> bool:
        """Hold the pad block if not yet (the cache may have had none free before); whether the
        runner holds it. See Note [Pad block]."""
        if self.pad_block is None:
            ids = self.cache.alloc(1)
            if ids is None:
                return False
            self.pad_block = self.buffers.pad_block = ids[0]
        return True

    def pinned(self) -> list[int]:
        """The blocks the runner holds that no request does (the pad block, if held)."""
        return [] if self.pad_block is None else [self.pad_block]

    def capture_graphs(self) -> int:
        """Capture the decode graph of every batch size not captured yet, largest first (they
        share one memory pool); returns how many it holds. Does nothing where the decode runner
        does not capture. Raises RuntimeError when the cache has no block free for the pad block."""
        decode = self.decode
        if decode is None or not decode.capture:
            return 0
        if not self.take_pad_block():
            raise RuntimeError("the cache has no free block for the loop's pad block (a limit or the global budget "
                               "leaves none); capture the graphs before the cache fills, or raise the limit")
        empty = np.zeros(0, np.int64)
        for lanes in reversed(decode.buckets):
            if lanes not in decode.graphs:
                decode.run(self.buffers.pack(empty, empty, empty, np.zeros(0, bool), [], lanes=lanes))
        return len(decode.graphs)

    def close(self) -> None:
        """Drop the decode graphs and give the pad block back (unless the cache was closed: it
        went with it); idempotent. Later steps run eagerly."""
        if self.decode is not None:
            self.decode.close()
            self.decode = None
        if self.pad_block is not None:
            if not self.cache.closed:
                self.cache.free([self.pad_block])
            self.pad_block = None
            self.buffers.pad_block = 0

    def run(self, output: SchedulerOutput, feed: torch.Tensor | None = None) -> Launched:
        """Pack the step into the buffers, launch the model call and the greedy argmax, and start
        copying the tokens to the host (those of output.sampling, in order). ``feed``: the device
        tokens of the step ahead, the input of this decode step's requests in the same order
        (their host copies are not in yet: Note [Steps ahead])."""
        rows, count = output.rows, len(output.rows)
        stats = self.stats
        if output.decode_only and self.decode is not None and self.take_pad_block():
            plan = self.buffers.pack(rows, output.first, output.counts, output.sample, output.token_ids,
                                     lanes=self.decode.bucket(count))
            if feed is not None:
                plan.input_ids[:count].copy_(feed[:count])
            launch = time.perf_counter()
            replays = self.decode.replays
            tokens = device_tokens = self.decode.run(plan)
            stats.runner_steps += 1
            stats.graph_replays += self.decode.replays - replays
        else:
            assert feed is None, "a step fed from the device must run through the decode runner"
            plan = self.buffers.pack(rows, output.first, output.counts, output.sample, output.token_ids)
            launch = time.perf_counter()
            tokens = self.forward(plan).argmax(-1)
            device_tokens = None
            stats.eager_steps += 1
        stats.last_forward_s = time.perf_counter() - launch
        return Launched(output, self.buffers.send_tokens(tokens), device_tokens)

    def receive(self, launched: Launched) -> np.ndarray:
        """Wait for a launched step's sampled tokens and return them (Note [Device sync])."""
        waiting = time.perf_counter()
        tokens = self.buffers.received_tokens(len(launched.output.sampling), launched.slot)
        self.stats.last_wait_s = time.perf_counter() - waiting
        return tokens


# Note [Pad block]
# A padded decode step (kvcached.serving.graphs) has lanes no request owns; each reads the first
# slot of its block-table row, so that row must name a block that is mapped whenever a graph
# replays, whatever limits, budgets and trims unmap in between. The loop takes one block from
# the cache for it (cache.alloc(1), at construction, or at the first decode step if the cache had
# none free then: until it has one, decode steps run eagerly) and holds it until close(), which
# frees it (a closed cache took it along). It shows as one block handed out in the cache's
# counts (and a request can hold one block fewer than the cache has: max_tokens says so);
# check_invariants counts it as held, by no request. Only a loop with cuda_graphs takes
# it: eager steps read no table entry past a request's blocks (Note [Block table contract] in
# kvcached.ops.attention), so there the padding entries are never read and a loop without the
# runner holds no memory while idle. Entries past a request's blocks hold the pad block too (0
# before the loop holds one); nothing reads them.
#
# Note [Device sync]
# A step waits for the device once: for its greedy tokens, before the commit (StepBuffers
# .received_tokens; Note [Step buffers]). Besides giving the commit the token values, that wait
# is what makes the frees after it safe: the blocks of finished and preempted requests go back
# (and their pages may be unmapped) only once the device finished every step that read them.
#
# Note [Step buffer bounds]
# The loop allocates its step buffers once, when it is made (Note [Step buffers] in buffers), for
# the largest step its arguments allow: 32 bytes of host memory per token of max_batch_tokens
# (three staging values and an arange entry) and 16 x width + 80 per request of max_running
# (the block-table mirror and the staging's tables, width = ceil(max_tokens / block_size), and
# ten values of counters, lengths and tokens); on CUDA 24 bytes per token and 8 x width + 24 per
# request of them again on the device. ServingLoop(max_batch_tokens=10**12) died in torch's
# allocator asking for 32 TB, naming no argument. The bound is what those buffers can take at
# most: the host's physical memory, or the device's if smaller; beyond it no allocation can
# succeed, so the constructor refuses first, naming both arguments and the largest value of
# each that fits with the other. Not the cache's capacity: a step never holds more tokens than
# the cache has slots, but a cap above that is harmless as a cap, and a small cache with the
# default max_batch_tokens is common.
