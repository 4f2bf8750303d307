"""Per-row numpy mirror of the running requests' counters, so a step's bookkeeping is vectorised.

Scheduling, packing and committing a decode step by walking the running Request objects cost
host time of about a tenth of a batch-256 decode step (a few attribute reads and a generator step
per request, several times over; benchmarks/HISTORY.md). The loop keeps what those walks
read (cached count, token count, block capacity, end, last token) in arrays indexed by the
request's block-table row (kvcached.serving.buffers), written where the Request changes; a step
then gathers them with the batch's rows. See Note [Row counters].
"""

from __future__ import annotations

import numpy as np


class RowCounters:
    """Counters of the request that holds each of ``max_running`` block-table rows.

    For a running request on row r: ``cached[r]`` is its num_cached, ``length[r]`` len(tokens),
    ``room[r]`` len(blocks) * block_size (the tokens its blocks hold), ``end[r]`` the token count
    at which it is done (prompt_len + max_new_tokens), ``last[r]`` its last token. A free row's
    values are stale and never read. Five 1-D arrays, not one 2-D one: numpy gathers and updates
    through an index array about 3x faster on a 1-D array than on a slice of a 2-D one.
    """

    FIELDS = ("cached", "length", "room", "end", "last")

    def __init__(self, max_running: int, block_size: int):
        self.block_size = block_size
        self.cached, self.length, self.room, self.end, self.last = (np.zeros(max_running, np.int64)
                                                                    for _ in self.FIELDS)

    @classmethod
    def host_bytes(cls, max_running: int) -> int:
        """Bytes the constructor allocates for ``max_running`` rows: one int64 per field and row."""
        return 8 * len(cls.FIELDS) * max_running

    def admit(self, row: int, request) -> None:
        """Fill `row` from a request that was just given it."""
        self.cached[row] = request.num_cached
        self.length[row] = len(request.tokens)
        self.room[row] = len(request.blocks) * self.block_size
        self.end[row] = request.prompt_len + request.max_new_tokens
        self.last[row] = request.tokens[-1]

    def disagreement(self, row: int, request) -> str | None:
        """What of `row` disagrees with `request` (a running one), or None (check_invariants)."""
        mirror = (self.cached[row], self.length[row], self.room[row], self.end[row], self.last[row])
        truth = (request.num_cached, len(request.tokens), len(request.blocks) * self.block_size,
                 request.prompt_len + request.max_new_tokens, request.tokens[-1])
        if tuple(int(v) for v in mirror) != truth:
            return f"row {row} counts {mirror}, the request {truth} (cached, tokens, room, end, last)"
        return None


# Note [Row counters]
# The Request objects stay the truth (what callers read, what a preempted request carries back
# to the waiting queue); the counters are a mirror of the running ones, written at the same
# places: admission (admit), a block appended (room), the commit (cached, length, last). A row
# given back (finish, preemption, abort) goes stale and is filled again by the next admit, so
# nothing needs resetting. check_invariants compares every running request with its row.
#
# What the mirror buys is the decode fast path of Scheduler.schedule (Note [Scheduling]): when
# every running request has exactly its next token to run (length - cached == 1) and the budget
# holds them all, the batch is the running list itself, the requests that need a block for that
# token are found with one comparison (cached >= room) and only those call the cache's alloc, in
# running order, as the general path would; if one alloc returns None the general path runs
# from the top and preempts (the blocks handed out meanwhile stay with their requests, which it
# finds already grown). The pack reads first positions and token ids from the mirror, and the
# commit updates it with a few fancy-indexed ops; only appending the sampled tokens to the
# Request objects remains a Python loop.
