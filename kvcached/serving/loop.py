"""Continuous batching over a paged KV cache: requests join and leave at any step.

Each step packs every scheduled request's new tokens into one batch-1 sequence with explicit
position ids and runs the model once; attention finds each request's blocks through the step
metadata (kvcached.serving.attention). Greedy decoding. See Note [Scheduling] and
Note [Preemption].
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import torch

from kvcached.checks import as_int

from .attention import ATTENTION_NAME
from .plan import StepPlan

RATE_WINDOW = 32                # steps over which stats.tokens_per_s is measured


@dataclass
class Request:
    """One generation request; `tokens` is the prompt followed by what was generated so far."""

    id: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0             # tokens whose K/V are in the cache
    preemptions: int = 0

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def done(self) -> bool:
        return len(self.tokens) - self.prompt_len >= self.max_new_tokens


@dataclass
class LoopStats:
    """Counters of a ServingLoop, updated by every step."""

    running: int = 0
    waiting: int = 0
    finished: int = 0
    preemptions: int = 0
    generated_tokens: int = 0
    steps: int = 0
    step_tokens: int = 0            # tokens the last step ran through the model
    last_step_s: float = 0.0
    tokens_per_s: float = 0.0       # generated tokens per second over the last RATE_WINDOW steps


class ServingLoop:
    """Greedy continuous batching of a transformers causal LM over a PagedKVCache.

    The model must be built with ``attn_implementation=kvcached.serving.ATTENTION_NAME``
    (``build_model`` does). max_batch_tokens caps the tokens of one step (prompts are prefilled in
    chunks within it); max_running caps the requests in flight.
    """

    def __init__(self, model, cache, *, max_batch_tokens: int = 2048, max_running: int = 256):
        implementation = getattr(model.config, "_attn_implementation", None)
        if implementation != ATTENTION_NAME:
            raise ValueError(f"the model runs attn_implementation={implementation!r}; build it with "
                             f"attn_implementation={ATTENTION_NAME!r} (kvcached.serving.build_model does) or call "
                             f"model.set_attn_implementation({ATTENTION_NAME!r})")
        self.model = model
        self.cache = cache
        self.max_batch_tokens = as_int(max_batch_tokens, "max_batch_tokens", minimum=1, error=ValueError)
        self.max_running = as_int(max_running, "max_running", minimum=1, error=ValueError)
        self.device = next(model.parameters()).device
        self.max_tokens = min(cache.num_blocks * cache.block_size,
                              getattr(model.config, "max_position_embeddings", 1 << 62))
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.stats = LoopStats()
        self._next_id = 0
        self._rate: collections.deque[tuple[float, int]] = collections.deque(maxlen=RATE_WINDOW)

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], max_new_tokens: int) -> int:
        """Queue a request; returns its id. Raises ValueError for an empty prompt, token ids
        outside the vocabulary, or a request longer than the cache or the model can hold."""
        max_new_tokens = as_int(max_new_tokens, "max_new_tokens", minimum=1, error=ValueError)
        vocab = self.model.config.vocab_size
        tokens = [as_int(t, "prompt token", minimum=0, maximum=vocab - 1, error=ValueError) for t in prompt_ids]
        if not tokens:
            raise ValueError("prompt_ids is empty; a request needs at least one prompt token")
        if len(tokens) + max_new_tokens > self.max_tokens:
            raise ValueError(f"prompt of {len(tokens)} tokens + max_new_tokens={max_new_tokens} exceeds the "
                             f"{self.max_tokens} tokens one request can hold (cache blocks x block_size, "
                             f"max_position_embeddings); shorten it or give the cache more blocks")
        request = Request(self._next_id, tokens, len(tokens), max_new_tokens)
        self._next_id += 1
        self.waiting.append(request)
        self.stats.waiting = len(self.waiting)
        return request.id

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: int) -> bool:
        """Drop a waiting or running request (its client left), freeing its blocks; False if it
        is not here (finished, aborted or never added)."""
        for queue in (self.running, self.waiting):
            for request in queue:
                if request.id == request_id:
                    queue.remove(request)
                    self._release(request)
                    self.stats.running, self.stats.waiting = len(self.running), len(self.waiting)
                    return True
        return False

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Schedule, run the model once over the packed batch, append one greedy token to every
        request whose prompt is complete; returns the requests that finished (blocks freed)."""
        start = time.perf_counter()
        batch = self._schedule()
        finished: list[Request] = []
        generated = 0
        if batch:
            sampled = self._run(batch)
            for request, token in sampled:
                request.tokens.append(token)
                generated += 1
                if request.done:
                    finished.append(request)
            for request in finished:
                self.running.remove(request)
                self._release(request)
        elapsed = time.perf_counter() - start
        self._account(batch, generated, len(finished), elapsed)
        return finished

    def run_until_done(self, *, stall_timeout_s: float = 60.0) -> dict[int, list[int]]:
        """Step until no request is left; returns {request id: generated tokens}.

        Raises RuntimeError when no step could run for stall_timeout_s (memory held elsewhere,
        or a limit below what one request needs)."""
        results: dict[int, list[int]] = {}
        stalled_since = None
        while self.has_work():
            for request in self.step():
                results[request.id] = request.generated
            if self.stats.step_tokens:
                stalled_since = None
                continue
            now = time.monotonic()
            stalled_since = stalled_since or now
            if now - stalled_since > stall_timeout_s:
                raise RuntimeError(f"no memory for any request for {stall_timeout_s} s "
                                   f"({len(self.waiting)} waiting): raise the memory limit or the budget")
            time.sleep(0.001)
        return results

    # -- scheduling -----------------------------------------------------------------------------
    def _schedule(self) -> list[tuple[Request, int]]:
        """[(request, new tokens this step)]; See Note [Scheduling]."""
        budget = self.max_batch_tokens
        batch: list[tuple[Request, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget:
            request = self.running[i]
            n = min(len(request.tokens) - request.num_cached, budget)
            if self._grow(request, request.num_cached + n):
                batch.append((request, n))
                budget -= n
                i += 1
                continue
            victim = self.running[-1]           # See Note [Preemption]
            self._preempt(victim)
            preempted = True
        while self.waiting and budget and not preempted and len(self.running) < self.max_running:
            request = self.waiting[0]
            n = min(len(request.tokens), budget)
            if not self._grow(request, n):
                break
            self.waiting.popleft()
            self.running.append(request)
            batch.append((request, n))
            budget -= n
        return batch

    def _grow(self, request: Request, num_tokens: int) -> bool:
        """Give `request` blocks for num_tokens tokens; False (nothing changed) if none are left."""
        needed = -(-num_tokens // self.cache.block_size) - len(request.blocks)
        if needed <= 0:
            return True
        ids = self.cache.alloc(needed)
        if ids is None:
            return False
        request.blocks.extend(ids)
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_cached = 0
        request.preemptions += 1
        self.waiting.appendleft(request)
        self.stats.preemptions += 1

    def _release(self, request: Request) -> None:
        if request.blocks:
            self.cache.free(request.blocks)
            request.blocks = []

    # -- the model call -------------------------------------------------------------------------
    def _run(self, batch: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """One forward pass over the packed batch; returns (request, greedy token) for every
        request whose last token was in it."""
        block_size = self.cache.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        keep: list[int] = []
        sampling: list[Request] = []
        width = max(len(request.blocks) for request, _ in batch)
        tables = []
        for request, n in batch:
            first, end = request.num_cached, request.num_cached + n
            input_ids.extend(request.tokens[first:end])
            positions.extend(range(first, end))
            blocks = request.blocks
            slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(first, end))
            seq_lens.append(end)
            starts.append(starts[-1] + n)
            tables.append(blocks + [0] * (width - len(blocks)))
            request.num_cached = end
            if end == len(request.tokens):
                keep.append(starts[-1] - 1)
                sampling.append(request)
        plan = StepPlan.build(input_ids, positions, slots, seq_lens, starts, keep, tables, self.device)
        tokens = self._forward(plan).argmax(-1).tolist()
        return list(zip(sampling, tokens))

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        """The logits of the step's sampled positions (a tensor-parallel leader sends the plan
        to its workers first)."""
        return plan.forward(self.model, self.cache)

    def _account(self, batch, generated: int, finished: int, elapsed: float) -> None:
        s = self.stats
        s.steps += 1
        s.step_tokens = sum(n for _, n in batch)
        s.last_step_s = elapsed
        s.generated_tokens += generated
        s.finished += finished
        s.running, s.waiting = len(self.running), len(self.waiting)
        self._rate.append((elapsed, generated))
        seconds = sum(t for t, _ in self._rate)
        s.tokens_per_s = sum(g for _, g in self._rate) / seconds if seconds > 0 else 0.0


# Note [Scheduling]
# Running requests come first, oldest first: each gets its remaining tokens (one when decoding,
# the rest of its prompt when prefilling), within max_batch_tokens; a prompt longer than what is
# left is prefilled in chunks over several steps, and only a request whose last token is in the
# step gets a new token (logits_to_keep selects exactly those positions). Waiting requests are
# admitted after, front first, while tokens, max_running and blocks allow; none is admitted in a
# step that preempted (the memory just proved short).
#
# Note [Preemption]
# When alloc returns None (a lowered limit, a global budget taken by another instance, a full
# cache) the newest running request is preempted: its blocks are freed, its cached count reset,
# and it goes back to the front of the waiting queue with the tokens it generated so far. When it
# is admitted again its prompt and those tokens are recomputed in one prefill, so the tokens that
# follow are the ones it would have produced without the interruption; no request is dropped. If
# the request that needs a block is itself the newest, it is the one preempted.
