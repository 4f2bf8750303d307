"""Continuous batching over a paged KV cache: requests join and leave at any step.

Each step packs every scheduled request's new tokens into one batch-1 sequence with explicit
position ids and runs the model once; attention finds each request's blocks through the step
metadata (kvcached.serving.attention). Greedy decoding.

The loop is cut at a handoff object, by state, as vLLM cuts its scheduler from its model
runner (Note [Rooms of the loop]):

- kvcached.serving.scheduler: the requests, their queues, blocks and block-table rows and the
  numpy mirror of their counters; admission, preemption, a fair budget's cap and block moves;
  the commit. It returns a plain SchedulerOutput and imports no torch.
- kvcached.serving.runner: what the device reads (the persistent step buffers, the decode
  runner and its CUDA graphs, the pad block); runs a SchedulerOutput, tokens in and out.
- kvcached.serving.swap: the host copies of preempted requests' K/V and their byte bound.
- here, ServingLoop: step = schedule -> run -> commit, steps ahead, run_until_done and stats.

See Note [Failed steps] and Note [Steps ahead].
"""

from __future__ import annotations

import _signal
import signal
import threading
import time
from typing import Self

import numpy as np
import torch

from kvcached.checks import as_int

from .attention import ATTENTION_NAME
from .plan import StepPlan
from .runner import Launched, ModelRunner
from .scheduler import Request, Scheduler, SchedulerOutput
from .stats import LoopStats, StepClock
from .swap import SWAP_BYTES, HostSwap, SwappedKV

_NO_TOKENS = np.zeros(0, np.int64)


class LoopStalledError(RuntimeError):
    """No request made progress for ``stall_timeout_s``: the memory limit or the budget is below
    what one request needs, or the memory is held elsewhere. The requests stay queued, and the
    ones that finished stay on the loop (``take_finished()``, or the next run_until_done)."""


class _HeldInterrupt:
    """Holds SIGINT off while the loop moves requests between its queues, then delivers it to
    the handler that was there: a Ctrl-C lands in the model call, where an exception changes
    nothing, or between steps. Only on the main thread (the only one signals reach), and only
    under a handler set from Python. See Note [Failed steps] and Note [Signal calls]."""

    def __enter__(self) -> None:
        self.previous = self.caught = None
        if threading.current_thread() is threading.main_thread():
            previous = _signal.getsignal(signal.SIGINT)
            if previous is not None:
                self.previous = previous
                _signal.signal(signal.SIGINT, self._hold)

    def _hold(self, signum, frame) -> None:
        self.caught = (signum, frame)

    def __exit__(self, *exc) -> None:
        if self.previous is None:
            return
        _signal.signal(signal.SIGINT, self.previous)
        if self.caught is None:
            return
        if callable(self.previous):
            self.previous(*self.caught)
        elif self.previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)


