"""Decode steps as CUDA graphs: one captured forward + argmax per padded batch size.

A decode step of Llama-3-8B in eager mode spends about ten times the device's time on the host
(Python in transformers' model code and one launch per op; benchmarks/HISTORY.md). Replaying a
captured graph costs one launch. A decode-only step (every scheduled request has one new token) is
padded to the next bucket (1, 2, 4, 8, then steps of 8 up to max_running, as vLLM and SGLang do),
its inputs packed by kvcached.serving.buffers at the fixed addresses of that bucket, and the
bucket's graph replayed. Without CUDA the same runner calls the model eagerly over the same padded
buffers, so that CPU tests check the padding, the lanes and the pad block. See Note [Decode
graphs].
"""

from __future__ import annotations

import bisect

import torch

from .plan import StepPlan

GRAPH_STEP = 8                  # buckets past 8 lanes grow by this many


def decode_buckets(max_running: int) -> list[int]:
    """Lane counts of the decode graphs: 1, 2, 4, 8, 16, 24, ... below max_running, then max_running."""
    small = [b for b in (1, 2, 4) if b < max_running]
    return small + list(range(GRAPH_STEP, max_running, GRAPH_STEP)) + [max_running]


def greedy(plan: StepPlan, model, cache) -> torch.Tensor:
    """The greedy token ``[num_logits]`` (on the device) of each of the plan's sampled positions."""
    with torch.inference_mode():
        return plan.forward(model, cache).argmax(-1)


class DecodeRunner:
    """Runs padded decode-only steps over the static buffers of a StepBuffers; ``capture``
    (CUDA only) records a graph per bucket on its first use and replays it afterwards,
    otherwise the model runs eagerly over the same buffers."""

    def __init__(self, model, cache, max_running: int, *, capture: bool):
        self.model = model
        self.cache = cache
        self.buckets = decode_buckets(max_running)
        self.capture = capture
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None                        # the memory pool every bucket's graph shares
        self.replays = 0

    def bucket(self, batch: int) -> int:
        """The lane count a decode step of `batch` requests is padded to."""
        return self.buckets[bisect.bisect_left(self.buckets, batch)]

    def run(self, plan: StepPlan) -> torch.Tensor:
        """The greedy tokens of every lane of a padded decode plan (a view of the buffers'
        device tensor, as StepBuffers.pack lays it out for plan.num_seqs lanes)."""
        if not self.capture:
            return greedy(plan, self.model, self.cache)
        entry = self.graphs.get(plan.num_seqs)
        if entry is None:
            entry = self.graphs[plan.num_seqs] = self._capture(plan)
        graph, tokens = entry
        graph.replay()
        self.replays += 1
        return tokens

    def _capture(self, plan: StepPlan) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (Triton compiles, cuBLAS picks its kernels), then capture."""
        side = torch.cuda.Stream(device=plan.data.device)
        side.wait_stream(torch.cuda.current_stream(plan.data.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                greedy(plan, self.model, self.cache)
        torch.cuda.current_stream(plan.data.device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            tokens = greedy(plan, self.model, self.cache)
        return graph, tokens

    def close(self) -> None:
        """Drop the graphs and their memory pool."""
        self.graphs.clear()
        self.pool = None


# Note [Decode graphs]
# What is captured: plan.forward (the whole transformers forward with kvcached's attention: the
# Triton write_kv and decode kernels, which read the slot mapping, sequence lengths and block
# tables from the device) and the argmax, reading the inputs from the views of the StepBuffers'
# device tensor that a padded plan of that many lanes has, and writing the tokens into a tensor
# of the graph's pool. Nothing in that path reads a device value on the host: on CUDA a
# decode-only batch goes straight to the Triton kernel (paged_attention checks contents on the
# CPU only), the model with a custom attention name builds no mask, and logits_to_keep is a
# tensor of indices. Python (hooks included) runs only at capture; a replay repeats the
# kernels.
#
# Padding lanes: token 0 at position 0, slot -1 (write_kv skips it), sequence length 1 and a
# block-table row of the pad block, so each reads one slot of a block the loop holds for its
# lifetime: always mapped, whatever the limits unmap. Their tokens are ignored.
#
# The graphs stay valid while pages are unmapped and mapped again: kvcached's tensors keep their
# virtual addresses for their lifetime, and a block a step uses is mapped before the step
# (alloc returns once it is); a StaticKVCache never moves either. The buffers never move. The
# graphs share one memory pool; captured lazily, the buckets come in the order the load needs
# them, and ServingLoop.capture_graphs() captures every bucket up front, largest first, so that
# the smaller ones reuse the pool's blocks. Capture uses the thread-local error mode: kvcached's
# own threads may map pages (CUDA driver calls) while this thread captures.
#
# Prefill and mixed steps run eagerly: their shapes vary with every step. Tensor-parallel loops
# run eagerly too: a graph there would have to capture the NCCL all-reduces of every layer, and
# the workers, whose steps the leader's plan drives, would need the same buckets and captures in
# lockstep (kvcached.serving.tp).
