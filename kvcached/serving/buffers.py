"""Persistent step buffers: the block-table mirror, the staging of each step's plan, the tokens.

Building every step from Python lists (padded block tables included) and copying it from
pageable memory cost milliseconds of host time per step at batch 256, and ``.tolist()`` on the
sampled tokens stalled the host on the device every step. Here everything is allocated once per
loop: a host mirror of the block tables with one row per running request (written as blocks are
appended, never rebuilt), a staging buffer the step's StepPlan is packed into with vectorised
numpy, one device buffer it is copied to in ONE non-blocking copy, and a host buffer the greedy
tokens come back to. On CUDA the host buffers are pinned. See Note [Step buffers].
"""

from __future__ import annotations

import numpy as np
import torch

from .plan import StepPlan


class StepBuffers:
    """The buffers of one loop: ``max_running`` block-table rows of ``width`` entries, and room
    for a step of ``max_tokens_per_step`` tokens of at most ``max_running`` requests.

    ``pad_block`` fills what no request owns: table entries past a request's blocks and rows of
    padding lanes (kvcached.serving.graphs). Those entries are never read by the kernels (Note
    [Block table contract] in kvcached.ops.attention) except a padding lane's first entry, so
    the loop sets it to a block it holds whenever it runs padded steps.
    """

    def __init__(self, *, max_running: int, max_tokens_per_step: int, width: int, block_size: int,
                 device: torch.device, pad_block: int = 0):
        self.max_running = max_running
        self.width = width
        self.block_size = block_size
        self.device = torch.device(device)
        self.pad_block = pad_block
        cuda = self.device.type == "cuda"
        self.tables = torch.full((max_running, width), pad_block, dtype=torch.int64)
        self._tables = self.tables.numpy()
        self._free_rows = list(range(max_running - 1, -1, -1))     # pop() hands out low rows first
        capacity, positions = self._lengths(max_running, max_tokens_per_step, width)
        self.staging = torch.empty(capacity, dtype=torch.int64, pin_memory=cuda)
        self._staging = self.staging.numpy()
        self._arange = np.arange(positions)
        self.data = self.staging if self.device.type == "cpu" else torch.empty(capacity, dtype=torch.int64,
                                                                               device=self.device)
        # two token buffers, used in turn: a loop a step ahead (Note [Steps ahead] in loop) has the
        # next step's tokens on their way while it reads the last one's
        self.tokens = [torch.empty(max_running, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._tokens = [tokens.numpy() for tokens in self.tokens]
        self._sampled = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._next_slot = 0
        self._copied = torch.cuda.Event() if cuda else None
        self._last_sizes: tuple[int, ...] | None = None     # the sizes of the last pack, its views and plan
        self._last_fields: tuple[np.ndarray, ...] = ()
        self._last_plan: StepPlan | None = None

    @staticmethod
    def _lengths(max_running: int, max_tokens_per_step: int, width: int) -> tuple[int, int]:
        """(values of the staging, entries of the arange) for these bounds."""
        return (StepPlan.data_len((max_tokens_per_step, max_running, width, max_running)),
                max(max_tokens_per_step, max_running) + 1)

    @classmethod
    def host_bytes(cls, *, max_running: int, max_tokens_per_step: int, width: int) -> int:
        """Host bytes the constructor allocates for these bounds: the staging, the block-table
        mirror, the arange and the two token buffers, every value an int64 (on CUDA the device
        holds a copy of the staging besides). O(1)."""
        capacity, positions = cls._lengths(max_running, max_tokens_per_step, width)
        return 8 * (capacity + max_running * width + positions + 2 * max_running)

    # -- the block-table mirror ----------------------------------------------------------------
    def take_row(self, blocks: list[int]) -> int:
        """A free row holding `blocks` (an admitted request's); raises RuntimeError if none is
        free (more requests running than max_running)."""
        if not self._free_rows:
            raise RuntimeError(f"all {self.max_running} block-table rows are taken; a loop runs at most "
                               f"max_running={self.max_running} requests")
        row = self._free_rows.pop()
        self._tables[row, :len(blocks)] = blocks
        return row

    def append(self, row: int, start: int, blocks: list[int]) -> None:
        """Write `blocks` into a row from column `start`: those appended to a request that held
        `start` blocks, or (start 0) all of a request's blocks again after some moved."""
        self._tables[row, start:start + len(blocks)] = blocks

    def give_row(self, row: int) -> None:
        """Return a row (its request finished, was preempted or aborted), refilled with the pad block."""
        self._tables[row] = self.pad_block
        self._free_rows.append(row)

    def row(self, row: int) -> np.ndarray:
        return self._tables[row]

    # -- one step ------------------------------------------------------------------------------
    def pack(self, rows: np.ndarray, first: np.ndarray, counts: np.ndarray, sample: np.ndarray,
             token_ids: list[int] | np.ndarray, lanes: int | None = None) -> StepPlan:
        """The step as a StepPlan over the device buffer: request i (block-table row rows[i])
        runs counts[i] tokens from position first[i]; those with sample[i] want the logits of
        their last token. `lanes` pads a decode-only step (every count 1, every request
        sampled) to that many lanes: token 0 at position 0, slot -1 (nothing written), sequence
        length 1, a row of pad blocks, logits wanted (and ignored). Table columns past the
        longest request's blocks are not written (nothing reads them: Note [Step buffers]). One
        non-blocking copy to the device; the staging is reused only once that copy ran."""
        batch = len(rows)
        tokens = len(token_ids)
        lanes = batch if lanes is None else lanes
        if lanes != batch and (tokens != batch or not sample.all()):
            raise ValueError(f"only a decode-only step (one token per request, each sampled) can be padded; "
                             f"got {tokens} tokens of {batch} requests for {lanes} lanes")
        num_logits = np.count_nonzero(sample) if lanes == batch else lanes
        decodes = lanes if tokens == batch else int((counts != 1).argmax())
        sizes = (tokens + lanes - batch, lanes, self.width, num_logits, decodes)
        if self._copied is not None:
            self._copied.synchronize()          # a failed step's copy may still read the staging
        if sizes != self._last_sizes:           # decode steps repeat their sizes: See Note [Step buffers]
            self._last_fields = self._fields(sizes)
            self._last_plan = StepPlan(sizes, self.data[:StepPlan.data_len(sizes)])
            self._last_sizes = sizes
        ids, positions, slots, seq_lens, starts, logits, tables = self._last_fields
        if tokens == batch:                     # one token each (decode): no repeats, no cumsum
            starts[:batch + 1] = self._arange[:batch + 1]
            token_pos, token_rows = first, rows
        else:
            starts[0] = 0
            np.cumsum(counts, out=starts[1:batch + 1])
            token_pos = self._arange[:tokens] + np.repeat(first - starts[:batch], counts)
            token_rows = np.repeat(rows, counts)
        ids[:tokens] = token_ids
        positions[:tokens] = token_pos
        bs = self.block_size
        slots[:tokens] = self._tables[token_rows, token_pos // bs] * bs + token_pos % bs
        np.add(first, counts, out=seq_lens[:batch])
        if batch:
            used = (int(seq_lens[:batch].max()) - 1) // bs + 1      # blocks of the longest row
            np.take(self._tables[:, :used], rows, axis=0, out=tables[:batch, :used], mode="clip")
        if lanes == batch and num_logits == batch:
            np.subtract(starts[1:batch + 1], 1, out=logits)
        elif lanes == batch:
            logits[:] = starts[1:][sample] - 1
        else:
            ids[tokens:], positions[tokens:], slots[tokens:], seq_lens[batch:] = 0, 0, -1, 1
            starts[batch + 1:] = self._arange[batch + 1:lanes + 1]
            logits[:] = self._arange[:lanes]
            tables[batch:] = self.pad_block
        if self.data is not self.staging:
            length = self._last_plan.data.numel()
            self.data[:length].copy_(self.staging[:length], non_blocking=True)
            self._copied.record()
        return self._last_plan

    def _fields(self, sizes: tuple[int, ...]) -> tuple[np.ndarray, ...]:
        """Numpy views of the staging as a StepPlan of `sizes` lays it out (StepPlan.offsets):
        slicing the numpy array costs a tenth of slicing the tensor and calling .numpy()."""
        bounds = StepPlan.offsets(sizes)
        staging = self._staging
        fields = [staging[start:end] for start, end in zip(bounds, bounds[1:])]
        fields[-1] = fields[-1].reshape(sizes[1], sizes[2])
        return tuple(fields)

    def send_tokens(self, tokens: torch.Tensor) -> int:
        """Start copying a step's greedy tokens ``[K]`` to the host (non-blocking on CUDA) into
        the token buffer not used last; returns its slot for received_tokens."""
        slot, self._next_slot = self._next_slot, 1 - self._next_slot
        self.tokens[slot][:tokens.shape[0]].copy_(tokens, non_blocking=True)
        if self._sampled[slot] is not None:
            self._sampled[slot].record()
        return slot

    def received_tokens(self, count: int, slot: int) -> np.ndarray:
        """The first `count` tokens that send_tokens put into `slot` (a copy), once the device
        has them: the only place a step waits for the device."""
        if self._sampled[slot] is not None:
            self._sampled[slot].synchronize()
        return self._tokens[slot][:count].copy()


# Note [Step buffers]
# A running request owns one row of the host block-table mirror from its admission until it
# finishes, is preempted or aborted; the blocks appended to it are written into that row as the
# scheduler hands them out, and entries past them hold the pad block. A step is then a few numpy
# ops over small per-request arrays (rows, cached counts, new-token counts): positions and
# slots come from a repeat and a gather in the mirror, the step's tables from one gather of the
# rows, up to the column of the batch's longest request: the columns past it keep what an
# earlier step left in the staging (block ids of then, or the pad block), which no kernel reads
# (Note [Block table contract] in kvcached.ops.attention: a row is read up to its sequence
# length). At width 512 and batch 256 the full gather alone cost host time of ~2 % of a decode
# step (benchmarks/HISTORY.md). The table width is the loop's (ceil(max_tokens / block_size)), so
# a step's layout depends only on its sizes, and a padded decode step of a given lane count
# always has its fields at the same addresses of the device buffer: the CUDA graphs of
# kvcached.serving.graphs read them there.
#
# A StepPlan is only views of the device buffer, and the staging's fields are views of the
# staging: both depend on the step's sizes alone, which a run of decode steps repeats (the same
# requests, one token each), so the last sizes' views and plan are kept and handed out again
# (slicing seven numpy views and two tensors cost about a tenth of a batch-256 step's host time
# outside the model call; benchmarks/HISTORY.md).
#
# Sync points. The staging is pinned, so its copy to the device is asynchronous: the host packs
# the next step only after an event recorded behind that copy (normally long done: the commit
# waited on the step's tokens, which come after it). The greedy tokens are computed on the
# device (argmax) and copied into a pinned buffer behind the forward; the host waits for them
# only in received_tokens, right before the commit, which needs their values. Everything the
# host does between the launch and that wait (the argmax and copy launches, the event) overlaps
# the device's work; with overlap the loop schedules and launches the next decode step there
# too, and the tokens come back through two buffers in turn (Note [Steps ahead] in loop).