class ServingLoop:
    """Greedy continuous batching of a transformers causal LM over a PagedKVCache.

    The model must be built with ``attn_implementation=kvcached.serving.ATTENTION_NAME``
    (``build_model`` does). max_batch_tokens caps the tokens of one step (prompts are prefilled in
    chunks within it); max_running caps the requests in flight; max_tokens caps prompt + new
    tokens of one request (None: what the cache and the model's positions allow; it sets the
    width of the block tables every step carries). The step buffers for these are allocated
    when the loop is made; ValueError, naming the bounds, if they would not fit in memory
    (Note [Step buffer bounds]).

    cuda_graphs: decode-only steps run through a runner of static, padded buffers, a CUDA graph
    per padded batch size (kvcached.serving.graphs). None turns it on for a model on CUDA, off
    elsewhere; True on the CPU runs the same runner eagerly (no capture: what CPU tests check).
    With it the loop holds one block of the cache, the pad block, until close() (Note [Pad
    block]). ``capture_graphs()`` captures every batch size up front; otherwise each is captured
    on its first use.

    compile_model: every step calls ``torch.compile(model, dynamic=True, fullgraph=True)`` instead
    of the model itself, one compiled program for every batch size (kvcached's attention stays one
    opaque operator: Note [A compiled model]). It fuses the small ops transformers launches one by
    one (norms, rotary embedding, activations), which a CUDA graph replays but cannot merge. The
    first steps of each new shape class compile (seconds to minutes); tokens stay those of the
    uncompiled model up to floating-point rounding.

    overlap: a decode step through the runner that leaves every request running (nothing
    waiting, no request finishing, nothing beyond a fair cap) is not waited for: the next step
    is scheduled, packed and launched first, its tokens fed from the device, and then the
    earlier step's tokens are read and committed, so the host's work between steps runs while
    the device computes (Note [Steps ahead]). Requests then trail the device by one step
    between step() calls; abort, close, capture_graphs and check_invariants first wait for the
    step still running. Tokens are those of overlap=False. None turns it on where the runner
    replays CUDA graphs (a model on CUDA), off elsewhere (about 1.4 % more new tokens/s end to
    end on an H200: benchmarks/README.md).

    swap_bytes: host memory the loop may keep preempted requests' K/V in (default 4 GiB; on CUDA
    pinned, which torch's host allocator keeps cached for reuse once it was used): a preempted
    request's cached blocks are copied to the host before they are freed
    and copied back when it is admitted again, instead of recomputing its prompt and tokens
    (Note [Swapping out]). A preemption beyond it, or whose host memory cannot be had, recomputes
    as with 0. Tokens are the same either way.

    A step that raises (the model call: device out of memory, a kernel error, Ctrl-C; or the
    cache's alloc) changes no request's tokens or cached count: call step() or run_until_done()
    again and it redoes that work, the tokens as in an undisturbed run (Note [Failed steps]).
    Finished requests stay on the loop until step(), run_until_done() or take_finished() hands
    them out. Close the cache only when no step runs: a step over a closed cache raises
    KVCachedClosedError.
    """

    scheduler_class = Scheduler             # what schedules (a subclass may change its policy)

    def __init__(self, model, cache, *, max_batch_tokens: int = 2048, max_running: int = 256,
                 max_tokens: int | None = None, cuda_graphs: bool | None = None, compile_model: bool = False,
                 overlap: bool | None = None, swap_bytes: int = SWAP_BYTES):
        implementation = getattr(model.config, "_attn_implementation", None)
        if implementation != ATTENTION_NAME:
            raise ValueError(f"the model runs attn_implementation={implementation!r}; build it with "
                             f"attn_implementation={ATTENTION_NAME!r} (kvcached.serving.build_model does) or call "
                             f"model.set_attn_implementation({ATTENTION_NAME!r})")
        self.model = model
        # what each step calls: the model, or its compiled program
        self.step_model = torch.compile(model, dynamic=True, fullgraph=True) if compile_model else model
        self.cache = cache
        self.max_batch_tokens = as_int(max_batch_tokens, "max_batch_tokens", minimum=1, error=ValueError)
        self.max_running = as_int(max_running, "max_running", minimum=1, error=ValueError)
        swap_bytes = as_int(swap_bytes, "swap_bytes", minimum=0, error=ValueError)
        self.device = next(model.parameters()).device
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        blocks = cache.num_blocks - 1 if cuda_graphs else cache.num_blocks     # the pad block is not a request's
        most = min(blocks * cache.block_size, getattr(model.config, "max_position_embeddings", 1 << 62))
        self.max_tokens = most if max_tokens is None else as_int(
            max_tokens, "max_tokens", minimum=1, maximum=most, error=ValueError,
            hint="the cache's blocks (but the pad block) x block_size and the model's max_position_embeddings "
                 "bound it")
        self.stats = LoopStats()
        self.model_runner = ModelRunner(
            self.step_model, cache, self.stats, max_batch_tokens=self.max_batch_tokens,
            max_running=self.max_running, width=-(-max(self.max_tokens, 1) // cache.block_size),
            device=self.device, cuda_graphs=cuda_graphs, forward=self._forward)
        self.swap = HostSwap(cache, swap_bytes)
        self.scheduler = self.scheduler_class(
            cache, self.model_runner.buffers, self.swap, self.stats, max_batch_tokens=self.max_batch_tokens,
            max_running=self.max_running, max_tokens=self.max_tokens, vocab_size=model.config.vocab_size,
            copy_blocks=self._copy_blocks, swap_out=self._swap_out, swap_in=self._copy_swapped_in)
        self._clock = StepClock(self.stats)
        runner = self.model_runner.decode
        self.overlap = (runner is not None and runner.capture) if overlap is None else bool(overlap)
        self._ahead: Launched | None = None     # a launched decode step not committed yet (Note [Steps ahead])

    # -- the rooms' state, read where callers always read it ------------------------------------
    waiting = property(lambda self: self.scheduler.waiting, doc="The waiting requests, in admission order.")
    running = property(lambda self: self.scheduler.running, doc="The running requests, oldest first.")
    counters = property(lambda self: self.scheduler.counters, doc="The running requests' RowCounters.")
    buffers = property(lambda self: self.model_runner.buffers, doc="The runner's StepBuffers.")
    runner = property(lambda self: self.model_runner.decode, doc="The DecodeRunner (None without graphs).")
    pad_block = property(lambda self: self.model_runner.pad_block, doc="See Note [Pad block].")
    swap_bytes = property(lambda self: self.swap.swap_bytes, doc="The bound on the host copies' bytes.")
    swapped_bytes = property(lambda self: self.swap.swapped_bytes, doc="Host bytes the waiting requests hold.")

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], max_new_tokens: int) -> int:
        """Queue a request; returns its id. Raises ValueError for an empty prompt, token ids
        outside the vocabulary, or a request longer than the cache or the model can hold."""
        return self.scheduler.add_request(prompt_ids, max_new_tokens)

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def abort(self, request_id: int) -> bool:
        """Drop a waiting or running request (its client left), freeing its blocks; False if it
        is not here (finished, aborted or never added)."""
        self._finish_ahead()
        return self.scheduler.abort(request_id)

    def check_invariants(self) -> None:
        """Raise AssertionError unless every request's state agrees with its queue and no block id
        is held twice, then check the cache's own invariants. O(requests + blocks); for tests,
        after any step, failed ones included. The pad block (Note [Pad block]) counts as held."""
        self._finish_ahead()
        self.scheduler.check_invariants(self.model_runner.pinned())
        self.cache.check_invariants()

    # -- one step: See Note [Failed steps] ------------------------------------------------------
    def step(self) -> list[Request]:
        """Schedule, run the model once over the packed batch, append one greedy token to every
        request whose prompt is complete; returns the requests that finished (blocks freed),
        with any an interrupted step left. Raises KVCachedClosedError over a closed cache; an
        exception from the schedule or the model call leaves every request as it was, one from
        freeing the finished requests' blocks comes after the step's work is done (See Note
        [Failed steps])."""
        self._step()
        return self.take_finished()

    def take_finished(self) -> list[Request]:
        """The finished requests not handed out yet (by step or run_until_done), oldest first."""
        finished, self.scheduler.finished = self.scheduler.finished, []
        return finished

    def run_until_done(self, *, stall_timeout_s: float = 60.0) -> dict[int, list[int]]:
        """Step until no request is left; returns {request id: generated tokens} of every request
        that finished since the loop last handed any out.

        Raises LoopStalledError (a RuntimeError) when no request got further than it ever had for
        stall_timeout_s (a limit or budget below what one request needs, memory held elsewhere);
        the finished requests stay on the loop then, as after any other exception."""
        scheduler = self.scheduler
        stalled_since = None
        progress = scheduler.progress
        while self.has_work():
            self._step()
            if scheduler.progress != progress:
                progress, stalled_since = scheduler.progress, None
                continue
            now = time.monotonic()
            stalled_since = stalled_since or now
            if now - stalled_since > stall_timeout_s:
                raise LoopStalledError(
                    f"no memory for any request to make progress for {stall_timeout_s} s ({len(self.waiting)} "
                    f"waiting, {len(self.running)} running, {self.stats.preemptions} preemptions): the memory limit "
                    f"or the budget is below what one request needs, or the memory is held elsewhere; raise the "
                    f"limit or the budget. {len(scheduler.finished)} finished request(s) stay on the loop: "
                    f"take_finished() or the next run_until_done() returns them")
            if not self.stats.step_tokens:
                time.sleep(0.001)
        results = {request.id: request.generated for request in scheduler.finished}
        scheduler.finished = []                         # once built: a Ctrl-C in between loses nothing
        return results

    def _step(self) -> None:
        self.cache.check_open()
        start = time.perf_counter()
        if self._ahead is not None:
            output = self._next_decode()
            if output is not None:
                self._step_ahead(output, start)
                return
            self._finish_ahead()
        with _HeldInterrupt():
            output = self.scheduler.schedule(self.model_runner.pinned())
        if not output.requests:
            self._commit_step(output, start, _NO_TOKENS)
            return
        launched = self.model_runner.run(output)        # raises: nothing was committed
        launched.started = start
        with _HeldInterrupt():
            if self._stays_ahead(launched):
                self._go_ahead(launched)
                return
        self._commit_step(output, start, self.model_runner.receive(launched))

    def _count(self, tokens: int, started: float, generated: int, finished: int) -> None:
        self._clock.count(tokens, started, generated, finished, len(self.scheduler.running),
                          len(self.scheduler.waiting))

    def _commit_step(self, output: SchedulerOutput, started: float, tokens: np.ndarray) -> None:
        with _HeldInterrupt():
            done = self.scheduler.commit(output, tokens)
            self._count(output.tokens, started, len(tokens), len(done))
            self.scheduler.release_all(done)

    # -- a step ahead: See Note [Steps ahead] ---------------------------------------------------
    def _stays_ahead(self, launched: Launched) -> bool:
        """Whether a step just launched may stay on the device uncommitted while the next one is
        launched: the runner ran it over every running request, none finishes with it, and the
        next step can only be those requests again (nothing waiting, nothing beyond a fair cap)."""
        return (self.overlap and launched.device_tokens is not None
                and self.scheduler.decodes_again(launched.output))

    def _go_ahead(self, launched: Launched) -> None:
        """Leave `launched` on the device: its requests' counters move on now, their tokens come
        at its commit (_finish_ahead, or the next step's)."""
        self.scheduler.count_ahead(launched.output)
        self._ahead = launched

    def _next_decode(self) -> SchedulerOutput | None:
        """The step after the one ahead, if it is that step's requests decoding again (their
        next blocks given); None when the loop must catch up first (requests waiting, blocks
        beyond a fair cap, a block refused, no pad block)."""
        if not self.scheduler.same_requests_next() or self.model_runner.pad_block is None:
            return None
        with _HeldInterrupt():
            return self.scheduler.schedule_decode()

    def _step_ahead(self, output: SchedulerOutput, start: float) -> None:
        """Launch `output` behind the step ahead (its tokens fed on the device), then commit that
        one; the new step stays ahead in turn, or is waited for and committed."""
        try:
            launched = self.model_runner.run(output, feed=self._ahead.device_tokens)
        except BaseException:
            self._finish_ahead()
            raise
        launched.started = start
        with _HeldInterrupt():
            stays = self._stays_ahead(launched)
            self._finish_ahead()                        # raises: `output` is a failed step
            self.stats.steps_ahead += 1
            if stays:
                self._go_ahead(launched)
        if not stays:
            self._commit_step(output, start, self.model_runner.receive(launched))

    def _finish_ahead(self) -> None:
        """Wait for the step ahead, if any, and commit it; if the wait raises, its requests'
        counters go back to before it (Note [Failed steps])."""
        if self._ahead is None:
            return
        with _HeldInterrupt():
            ahead, self._ahead = self._ahead, None
            try:
                tokens = self.model_runner.receive(ahead)
            except BaseException:
                self.scheduler.uncount_ahead(ahead.output)
                raise
            self.scheduler.commit_ahead(ahead.output, tokens)
            self._count(ahead.output.tokens, ahead.started, len(tokens), 0)

    # -- the graphs and closing -----------------------------------------------------------------
    def capture_graphs(self) -> int:
        """Capture the decode graph of every batch size not captured yet, largest first (they
        share one memory pool); returns how many the loop holds. Does nothing where the runner
        does not capture (cuda_graphs off, or not on CUDA). Raises RuntimeError when the cache
        has no block free for the pad block (Note [Pad block])."""
        self._finish_ahead()
        return self.model_runner.capture_graphs()

    def close(self) -> None:
        """Give the pad block back (unless the cache was closed: it went with it) and drop the
        decode graphs, after the step still running, if any (Note [Steps ahead]); idempotent.
        Later steps run eagerly."""
        try:
            self._finish_ahead()
        finally:
            self.model_runner.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the device hooks: what TensorParallelLoop extends to every rank ------------------------
    def _forward(self, plan: StepPlan) -> torch.Tensor:
        """The logits of the step's sampled positions (a tensor-parallel leader sends the plan
        to its workers first)."""
        return plan.forward(self.step_model, self.cache)

    def _copy_blocks(self, old: list[int], new: list[int]) -> None:
        """Queue the copy of every layer's K/V of blocks `old` into `new` (the tensor-parallel
        loop has every rank copy)."""
        self.cache.copy_blocks(old, new)

    def _swap_out(self, request: Request) -> SwappedKV | None:
        """A host copy of what the request has cached, or None (recompute it): HostSwap.copy_out
        (the tensor-parallel loop has every rank copy)."""
        return self.swap.copy_out(request)

    def _copy_swapped_in(self, request_id: int, host: torch.Tensor, ids: list[int]) -> None:
        """Queue the write of a request's host copy into blocks `ids` (the tensor-parallel loop
        has every rank write its own)."""
        self.swap.copy_in(host, ids)


