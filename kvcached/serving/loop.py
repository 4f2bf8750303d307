"""Continuous batching over a paged KV cache: requests join and leave at any step.

Each step packs every scheduled request's new tokens into one batch-1 sequence with explicit
position ids and runs the model once; attention finds each request's blocks through the step
metadata (kvcached.serving.attention). The step's inputs are packed into persistent buffers
(kvcached.serving.buffers); decode-only steps replay a CUDA graph (kvcached.serving.graphs).
The running requests' counters are mirrored in numpy (kvcached.serving.counters), so that a
decode step is scheduled and committed without walking the requests more than once.
Greedy decoding. See Note [Scheduling], Note [Preemption] and Note [Pad block].
"""

from __future__ import annotations

import _signal
import bisect
import collections
import itertools
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Self

import numpy as np
import torch

from kvcached.checks import as_int
from kvcached.sizes import format_bytes

from .attention import ATTENTION_NAME
from .buffers import StepBuffers
from .counters import RowCounters
from .graphs import DecodeRunner
from .plan import StepPlan

RATE_WINDOW = 32                # steps over which stats.tokens_per_s is measured
SWAP_BYTES = 4 << 30            # host memory a loop may keep preempted requests' K/V in, by default


def step_buffer_bytes(tokens: int, rows: int, width: int) -> int:
    """Host bytes a loop allocates when it is made, for steps of `tokens` tokens (the larger of
    max_batch_tokens and max_running) of at most `rows` requests (max_running) whose block
    tables are `width` wide: StepBuffers' staging (StepPlan.data_len values), block-table mirror,
    arange and two token buffers, and RowCounters' five counters per row, every value 8 bytes.
    On CUDA the device holds a copy of the staging. See Note [Step buffer bounds]. O(1)."""
    return 8 * (StepPlan.data_len((tokens, rows, width, rows)) + rows * width + tokens + 1 + 7 * rows)


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
class SwappedKV:
    """A preempted request's K/V kept on the host (Note [Swapping out]): the first `cached`
    tokens' blocks, as PagedKVCache.swap_out copied them."""

    host: torch.Tensor
    cached: int


@dataclass
class Request:
    """One generation request; `tokens` is the prompt followed by what was generated so far."""

    id: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0             # tokens whose K/V are in the cache
    most_cached: int = 0            # the most tokens it ever had cached (progress: Note [Stalls])
    preemptions: int = 0
    row: int = -1                   # its block-table row while running (kvcached.serving.buffers)
    swapped: SwappedKV | None = None    # its K/V on the host while it waits after a preemption

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
    swapped_out: int = 0            # preemptions that kept the request's K/V on the host (Note [Swapping out])
    swapped_in: int = 0             # readmissions that copied it back instead of recomputing it
    blocks_moved: int = 0           # blocks moved to empty pages instead of preempting (Note [Fair share in the loop])
    generated_tokens: int = 0
    steps: int = 0
    step_tokens: int = 0            # tokens the last step ran through the model
    last_step_s: float = 0.0        # the last committed step's time (from its start or the commit before, the later)
    tokens_per_s: float = 0.0       # generated tokens per second over the last RATE_WINDOW steps
    runner_steps: int = 0           # decode steps run by the padded decode runner (graphs or not)
    graph_replays: int = 0          # of those, CUDA graph replays
    eager_steps: int = 0            # steps whose model call ran eagerly (prefill, mixed, graphs off)
    steps_ahead: int = 0            # decode steps launched before the last one's tokens were read (overlap)
    last_forward_s: float = 0.0     # host time of the last step's model call (the replay's launch)
    last_wait_s: float = 0.0        # time the last step waited for the device's tokens


