"""The serving loop's scheduler: which requests run in a step, and with which blocks.

Its state is the requests (waiting, running, finished), their block ids and block-table rows,
and the numpy mirror of the running ones' counters (kvcached.serving.counters). Each step it
follows a fair budget (demand, preemption, block moves), schedules the running requests and
admits waiting ones (Note [Scheduling]), and returns a plain SchedulerOutput that the runner
(kvcached.serving.runner) executes; after the model call the loop hands the tokens back to
``commit``. It imports no torch, holds no tensor and never reads the runner's state: the
device work it needs (copying moved blocks, a request's K/V to the host and back) goes through
callables the loop gives it, which the tensor-parallel loop extends to every rank.

Two of the runner's things are written here, through narrow calls: the block-table rows
(StepBuffers' take_row, append, give_row: the host mirror a step's plan is packed from) are
written when blocks are handed out, so that a schedule that raises half-way leaves every row
agreeing with its request's blocks (Note [Failed steps]); and the pad block is passed in
(``pinned``) as a block no request holds, which block moves and page emptying leave alone.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvcached.checks import as_int

from .counters import RowCounters

if TYPE_CHECKING:
    from .stats import LoopStats
    from .swap import HostSwap, SwappedKV


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

    def problems(self, queue: str, block_size: int) -> list[str]:
        """What of this request disagrees with being in `queue` (running, waiting or finished)
        under blocks of `block_size` tokens: for check_invariants."""
        problems = []
        if self.done != (queue == "finished"):
            problems.append(f"request {self.id} is {queue} with {len(self.generated)} of {self.max_new_tokens} tokens")
        if queue == "running" and not (0 <= self.num_cached < len(self.tokens)
                                       and self.num_cached <= len(self.blocks) * block_size
                                       and len(self.blocks) <= -(-len(self.tokens) // block_size)):
            problems.append(f"running request {self.id}: {self.num_cached} tokens cached of {len(self.tokens)}, "
                            f"{len(self.blocks)} blocks")
        if queue == "waiting" and (self.num_cached or self.blocks):
            problems.append(f"waiting request {self.id} has {self.num_cached} tokens cached in "
                            f"{len(self.blocks)} blocks")
        if self.swapped is not None and (queue != "waiting" or not 0 < self.swapped.cached < len(self.tokens)):
            problems.append(f"request {self.id} ({queue}) keeps {self.swapped.cached} tokens swapped out of "
                            f"{len(self.tokens)}")
        return problems


@dataclass
class SchedulerOutput:
    """One step's work, what the runner needs to run it and the commit to finish it.

    requests[i] runs counts[i] (tokens in all) new tokens from position first[i] (its cached
    count), through block-table row rows[i]; requests is a prefix of the running list (Note
    [Scheduling]). sample[i]: whether request i's last token is in the step; sampling: those
    requests, in order (the ones that get a token); token_ids: the step's input tokens (for a
    decode-only step, each row's last token from the counters); decode_only: every request runs
    exactly its last token (the runner may pad it and replay a graph)."""

    requests: list[Request]
    rows: np.ndarray
    first: np.ndarray
    counts: np.ndarray
    tokens: int
    sample: np.ndarray | None = None
    sampling: list[Request] = field(default_factory=list)
    token_ids: np.ndarray | list[int] = field(default_factory=list)
    decode_only: bool = False

    @classmethod
    def of(cls, requests: list[Request], rows: np.ndarray, first: np.ndarray, counts: np.ndarray, tokens: int,
           counters: RowCounters) -> SchedulerOutput:
        """The output of a batch: which requests sample (from the counters' lengths) and what the
        step's input tokens are."""
        sample = first + counts == counters.length[rows]
        if tokens == len(rows) and sample.all():      # decode-only: each runs its last token
            return cls(requests, rows, first, counts, tokens, sample, requests, counters.last[rows], True)
        token_ids = list(itertools.chain.from_iterable(
            request.tokens[start:start + n] for request, start, n in zip(requests, first.tolist(), counts.tolist())))
        return cls(requests, rows, first, counts, tokens, sample, list(itertools.compress(requests, sample)),
                   token_ids, False)


def page_emptying_victims(running: list[Request], cache, excess: int, pages: int,
                          pinned: list[int]) -> list[Request]:
    """Running requests whose preemption empties at least `pages` pages of `cache` and frees at
    least `excess` blocks, newest first: the page whose not yet chosen holders have computed the
    fewest tokens (the least work to redo) is emptied next. The pinned blocks' pages are never
    chosen. A decision only: nothing changes. See Note [Fair share in the loop]."""
    holders: dict[int, set[int]] = collections.defaultdict(set)     # page -> indices into running
    for index, request in enumerate(running):
        for page in set(cache.pages_of(request.blocks)):
            holders[page].add(index)
    if pinned:
        for page in cache.pages_of(list(pinned)):
            holders.pop(page, None)
    chosen: set[int] = set()
    freed = emptied = 0
    while (freed < excess or emptied < pages) and holders:
        emptied += 1
        page = min(holders, key=lambda p: sum(running[i].num_cached + 1 for i in holders[p] - chosen))
        for index in holders.pop(page) - chosen:
            chosen.add(index)
            freed += len(running[index].blocks)
    return [running[index] for index in sorted(chosen, reverse=True)]


class Scheduler:
    """The requests of one ServingLoop and the policy that picks each step's work.

    ``schedule`` and ``schedule_decode`` hand blocks out, preempt and admit; ``commit`` and
    ``commit_ahead`` move what a step did (cached counts, tokens, finished requests);
    ``release_all`` frees the finished requests' blocks. Nothing here waits for the device.
    The callables are the loop's device hooks: ``copy_blocks(old, new)`` queues a block move,
    ``swap_out(request)`` returns a host copy or None, ``swap_in(request_id, host, ids)``
    queues its write back.
    """

    def __init__(self, cache, table, swap: HostSwap, stats: LoopStats, *, max_batch_tokens: int,
                 max_running: int, max_tokens: int, vocab_size: int,
                 copy_blocks: Callable[[list[int], list[int]], None],
                 swap_out: Callable[[Request], SwappedKV | None],
                 swap_in: Callable[[int, object, list[int]], None]):
        self.cache = cache
        self.table = table                      # the runner's StepBuffers: block-table rows only
        self.swap = swap
        self.stats = stats
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.max_tokens = max_tokens
        self.vocab_size = vocab_size
        self.copy_blocks = copy_blocks
        self.swap_out = swap_out
        self.swap_in = swap_in
        self.counters = RowCounters(max_running, cache.block_size)     # See Note [Row counters]
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []       # finished, not handed out yet
        self.progress = 0                       # steps in which some request got further than ever
        self._running_rows: np.ndarray | None = None   # the running requests' rows; None: build again
        self._next_id = 0
        self._requeued = 0                      # streaming requests this schedule preempted (Note [Preemption])

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], max_new_tokens: int) -> int:
        """Queue a request; returns its id. Raises ValueError for an empty prompt, token ids
        outside the vocabulary, or a request longer than the cache or the model can hold."""
        max_new_tokens = as_int(max_new_tokens, "max_new_tokens", minimum=1, error=ValueError)
        vocab = self.vocab_size
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

    def abort(self, request_id: int) -> bool:
        """Drop a waiting or running request, freeing its blocks; False if it is not here."""
        for queue in (self.running, self.waiting):
            for index, request in enumerate(queue):
                if request.id == request_id:
                    self._release(request)          # first: if the free raises, the request stays
                    self.swap.drop(request)
                    del queue[index]
                    self._running_rows = None
                    self._give_row(request)
                    self.stats.running, self.stats.waiting = len(self.running), len(self.waiting)
                    if self.cache.shares_budget and queue is self.waiting:
                        self._report_demand()       # no step may come to clear it
                    return True
        return False

    def check_invariants(self, pinned: list[int]) -> None:
        """Raise AssertionError unless every request's state agrees with its queue, its row and
        its counters, and no block id is held twice (the `pinned` ones count as held).
        O(requests + blocks)."""
        problems = []
        seen: set[int] = set()
        held: set[int] = set(pinned)
        rows: set[int] = set()
        size = self.cache.block_size
        queues = (("running", self.running), ("waiting", self.waiting), ("finished", self.finished))
        for name, queue in queues:
            for request in queue:
                if request.id in seen:
                    problems.append(f"request {request.id} is in two places")
                seen.add(request.id)
                if held & set(request.blocks) or len(set(request.blocks)) != len(request.blocks):
                    problems.append(f"request {request.id} ({name}) holds a block id held twice")
                held.update(request.blocks)
                problems += request.problems(name, size)
                if (request.row >= 0) != (name == "running") or request.row in rows:
                    problems.append(f"request {request.id} ({name}) has block-table row {request.row}")
                elif name == "running":
                    rows.add(request.row)
                    if self.table.row(request.row)[:len(request.blocks)].tolist() != request.blocks:
                        problems.append(f"request {request.id}'s block-table row is not its blocks")
                    disagreement = self.counters.disagreement(request.row, request)
                    if disagreement:
                        problems.append(f"request {request.id}: {disagreement}")
        if self._running_rows is not None and self._running_rows.tolist() != [r.row for r in self.running]:
            problems.append("the running requests' rows are stale")
        problems += self.swap.problems(itertools.chain(self.running, self.waiting, self.finished))
        if len(self.running) > self.max_running:
            problems.append(f"{len(self.running)} running, max_running={self.max_running}")
        assert not problems, "; ".join(problems)

    # -- scheduling -----------------------------------------------------------------------------
    def schedule(self, pinned: list[int]) -> SchedulerOutput:
        """The step's batch; See Note [Scheduling]. `pinned`: block ids no request holds that
        must stay where they are (the runner's pad block)."""
        budget = self.max_batch_tokens
        self._requeued = 0
        gave_back = self.cache.shares_budget and self._follow_budget(pinned)
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
            request.row = self.table.take_row(request.blocks)
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
        return SchedulerOutput.of(requests, rows, self.counters.cached[rows], np.array(counts, np.int64), tokens,
                                  self.counters)

    def schedule_decode(self) -> SchedulerOutput | None:
        """Every running request's next token (their next blocks given), when the decode fast
        path takes them all; None otherwise (Note [Steps ahead])."""
        cached = self._decoding(self.max_batch_tokens)
        return None if cached is None else self._decode_batch(cached)

    def _decode_batch(self, cached: np.ndarray) -> SchedulerOutput:
        """Every running request's next token, from its cached count: the decode fast path's batch."""
        return SchedulerOutput.of(self.running[:], self._rows(), cached, np.ones(len(cached), np.int64), len(cached),
                                  self.counters)

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
            self.table.append(request.row, len(request.blocks), ids)
        request.blocks.extend(ids)
        if request.row >= 0:
            self.counters.room[request.row] = len(request.blocks) * self.cache.block_size
        return True

    # -- a fair budget: See Note [Fair share in the loop] -------------------------------------------
    def _follow_budget(self, pinned: list[int]) -> bool:
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
            self._move_blocks(self.cache.plan_compaction(list(pinned)))
            excess, pages = self.cache.over_limit_blocks(), self.cache.over_limit_pages()
            if excess > 0 or pages > 0:
                for request in page_emptying_victims(self.running, self.cache, excess, pages, pinned):
                    self._preempt(request)
        return True

    def same_requests_next(self) -> bool:
        """Whether the next step can only run the running requests again: nothing waits to be
        admitted (so the demand last reported is none) and the cache holds nothing beyond a fair
        budget's cap (a cap that comes while a step is ahead is followed at the next schedule,
        one step later)."""
        return not self.waiting and self.cache.over_limit_blocks() <= 0 and self.cache.over_limit_pages() <= 0

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
            self.copy_blocks(old, new)
        except BaseException:
            self.cache.free(new)
            raise
        for request, i in holders:
            request.blocks[i] = moves[request.blocks[i]]
        for request in {id(r): r for r, _ in holders}.values():
            self.table.append(request.row, 0, request.blocks)
        self.cache.free(old)
        self.stats.blocks_moved += len(moves)

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

    # -- preemption: See Note [Preemption] ------------------------------------------------------
    def _preempt_newest(self) -> None:
        self._preempt(self.running[-1])

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and queue it again (first if it has no token yet,
        else behind the requests waiting before it: Note [Preemption]), its K/V kept on the
        host if swap_bytes allows (Note [Swapping out]), to be recomputed otherwise."""
        swapped = self.swap_out(request)
        self._release(request)                  # if the free raises, nothing changed (the copy is dropped)
        self.running.remove(request)
        self._running_rows = None
        self._give_row(request)
        request.num_cached = 0
        request.preemptions += 1
        if swapped is not None:
            self.swap.keep(request, swapped)
            self.stats.swapped_out += 1
        if request.generated:
            self.waiting.insert(len(self.waiting) - self._requeued, request)
            self._requeued += 1
        else:
            self.waiting.appendleft(request)
        self.stats.preemptions += 1

    def _swap_in(self, request: Request) -> None:
        """Copy a readmitted request's swapped-out K/V into the blocks it was just given. If the
        copy raises, the blocks go back and the request waits, to be recomputed."""
        swapped = request.swapped
        assert swapped is not None
        try:
            self.swap_in(request.id, swapped.host, request.blocks[:swapped.host.shape[2]])
        except BaseException:
            self._release(request)
            self.swap.drop(request)
            raise
        self.swap.drop(request)
        request.num_cached = swapped.cached
        self.stats.swapped_in += 1

    def _release(self, request: Request) -> None:
        if request.blocks:
            self.cache.free(request.blocks)
            request.blocks = []

    def _give_row(self, request: Request) -> None:
        if request.row >= 0:
            self.table.give_row(request.row)
            request.row = -1

    # -- the commit: See Note [Failed steps] ----------------------------------------------------
    def commit(self, output: SchedulerOutput, tokens: np.ndarray) -> list[Request]:
        """After a model call that returned: the batch's K/V count as cached, the sampled tokens
        (tokens[i] of output.sampling[i]) are appended, and the requests they complete move from
        running to the finished ones. Returns those (their blocks still held, their block-table
        rows given back). Raises nothing."""
        requests, rows, counts = output.requests, output.rows, output.counts
        if not requests:
            return []
        counters = self.counters
        values = tokens.tolist()
        if len(values) == output.tokens == len(requests):       # decode-only
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
            for request, token in zip(output.sampling, values):
                request.tokens.append(token)
            counters.cached[rows] += counts
            sampled_rows = rows[output.sample]
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
            self.finished.append(request)
        if further or values:
            self.progress += 1
        return done

    @staticmethod
    def _append_decoded(requests: list[Request], values: list[int]) -> None:
        """Each request ran its last token and got the next one."""
        for request, token in zip(requests, values):
            request.tokens.append(token)
            # cached < len(tokens) always, so one more cached token is further than ever
            request.num_cached = request.most_cached = request.num_cached + 1

    def release_all(self, requests: list[Request]) -> None:
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

    # -- a step ahead: See Note [Steps ahead] ---------------------------------------------------
    def decodes_again(self, output: SchedulerOutput) -> bool:
        """Whether the step after `output` (a decode step just launched) can only be the same
        requests decoding again: it ran every running request, none finishes with it, nothing
        waits and nothing is beyond a fair cap."""
        if len(output.requests) != len(self.running) or not self.same_requests_next():
            return False
        counters, rows = self.counters, output.rows
        return bool((counters.length[rows] + 1 < counters.end[rows]).all())

    def count_ahead(self, output: SchedulerOutput) -> None:
        """A decode step left on the device: its requests' counters move on now, their tokens
        come at commit_ahead."""
        counters = self.counters
        counters.cached[output.rows] += 1
        counters.length[output.rows] += 1

    def uncount_ahead(self, output: SchedulerOutput) -> None:
        """count_ahead undone: the step ahead failed."""
        counters = self.counters
        counters.cached[output.rows] -= 1
        counters.length[output.rows] -= 1

    def commit_ahead(self, output: SchedulerOutput, tokens: np.ndarray) -> None:
        """The commit of a decode step whose counters moved at its launch. Raises nothing."""
        self._append_decoded(output.requests, tokens.tolist())
        self.counters.last[output.rows] = tokens
        self.progress += 1


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