# Note [Rooms of the loop]
# ServingLoop held queues, admission, preemption, host swap, a fair budget's following and block
# moves, the pad block and graphs, packing and launch, steps ahead, commit and stats in one class
# of 50 methods, and one object (_Batch) was both the schedule's result and the launch's scratch.
# It is cut where the state is cut, as vLLM cuts its scheduler from its model runner: the
# scheduler owns the requests and what mirrors them (queues, block ids, rows, counters) and decides;
# the runner owns what the device reads (buffers, graphs, pad block) and executes; the host copies
# and their bound are a third room; the loop only sequences them. What passes between them is a
# SchedulerOutput (what runs, with which input tokens) and a Launched step (where its tokens come
# back). Two things cross on purpose: the scheduler writes the block-table rows through the
# buffers' row calls, at the moment it hands blocks out, so that a schedule that raises half-way
# leaves every row agreeing with its request (Note [Failed steps]); and the pad block's id goes to
# the scheduler as a pinned block. The device work the scheduler starts (moved blocks, host copies
# out and in) and the runner's eager model call go through four hooks of the loop (_forward,
# _copy_blocks, _swap_out, _copy_swapped_in), so that TensorParallelLoop extends them to every
# rank as it did before, with super(). Steps ahead stay in the loop: they are an order of
# schedule, run and commit, not a state of either room. Another scheduling policy is a subclass
# of Scheduler named by ServingLoop.scheduler_class (as vLLM's scheduler_cls names one).
#
# Note [Failed steps]
# A step is schedule -> model call -> commit. Only the commit changes what a request has done
# (its cached count, its tokens, its leaving), and only after the model call returned; the
# schedule only hands blocks out, preempts and admits, all of which a later step redoes or keeps.
# So any exception from the model call (device out of memory, a kernel error, Ctrl-C) leaves
# every request as it was, and the next step runs the same work again: the K/V it had written
# lie past each request's cached count and are written again. Before, the cached count moved
# before the call: a failed chunk of a prefill was skipped (its tokens silently different) and a
# decoding request made every later step raise. Ctrl-C can land between any two bytecodes, so
# schedule and commit hold SIGINT off (_HeldInterrupt) and deliver it once the queues agree.
# The commit moves counts, tokens and finished requests first, which cannot fail, and frees the
# finished requests' blocks last: a free that raises (a closed cache, a tensor-parallel peer
# gone) finds every request consistent, the other frees still run, and a request whose free
# failed keeps its block ids. Preemption and abort free first and move the request after, so a
# raising free leaves the request where it was.
#
# Note [Signal calls]
# _HeldInterrupt swaps the SIGINT handler twice per step, through _signal (the C module that
# signal wraps): signal.getsignal and signal.signal turn every handler they return into a
# signal.Handlers member when they can, and for a function that costs a failed enum lookup,
# about 10 us each: four of them were 40-70 us of a step's host time. _signal's functions are
# the same calls without that conversion (SIG_DFL and SIG_IGN come back as the plain ints they
# equal), 1-2 us per step in all.
#
# Note [Stalls]
# Progress is a request getting further than it ever had (most_cached) or a token generated,
# not a step that ran: a request whose prompt is longer than max_batch_tokens under a limit
# that fits one chunk but not two prefilled its first chunk, preempted itself, was admitted again
# and prefilled the same chunk, forever (600-2700 preemptions per 30 s), while the old check saw
# a step run every other step and never fired. The newest request is the one preempted, so the
# oldest always gets further unless even it alone does not fit: then run_until_done raises.
#
# Note [Steps ahead]
# Between two decode steps the host commits the last one (appends its tokens, moves the row
# counters, finds the finished requests) and schedules and packs the next, and the device idles
# meanwhile: 0.5-0.7 ms a step on the H200 at batch 64-256, 5-7 % of a compiled graph step.
# With overlap=True a decode step run by the runner that leaves every request running is not
# waited for (_go_ahead): its rows' cached and length counters move on at once, which is all the
# next step's schedule needs (the loop has no end-of-sequence token, so which requests run next
# does not depend on the tokens), and the next step is scheduled (Scheduler._decoding), packed
# and launched (_step_ahead) before the host reads the earlier step's tokens and commits them
# (Scheduler.commit_ahead).
# The next step's input tokens are the earlier step's outputs, still on the device: after the
# plan's host-to-device copy, a device copy puts them into the plan's input ids, in stream order
# after the earlier step wrote them and before the next one reads them (the batch is the same
# requests in the same order, so lane i feeds lane i, and the same padded size, so the same
# graph). The tokens come back through two pinned buffers in turn, so the next step's copy never
# lands on the one the host is about to read. A step stays ahead only while nothing could change
# the batch: the runner ran it over every running request, none finishes with it, nothing waits
# and the cache holds nothing beyond a fair budget's cap (with nothing waiting its demand is none,
# so it caps nobody else; a cap that comes meanwhile is followed one step later, at the next
# schedule); otherwise, or when the next step's alloc is refused, the loop
# commits the step ahead first (_finish_ahead) and steps as without overlap, and so do abort,
# close, capture_graphs and check_invariants. A failure keeps Note [Failed steps]: a next step
# that fails to launch commits the step ahead and raises; a wait that fails moves the step
# ahead's counters back (a step launched behind it was never counted), so the requests are as
# before those steps and the next call redoes them. SIGINT is held while a step is committed or
# counted ahead, so the counters and the requests never part. Frees stay behind a wait for the
# device: finished requests leave only in a committed step, preemption happens only in a step
# that committed the step ahead first.