@dataclass
class _Batch:
    """One step's work: requests[i] runs counts[i] (tokens in all) new tokens from position
    first[i] (its cached count), through block-table row rows[i]; requests is a prefix of the
    running list (Note [Scheduling]). `sample` (set by _run): whether request i's last token is
    in the step."""

    requests: list[Request]
    rows: np.ndarray
    first: np.ndarray
    counts: np.ndarray
    tokens: int
    sample: np.ndarray | None = None
    slot: int = 0                       # the token buffer its tokens come back in (set by _run)
    device_tokens: torch.Tensor | None = None   # its tokens on the device, when the runner ran it
    started: float = 0.0                # when its step began (perf_counter)


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
    replays CUDA graphs (a model on CUDA), off elsewhere; on an H200 it took end-to-end serving
    from 9297 to 9431 new tokens/s (benchmarks/README.md).

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
        self.swap_bytes = as_int(swap_bytes, "swap_bytes", minimum=0, error=ValueError)
        self.swapped_bytes = 0                  # host bytes the waiting requests' SwappedKV hold
        self.device = next(model.parameters()).device
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        blocks = cache.num_blocks - 1 if cuda_graphs else cache.num_blocks     # the pad block is not a request's
        most = min(blocks * cache.block_size, getattr(model.config, "max_position_embeddings", 1 << 62))
        self.max_tokens = most if max_tokens is None else as_int(
            max_tokens, "max_tokens", minimum=1, maximum=most, error=ValueError,
            hint="the cache's blocks (but the pad block) x block_size and the model's max_position_embeddings "
                 "bound it")
        width = -(-max(self.max_tokens, 1) // cache.block_size)
        _refuse_buffers_beyond_memory(self.max_batch_tokens, self.max_running, width, self.device)
        self.buffers = StepBuffers(max_running=self.max_running,
                                   max_tokens_per_step=max(self.max_batch_tokens, self.max_running),
                                   width=width, block_size=cache.block_size, device=self.device)
        self.counters = RowCounters(self.max_running, cache.block_size)     # See Note [Row counters]
        self.runner = DecodeRunner(self.step_model, cache, self.max_running, capture=self.device.type == "cuda") \
            if cuda_graphs else None
        self.pad_block: int | None = None       # See Note [Pad block]
        if self.runner is not None:
            self._take_pad_block()
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._running_rows: np.ndarray | None = None   # the running requests' rows; None: build again
        self.stats = LoopStats()
        self._next_id = 0
        self._rate: collections.deque[tuple[float, int]] = collections.deque(maxlen=RATE_WINDOW)
        self._committed_at = 0.0                # perf_counter of the last step's commit
        self._finished: list[Request] = []      # finished, not handed out yet
        self._progress = 0                      # steps in which some request got further than ever
        self.overlap = (self.runner is not None and self.runner.capture) if overlap is None else bool(overlap)
        self._ahead: _Batch | None = None       # a launched decode step not committed yet (Note [Steps ahead])
        self._requeued = 0                      # streaming requests this schedule preempted (Note [Preemption])

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
                             f"{self.max_tokens} tokens one request can hold (the loop's max_tokens, at most the "
                             f"cache's blocks x block_size and max_position_embeddings); shorten it, or give the "
                             f"loop a larger max_tokens or the cache more blocks")
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
        self._finish_ahead()
        for queue in (self.running, self.waiting):
            for index, request in enumerate(queue):
                if request.id == request_id:
                    self._release(request)          # first: if the free raises, the request stays
                    self._drop_swap(request)
                    del queue[index]
                    self._running_rows = None
                    self._give_row(request)
                    self.stats.running, self.stats.waiting = len(self.running), len(self.waiting)
                    if self.cache.shares_budget and queue is self.waiting:
                        self._report_demand()       # no step may come to clear it
                    return True
        return False

    def check_invariants(self) -> None:
        """Raise AssertionError unless every request's state agrees with its queue and no block id
        is held twice, then check the cache's own invariants. O(requests + blocks); for tests,
        after any step, failed ones included. The pad block (Note [Pad block]) counts as held."""
        problems = []
        seen: set[int] = set()
        self._finish_ahead()
        held: set[int] = set() if self.pad_block is None else {self.pad_block}
        rows: set[int] = set()
        swapped = 0
        size = self.cache.block_size
        queues = (("running", self.running), ("waiting", self.waiting), ("finished", self._finished))
        for name, queue in queues:
            for request in queue:
                if request.id in seen:
                    problems.append(f"request {request.id} is in two places")
                seen.add(request.id)
                if held & set(request.blocks) or len(set(request.blocks)) != len(request.blocks):
                    problems.append(f"request {request.id} ({name}) holds a block id held twice")
                held.update(request.blocks)
                if request.done != (name == "finished"):
                    problems.append(f"request {request.id} is {name} with {len(request.generated)} of "
                                    f"{request.max_new_tokens} tokens")
                if name == "running" and not (0 <= request.num_cached < len(request.tokens)
                                              and request.num_cached <= len(request.blocks) * size
                                              and len(request.blocks) <= -(-len(request.tokens) // size)):
                    problems.append(f"running request {request.id}: {request.num_cached} tokens cached of "
                                    f"{len(request.tokens)}, {len(request.blocks)} blocks")
                if name == "waiting" and (request.num_cached or request.blocks):
                    problems.append(f"waiting request {request.id} has {request.num_cached} tokens cached in "
                                    f"{len(request.blocks)} blocks")
                if request.swapped is not None:
                    swapped += request.swapped.host.nbytes
                    if name != "waiting" or not 0 < request.swapped.cached < len(request.tokens):
                        problems.append(f"request {request.id} ({name}) keeps {request.swapped.cached} tokens "
                                        f"swapped out of {len(request.tokens)}")
                if (request.row >= 0) != (name == "running") or request.row in rows:
                    problems.append(f"request {request.id} ({name}) has block-table row {request.row}")
                elif name == "running":
                    rows.add(request.row)
                    if self.buffers.row(request.row)[:len(request.blocks)].tolist() != request.blocks:
                        problems.append(f"request {request.id}'s block-table row is not its blocks")
                    disagreement = self.counters.disagreement(request.row, request)
                    if disagreement:
                        problems.append(f"request {request.id}: {disagreement}")
        if self._running_rows is not None and self._running_rows.tolist() != [r.row for r in self.running]:
            problems.append("the running requests' rows are stale")
        if swapped != self.swapped_bytes or swapped > self.swap_bytes:
            problems.append(f"the swapped-out requests hold {swapped} bytes, the loop counts {self.swapped_bytes} "
                            f"(swap_bytes={self.swap_bytes})")
        if len(self.running) > self.max_running:
            problems.append(f"{len(self.running)} running, max_running={self.max_running}")
        assert not problems, "; ".join(problems)
        self.cache.check_invariants()

    # -- one step -------------------------------------------------------------------------------
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
        finished, self._finished = self._finished, []
        return finished

    def run_until_done(self, *, stall_timeout_s: float = 60.0) -> dict[int, list[int]]:
        """Step until no request is left; returns {request id: generated tokens} of every request
        that finished since the loop last handed any out.

        Raises LoopStalledError (a RuntimeError) when no request got further than it ever had for
        stall_timeout_s (a limit or budget below what one request needs, memory held elsewhere);
        the finished requests stay on the loop then, as after any other exception."""
        stalled_since = None
        progress = self._progress
        while self.has_work():
            self._step()
            if self._progress != progress:
                progress, stalled_since = self._progress, None
                continue
            now = time.monotonic()
            stalled_since = stalled_since or now
            if now - stalled_since > stall_timeout_s:
                raise LoopStalledError(
                    f"no memory for any request to make progress for {stall_timeout_s} s ({len(self.waiting)} "
                    f"waiting, {len(self.running)} running, {self.stats.preemptions} preemptions): the memory limit "
                    f"or the budget is below what one request needs, or the memory is held elsewhere; raise the "
                    f"limit or the budget. {len(self._finished)} finished request(s) stay on the loop: "
                    f"take_finished() or the next run_until_done() returns them")
            if not self.stats.step_tokens:
                time.sleep(0.001)
        results = {request.id: request.generated for request in self._finished}
        self._finished = []                             # once built: a Ctrl-C in between loses nothing
        return results

    def _step(self) -> None:
        self.cache.check_open()
        start = time.perf_counter()
        if self._ahead is not None:
            batch = self._next_decode()
            if batch is not None:
                self._step_ahead(batch, start)
                return
            self._finish_ahead()
        with _HeldInterrupt():
            batch = self._schedule()
        batch.started = start
        sampling: list[Request] = []
        tokens = np.zeros(0, np.int64)
        if batch.requests:
            sampling = self._run(batch)                 # raises: nothing was committed
            with _HeldInterrupt():
                if self._stays_ahead(batch):
                    self._go_ahead(batch)
                    return
            tokens = self._received(batch, len(sampling))
        self._commit_step(batch, sampling, tokens)

    def _commit_step(self, batch: _Batch, sampling: list[Request], tokens: np.ndarray) -> None:
        with _HeldInterrupt():
            done = self._commit(batch, sampling, tokens)
            self._account(batch, len(tokens), len(done))
            self._release_all(done)

    def _received(self, batch: _Batch, count: int) -> np.ndarray:
        waiting = time.perf_counter()
        tokens = self.buffers.received_tokens(count, batch.slot)
        self.stats.last_wait_s = time.perf_counter() - waiting
        return tokens

    # -- a step ahead: See Note [Steps ahead] ---------------------------------------------------
    def _stays_ahead(self, batch: _Batch) -> bool:
        """Whether a step just launched may stay on the device uncommitted while the next one is
        launched: the runner ran it over every running request, none finishes with it, and the
        next step can only be those requests again (nothing waiting, nothing beyond a fair cap)."""
        if not self.overlap or batch.device_tokens is None or len(batch.requests) != len(self.running):
            return False
        if not self._same_requests_next():
            return False
        counters = self.counters
        return bool((counters.length[batch.rows] + 1 < counters.end[batch.rows]).all())

    def _same_requests_next(self) -> bool:
        """Whether the next step can only run the running requests again: nothing waits to be
        admitted (so the demand last reported is none) and the cache holds nothing beyond a fair
        budget's cap (a cap that comes while a step is ahead is followed at the next schedule,
        one step later)."""
        return not self.waiting and self.cache.over_limit_blocks() <= 0 and self.cache.over_limit_pages() <= 0

    def _go_ahead(self, batch: _Batch) -> None:
        """Leave `batch` on the device: its requests' counters move on now, their tokens come at
        its commit (_finish_ahead, or the next step's)."""
        counters = self.counters
        counters.cached[batch.rows] += 1
        counters.length[batch.rows] += 1
        self._ahead = batch

    def _undo_ahead(self, batch: _Batch) -> None:
        counters = self.counters
        counters.cached[batch.rows] -= 1
        counters.length[batch.rows] -= 1

    def _next_decode(self) -> _Batch | None:
        """The step after the one ahead, if it is that step's requests decoding again (their
        next blocks given); None when the loop must catch up first (requests waiting, blocks
        beyond a fair cap, a block refused, no pad block)."""
        if not self._same_requests_next() or self.pad_block is None:
            return None
        with _HeldInterrupt():
            cached = self._decoding(self.max_batch_tokens)
        return None if cached is None else self._decode_batch(cached)

    def _step_ahead(self, batch: _Batch, start: float) -> None:
        """Launch `batch` behind the step ahead (its tokens fed on the device), then commit that
        one; `batch` stays ahead in turn, or is waited for and committed."""
        batch.started = start
        try:
            sampling = self._run(batch, feed=self._ahead.device_tokens)
        except BaseException:
            self._finish_ahead()
            raise
        with _HeldInterrupt():
            stays = self._stays_ahead(batch)
            self._finish_ahead()                        # raises: `batch` is a failed step
            self.stats.steps_ahead += 1
            if stays:
                self._go_ahead(batch)
        if not stays:
            self._commit_step(batch, sampling, self._received(batch, len(sampling)))

    def _finish_ahead(self) -> None:
        """Wait for the step ahead, if any, and commit it; if the wait raises, its requests'
        counters go back to before it (Note [Failed steps])."""
        if self._ahead is None:
            return
        with _HeldInterrupt():
            ahead, self._ahead = self._ahead, None
            try:
                tokens = self._received(ahead, len(ahead.requests))
            except BaseException:
                self._undo_ahead(ahead)
                raise
            self._commit_ahead(ahead, tokens)

    def _commit_ahead(self, batch: _Batch, tokens: np.ndarray) -> None:
        """The commit of a decode step whose counters moved at its launch. Raises nothing."""
        self._append_decoded(batch.requests, tokens.tolist())
        self.counters.last[batch.rows] = tokens
        self._progress += 1
        self._account(batch, len(tokens), 0)

    # -- scheduling -----------------------------------------------------------------------------
    def _schedule(self) -> _Batch:
        """The step's batch; See Note [Scheduling]."""
        budget = self.max_batch_tokens
        self._requeued = 0
        gave_back = self.cache.shares_budget and self._follow_budget()
        decoding = self._decoding(budget)
        if decoding is not None:
            counts, preempted = [], False           # one token each
            budget -= len(decoding)
        else:
            counts, preempted = self._schedule_running(budget)
            budget -= sum(counts)
        while self.waiting and budget and not (preempted or gave_back) and len(self.running) < self.max_running:
            request = self.waiting[0]
            cached = 0 if request.swapped is None else request.swapped.cached
            n = min(len(request.tokens) - cached, budget)
            if not self._grow(request, cached + n):
                break
            if request.swapped is not None:
                self._swap_in(request)
            self.waiting.popleft()
            self.running.append(request)
            self._running_rows = None
            request.row = self.buffers.take_row(request.blocks)
            self.counters.admit(request.row, request)
            counts.append(n)
            budget -= n
        tokens = self.max_batch_tokens - budget
        if decoding is not None and not counts:
            return self._decode_batch(decoding)
        if decoding is not None:
            counts = [1] * len(decoding) + counts
        requests = self.running[:len(counts)]
        rows = self._rows()[:len(counts)]
        return _Batch(requests, rows, self.counters.cached[rows], np.array(counts, np.int64), tokens)

    def _decode_batch(self, cached: np.ndarray) -> _Batch:
        """Every running request's next token, from its cached count: the decode fast path's batch."""
        return _Batch(self.running[:], self._rows(), cached, np.ones(len(cached), np.int64), len(cached))

    def _rows(self) -> np.ndarray:
        """The running requests' block-table rows, in order (built once per change of the list)."""
        if self._running_rows is None:
            self._running_rows = np.fromiter((r.row for r in self.running), np.int64, len(self.running))
        return self._running_rows

    def _decoding(self, budget: int) -> np.ndarray | None:
        """The decode fast path (Note [Row counters]): when every running request has just its
        next token to run and `budget` holds them all, give a block to each that needs one for
        it and return their cached counts, in running order; None (the general path schedules)
        otherwise, or when an alloc returns None."""
        running = self.running
        if not running or len(running) > budget:
            return None
        rows, counters = self._rows(), self.counters
        cached = counters.cached[rows]
        if not (counters.length[rows] - cached == 1).all():
            return None
        for i in np.flatnonzero(cached >= counters.room[rows]).tolist():
            if not self._grow(running[i], int(cached[i]) + 1):
                return None
        return cached

    def _schedule_running(self, budget: int) -> tuple[list[int], bool]:
        """The general path over the running requests: (their new tokens, in order, as long as the
        budget lasts; whether one was preempted)."""
        counts: list[int] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget:
            request = self.running[i]
            n = min(len(request.tokens) - request.num_cached, budget)
            if self._grow(request, request.num_cached + n):
                counts.append(n)
                budget -= n
                i += 1
                continue
            self._preempt_newest()              # See Note [Preemption]
            preempted = True
        return counts, preempted

    def _grow(self, request: Request, num_tokens: int) -> bool:
        """Give `request` blocks for num_tokens tokens; False (nothing changed) if none are left."""
        needed = -(-num_tokens // self.cache.block_size) - len(request.blocks)
        if needed <= 0:
            return True
        ids = self.cache.alloc(needed)
        if ids is None:
            return False
        if request.row >= 0:
            self.buffers.append(request.row, len(request.blocks), ids)
        request.blocks.extend(ids)
        if request.row >= 0:
            self.counters.room[request.row] = len(request.blocks) * self.cache.block_size
        return True

    def _follow_budget(self) -> bool:
        """Under a global budget: report what the waiting requests need as demand, and give back
        at once what the cache holds beyond its fair share: the newest requests preempted until
        the blocks beyond it are free, then the emptiest pages' blocks moved into the others'
        free slots, and holders of whatever must still empty preempted; True if anything went
        back. See Note [Fair share in the loop]."""
        self._report_demand()
        excess, pages = self.cache.over_limit_blocks(), self.cache.over_limit_pages()
        if (excess <= 0 and pages <= 0) or not self.running:
            return False
        while excess > 0 and self.running:
            excess -= len(self.running[-1].blocks)
            self._preempt_newest()
        if self.running:
            self._move_blocks(self.cache.plan_compaction([] if self.pad_block is None else [self.pad_block]))
            excess, pages = self.cache.over_limit_blocks(), self.cache.over_limit_pages()
            if excess > 0 or pages > 0:
                for request in self._page_emptying_victims(excess, pages):
                    self._preempt(request)
        return True

    def _move_blocks(self, moves: dict[int, int]) -> None:
        """Move the running requests' blocks as `moves` ({old id: new id}, the new ids allocated)
        says: copy their K/V, point the requests and their block-table rows at the new ids, free
        the old ones. Nothing moves (the new ids are freed) if an old id is no running request's."""
        if not moves:
            return
        old, new = list(moves), list(moves.values())
        holders = [(request, i) for request in self.running for i, block in enumerate(request.blocks)
                   if block in moves]
        if len(holders) != len(moves):
            self.cache.free(new)
            return
        try:
            self._copy_blocks(old, new)
        except BaseException:
            self.cache.free(new)
            raise
        for request, i in holders:
            request.blocks[i] = moves[request.blocks[i]]
        for request in {id(r): r for r, _ in holders}.values():
            self.buffers.append(request.row, 0, request.blocks)
        self.cache.free(old)
        self.stats.blocks_moved += len(moves)

    def _copy_blocks(self, old: list[int], new: list[int]) -> None:
        """Queue the copy of every layer's K/V of blocks `old` into `new` (the tensor-parallel
        loop has every rank copy)."""
        self.cache.copy_blocks(old, new)

    def _page_emptying_victims(self, excess: int, pages: int) -> list[Request]:
        """Running requests whose preemption empties at least `pages` pages and frees at least
        `excess` blocks, newest first: the page whose not yet chosen holders have computed the
        fewest tokens (the least work to redo) is emptied next. The pad block's page is never
        chosen. See Note [Fair share in the loop]."""
        holders: dict[int, set[int]] = collections.defaultdict(set)     # page -> indices into running
        for index, request in enumerate(self.running):
            for page in set(self.cache.pages_of(request.blocks)):
                holders[page].add(index)
        if self.pad_block is not None:
            for page in self.cache.pages_of([self.pad_block]):
                holders.pop(page, None)
        chosen: set[int] = set()
        freed = emptied = 0
        while (freed < excess or emptied < pages) and holders:
            emptied += 1
            page = min(holders, key=lambda p: sum(self.running[i].num_cached + 1 for i in holders[p] - chosen))
            for index in holders.pop(page) - chosen:
                chosen.add(index)
                freed += len(self.running[index].blocks)
        return [self.running[index] for index in sorted(chosen, reverse=True)]

    def _report_demand(self) -> None:
        """As the cache's demand, the blocks (prompt and tokens so far) of the waiting requests
        that the next step could admit: as many as max_batch_tokens and the free places among
        max_running take. The ones behind them wait for the model, not for memory. See Note
        [Fair share in the loop]."""
        size = self.cache.block_size
        tokens, places, blocks = self.max_batch_tokens, self.max_running - len(self.running), 0
        for request in itertools.islice(self.waiting, places):
            if tokens <= 0:
                break
            blocks += -(-len(request.tokens) // size)
            tokens -= len(request.tokens) - (0 if request.swapped is None else request.swapped.cached)
        self.cache.report_demand(blocks)

    def _preempt_newest(self) -> None:
        self._preempt(self.running[-1])

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and queue it again (first if it has no token yet,
        else behind the requests waiting before it: Note [Preemption]), its K/V kept on the
        host if swap_bytes allows (Note [Swapping out]), to be recomputed otherwise."""
        swapped = self._swap_out(request)
        self._release(request)                  # if the free raises, nothing changed (the copy is dropped)
        self.running.remove(request)
        self._running_rows = None
        self._give_row(request)
        request.num_cached = 0
        request.preemptions += 1
        if swapped is not None:
            request.swapped = swapped
            self.swapped_bytes += swapped.host.nbytes
            self.stats.swapped_out += 1
        if request.generated:
            self.waiting.insert(len(self.waiting) - self._requeued, request)
            self._requeued += 1
        else:
            self.waiting.appendleft(request)
        self.stats.preemptions += 1

    def _swap_out(self, request: Request) -> SwappedKV | None:
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

    def _swap_in(self, request: Request) -> None:
        """Copy a readmitted request's swapped-out K/V into the blocks it was just given. If the
        copy raises, the blocks go back and the request waits, to be recomputed."""
        swapped = request.swapped
        assert swapped is not None
        try:
            self._copy_swapped_in(request.id, swapped.host, request.blocks[:swapped.host.shape[2]])
        except BaseException:
            self._release(request)
            self._drop_swap(request)
            raise
        self._drop_swap(request)
        request.num_cached = swapped.cached
        self.stats.swapped_in += 1

    def _copy_swapped_in(self, request_id: int, host: torch.Tensor, ids: list[int]) -> None:
        """Queue the write of a request's host copy into blocks `ids` (the tensor-parallel loop
        has every rank write its own)."""
        self.cache.swap_in(host, ids)

    def _drop_swap(self, request: Request) -> None:
        if request.swapped is not None:
            self.swapped_bytes -= request.swapped.host.nbytes
            request.swapped = None

    def _release(self, request: Request) -> None:
        if request.blocks:
            self.cache.free(request.blocks)
            request.blocks = []

    def _give_row(self, request: Request) -> None:
        if request.row >= 0:
            self.buffers.give_row(request.row)
            request.row = -1

    # -- the pad block and the graphs ------------------------------------------------------------
    def _take_pad_block(self) -> bool:
        """Hold the pad block if not yet (the cache may have had none free before); whether the
        loop holds it. See Note [Pad block]."""
        if self.pad_block is None:
            ids = self.cache.alloc(1)
            if ids is None:
                return False
            self.pad_block = self.buffers.pad_block = ids[0]
        return True

    def capture_graphs(self) -> int:
        """Capture the decode graph of every batch size not captured yet, largest first (they
        share one memory pool); returns how many the loop holds. Does nothing where the runner
        does not capture (cuda_graphs off, or not on CUDA). Raises RuntimeError when the cache
        has no block free for the pad block (Note [Pad block])."""
        self._finish_ahead()
        runner = self.runner
        if runner is None or not runner.capture:
            return 0
        if not self._take_pad_block():
            raise RuntimeError("the cache has no free block for the loop's pad block (a limit or the global budget "
                               "leaves none); capture the graphs before the cache fills, or raise the limit")
        empty = np.zeros(0, np.int64)
        for lanes in reversed(runner.buckets):
            if lanes not in runner.graphs:
                runner.run(self.buffers.pack(empty, empty, empty, np.zeros(0, bool), [], lanes=lanes))
        return len(runner.graphs)

    def close(self) -> None:
        """Give the pad block back (unless the cache was closed: it went with it) and drop the
        decode graphs, after the step still running, if any (Note [Steps ahead]); idempotent.
        Later steps run eagerly."""
        try:
            self._finish_ahead()
        finally:
            self._close_runner()

    def _close_runner(self) -> None:
        if self.runner is not None:
            self.runner.close()
            self.runner = None
        if self.pad_block is not None:
            if not self.cache.closed:
                self.cache.free([self.pad_block])
            self.pad_block = None
            self.buffers.pad_block = 0

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the model call -------------------------------------------------------------------------
    def _run(self, batch: _Batch, feed: torch.Tensor | None = None) -> list[Request]:
        """Pack the step into the buffers, launch the model call and the greedy argmax, and start
        copying the tokens to the host; returns the requests whose last token was in the step,
        in the order of their tokens (StepBuffers.received_tokens). ``feed``: the device tokens
        of the step ahead, the input of this decode step's requests in the same order (their
        host copies are not in yet: Note [Steps ahead])."""
        counters = self.counters
        rows, first, counts = batch.rows, batch.first, batch.counts
        count = len(rows)
        sample = batch.sample = first + counts == counters.length[rows]
        if batch.tokens == count and sample.all():      # decode-only: each runs its last token
            token_ids = counters.last[rows]
            sampling = batch.requests
            decode = self.runner is not None
        else:
            token_ids = list(itertools.chain.from_iterable(
                request.tokens[start:start + n] for request, start, n in zip(batch.requests, first.tolist(),
                                                                               counts.tolist())))
            sampling = list(itertools.compress(batch.requests, sample))
            decode = False
        if decode and self._take_pad_block():
            plan = self.buffers.pack(rows, first, counts, sample, token_ids, lanes=self.runner.bucket(count))
            if feed is not None:
                plan.input_ids[:count].copy_(feed[:count])
            launch = time.perf_counter()
            replays = self.runner.replays
            tokens = batch.device_tokens = self.runner.run(plan)
            self.stats.runner_steps += 1
            self.stats.graph_replays += self.runner.replays - replays
        else:
            assert feed is None, "a step fed from the device must run through the runner"
            plan = self.buffers.pack(rows, first, counts, sample, token_ids)
            launch = time.perf_counter()
            tokens = self._forward(plan).argmax(-1)
            self.stats.eager_steps += 1
        self.stats.last_forward_s = time.perf_counter() - launch
        batch.slot = self.buffers.send_tokens(tokens)
        return sampling

    def _commit(self, batch: _Batch, sampling: list[Request], tokens: np.ndarray) -> list[Request]:
        """After a model call that returned: the batch's K/V count as cached, the sampled tokens
        (tokens[i] of sampling[i]) are appended, and the requests they complete move from running
        to the finished ones. Returns those (their blocks still held, their block-table rows given
        back). Raises nothing."""
        requests, rows, counts = batch.requests, batch.rows, batch.counts
        if not requests:
            return []
        counters = self.counters
        values = tokens.tolist()
        if len(values) == batch.tokens == len(requests):       # decode-only
            self._append_decoded(requests, values)
            further = True
            counters.cached[rows] += 1
            length = counters.length[rows] + 1
            counters.length[rows] = length
            counters.last[rows] = tokens
        else:
            further = False
            for request, n in zip(requests, counts.tolist()):
                request.num_cached += n
                if request.num_cached > request.most_cached:
                    request.most_cached = request.num_cached
                    further = True
            for request, token in zip(sampling, values):
                request.tokens.append(token)
            counters.cached[rows] += counts
            sampled_rows = rows[batch.sample]
            counters.length[sampled_rows] += 1
            counters.last[sampled_rows] = tokens
            length = counters.length[rows]
        finished = np.flatnonzero(length >= counters.end[rows]).tolist()
        done = [requests[i] for i in finished]
        for i in reversed(finished):
            del self.running[i]                     # requests is a prefix of running
        if finished:
            self._running_rows = None
        for request in done:
            self._give_row(request)
            self._finished.append(request)
        if further or values:
            self._progress += 1
        return done

    @staticmethod
    def _append_decoded(requests: list[Request], values: list[int]) -> None:
        """Each request ran its last token and got the next one."""
        for request, token in zip(requests, values):
            request.tokens.append(token)
            # cached < len(tokens) always, so one more cached token is further than ever
            request.num_cached = request.most_cached = request.num_cached + 1

    def _release_all(self, requests: list[Request]) -> None:
        """Free the blocks of every request, going on past a free that raises; raises the first
        error (those requests keep their block ids). See Note [Failed steps]."""
        error = None
        for request in requests:
            try:
                self._release(request)
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        """The logits of the step's sampled positions (a tensor-parallel leader sends the plan
        to its workers first)."""
        return plan.forward(self.step_model, self.cache)

    def _account(self, batch: _Batch, generated: int, finished: int) -> None:
        """Count a committed step. Its time runs from its start or the last commit, whichever is
        later: a step ahead is committed inside the next step() call, after that call launched
        the next step, so the time from its own start would count that stretch twice."""
        now = time.perf_counter()
        elapsed = now - max(batch.started, self._committed_at)
        self._committed_at = now
        s = self.stats
        s.steps += 1
        s.step_tokens = batch.tokens
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
# step that preempted (the memory just proved short). So a step's requests are always a prefix
# of the running list, in its order (the commit finds finished requests by position). When every
# running request is decoding and the budget holds them all, a fast path gives the same batch
# from the row counters, calling alloc only for the requests whose next token starts a block
# (Note [Row counters] in kvcached.serving.counters).
#
# Note [Preemption]
# When alloc returns None (a lowered limit, a global budget taken by another instance, a full
# cache) the newest running request is preempted: its blocks are freed, its cached count reset,
# and it waits again with the tokens it generated so far. The queue is served in the order the
# requests began to wait: one still in its prompt goes back to the front (it began waiting when
# it arrived, before any request waiting now), one that already streams tokens goes behind the
# requests that were waiting when it was preempted (the preempted of one step keep their order
# among themselves). Putting every preempted request first, as before, let an instance squeezed
# by a fair budget readmit its preempted requests ahead of requests that had waited longer and
# had no token yet: on the H200 (bench_share, rate 6, 6 GiB) the last arrivals of a burst
# waited 3-4.7 s for their first token that way while the instance's preempted requests, which
# had theirs, went first. A request that streams can wait longer now; its tokens are kept (on the
# host, or recomputed), and the queue is still first come, first served, so it is not starved.
# When it is admitted again its K/V are copied back from the host (Note [Swapping out]) or,
# without a host copy, its prompt and those tokens are recomputed in one prefill, so the tokens
# that follow are the ones it would have produced without the interruption; no request is
# dropped. If the request that needs a block is itself the newest, it is the one preempted.
#
# Note [Swapping out]
# Recomputing a preempted request costs a prefill of everything it had: a 4,096-token prefill
# step of Llama-3-8B shapes took ~194 ms on the H200, so a 512-token prompt and its tokens so far
# take ~25-30 ms of the device, while its 64-96 MB of K/V cross PCIe to pinned host memory and
# back in a few ms. Under a fair budget every cap is met by preempting: the fair setup of
# bench_share preempted ~95 times in 30 s against ~12 under first come, its recomputation taking
# device time from all three instances (with swapping: 57 preemptions, 2279 tokens/s against
# 2176-2238 before; benchmarks/README.md). So _preempt first
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
#
# Note [Fair share in the loop]
# Under a global budget of the fair policy (kvcached.shm.fairness) each step tells the cache what
# its waiting requests need and asks what it holds beyond its cap; it preempts the newest running
# requests until that is freed, before scheduling, and admits nobody in that step. The need is the
# blocks (prompt and tokens so far) of the waiting requests the next step could admit, within
# max_batch_tokens and the free places among max_running: a burst of requests waits mostly for
# the model, a step's worth at a time, and reporting all of them (as before) made the holders'
# wants exceed the budget while it was partly free, so the others were capped, and preempted, for
# memory this instance could not use yet. Each step reports again, so the demand follows the
# queue as it is admitted. Waiting for an alloc to fail
# instead would move the memory only when a running request next crosses a block boundary (every
# block_size tokens), and a share change must take effect within a poll interval or two. The
# preempted requests wait with their demand published, so the next share computation counts them.
#
# What goes back to the budget is pages, not blocks: a page is unmapped once every block on it is
# free. The requests of a decode batch grow in lockstep, so each page holds blocks of many of
# them, and preempting the newest requests until enough blocks are free empties no page at all:
# on the H200 (Llama-3-8B shapes, 64 blocks of 16 tokens per page id) an instance over its share
# kept its pages mapped while preempting 719 times (benchmarks/README.md, bench_share). Choosing
# the victims by page (all holders of the emptiest page, then the next) emptied pages, but at the
# price of every request on them: 187 preemptions in 30 s against 24 under first come. So once
# the newest requests' blocks cover what is beyond the cap, the rest of the memory moves without
# preemption: the cache plans which pages' blocks move into the free slots of the others
# (KVCacheManager.plan_compaction, Note [Moving blocks instead of preempting] there), the loop
# copies them on its stream, points the requests and their block-table rows at the new ids and
# frees the old ones, which empties those pages. The pad block's page stays. Only what the plan
# could not place (pages of unequal size, a page no request holds) falls back to preempting by
# page: the page whose holders have computed the fewest tokens first, until as many pages are
# empty as over_limit_pages asks and the freed blocks cover over_limit_blocks.
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
# Note [Steps ahead]
# Between two decode steps the host commits the last one (appends its tokens, moves the row
# counters, finds the finished requests) and schedules and packs the next, and the device idles
# meanwhile: 0.5-0.7 ms a step on the H200 at batch 64-256, 5-7 % of a compiled graph step.
# With overlap=True a decode step run by the runner that leaves every request running is not
# waited for (_go_ahead): its rows' cached and length counters move on at once, which is all the
# next step's schedule needs (the loop has no end-of-sequence token, so which requests run next
# does not depend on the tokens), and the next step is scheduled (_decoding), packed and launched
# (_step_ahead) before the host reads the earlier step's tokens and commits them (_commit_ahead).
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
