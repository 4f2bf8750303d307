"""Tensor parallelism for the serving loop: one scheduling rank, workers that run its steps.

Rank 0 of the group runs ``TensorParallelLoop`` (a ServingLoop: requests, scheduling, block ids,
preemption and greedy sampling, all as at TP = 1); every other rank runs
``TensorParallelWorker.run()``. Each step the leader broadcasts the StepPlan and every rank runs
the forward of its shard (``shard_model``) over its own KV cache, which holds its KV heads for the
same block ids. See Note [Leader and workers].
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .loop import ServingLoop
from .plan import NUM_SIZES, StepPlan
from .scheduler import Request
from .shard import Shard
from .swap import SWAP_BYTES, SwappedKV

# the command word of a header: return, run a step, move blocks, and a request's K/V to the
# host, back, or dropped there (Note [Swapping out at TP])
STOP, STEP, MOVE, SWAP_OUT, SWAP_IN, DROP = range(6)
HEADER_LEN = 1 + NUM_SIZES


def _shard_of(model, cache, group, role: str) -> Shard:
    """The model's Shard, checked against this process's place in `group` and the cache's heads."""
    shard = getattr(model, "kvcached_shard", None)
    if shard is None:
        raise ValueError(f"the {role} needs a model split with kvcached.serving.shard_model(model, rank, world_size)")
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if (shard.rank, shard.world_size) != (rank, world_size):
        raise ValueError(f"the model holds shard {shard.rank} of {shard.world_size}, but this process is rank {rank} "
                         f"of {world_size} in the group; split it with shard_model(model, {rank}, {world_size})")
    if cache.num_kv_heads != shard.num_kv_heads:
        raise ValueError(f"the cache holds {cache.num_kv_heads} KV heads, this rank's shard {shard.num_kv_heads}; build "
                         f"the cache from shard_config(model.config, model.kvcached_shard)")
    return shard


class TensorParallelLoop(ServingLoop):
    """The ServingLoop of rank 0: schedules, sends every step to the workers, runs its own shard
    and samples. ``close()`` (or leaving a ``with`` block) tells the workers to return.

    Unlike ServingLoop's, a step that raises once it was sent (in the model call, a collective)
    cannot be redone: the workers wait inside it. Every later step raises RuntimeError, the
    requests stay on the loop as they were, and close() sends nothing. See Note [Leader and workers].

    Its steps run eagerly (no CUDA graphs, See Note [Decode graphs] in kvcached.serving.graphs),
    packed into the same persistent buffers as ServingLoop's. A preempted request's K/V go to the
    host on every rank, each rank its own shard, up to swap_bytes on each (Note [Swapping out at
    TP]).

    Raises ValueError when the model is not split for this rank (rank 0 of the group), or the
    cache holds another number of KV heads than the shard.
    """

    def __init__(self, model, cache, *, group=None, max_batch_tokens: int = 2048, max_running: int = 256,
                 max_tokens: int | None = None, swap_bytes: int = SWAP_BYTES):
        shard = _shard_of(model, cache, group, "TensorParallelLoop")
        if shard.rank != 0:
            raise ValueError(f"TensorParallelLoop runs on rank 0 of the group, this is rank {shard.rank}; "
                             f"run TensorParallelWorker(model, cache).run() there")
        super().__init__(model, cache, max_batch_tokens=max_batch_tokens, max_running=max_running,
                         max_tokens=max_tokens, cuda_graphs=False, swap_bytes=swap_bytes)
        self.group = group
        self.closed = False
        self.failed: str | None = None  # the exception of a step that failed once sent
        self.steps_sent = 0         # forward steps the workers were given (steps with a batch)

    def _check_usable(self) -> None:
        if self.failed is not None:
            raise RuntimeError(f"a step of this TensorParallelLoop failed after it was sent to the workers "
                               f"({self.failed}); they wait inside it, so the group is unusable. The requests "
                               f"are in loop.running and loop.waiting as they were; restart every rank")
        if self.closed:
            raise RuntimeError("the TensorParallelLoop is closed (its workers have returned); start a new group")

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        self._check_usable()
        try:
            self._send(STEP, plan.sizes)
            dist.broadcast(plan.data, group=self.group, group_src=0)
            self.steps_sent += 1
            return super()._forward(plan)
        except BaseException as exc:
            self.failed = repr(exc)
            raise

    def _copy_blocks(self, old: list[int], new: list[int]) -> None:
        """Every rank copies the blocks (Note [Moving blocks at TP]); returns once each has."""
        self._check_usable()
        try:
            self._send(MOVE, (len(old),) + (0,) * (NUM_SIZES - 1))
            pairs = torch.tensor(old + new, dtype=torch.int64, device=self.device)
            dist.broadcast(pairs, group=self.group, group_src=0)
            super()._copy_blocks(old, new)
            done = torch.zeros(1, dtype=torch.int64, device=self.device)
            dist.all_reduce(done, group=self.group)
            done.item()
        except BaseException as exc:
            self.failed = repr(exc)
            raise

    def _swap_out(self, request: Request) -> SwappedKV | None:
        """The leader's copy, then the workers' (Note [Swapping out at TP]); None (recompute) if
        any rank could not keep one."""
        swapped = super()._swap_out(request)
        if swapped is None or self._swap_on_workers(SWAP_OUT, request.id, request.blocks[:swapped.host.shape[2]]):
            return swapped
        self._swap_on_workers(DROP, request.id, [])
        return None

    def _copy_swapped_in(self, request_id: int, host: torch.Tensor, ids: list[int]) -> None:
        """The workers' copies back, then the leader's; RuntimeError if a worker's failed (the
        loop then gives the blocks back and the request is recomputed)."""
        if not self._swap_on_workers(SWAP_IN, request_id, ids):
            raise RuntimeError(f"a worker could not copy request {request_id}'s K/V back from its host; "
                               f"the request waits, to be recomputed")
        super()._copy_swapped_in(request_id, host, ids)

    def abort(self, request_id: int) -> bool:
        """As ServingLoop.abort; a swapped-out request's copies go on the workers too."""
        if any(r.id == request_id and r.swapped is not None for r in self.waiting):
            self._swap_on_workers(DROP, request_id, [])
        return super().abort(request_id)

    def _swap_on_workers(self, command: int, request_id: int, ids: list[int]) -> bool:
        """Have every worker do a swap command for one request over block `ids`; True if each
        did (they report through an all-reduce, which the leader waits for)."""
        self._check_usable()
        try:
            self._send(command, (request_id, len(ids)) + (0,) * (NUM_SIZES - 2))
            if ids:
                dist.broadcast(torch.tensor(ids, dtype=torch.int64, device=self.device), group=self.group,
                               group_src=0)
            failed = torch.zeros(1, dtype=torch.int64, device=self.device)
            dist.all_reduce(failed, group=self.group)
            return failed.item() == 0
        except BaseException as exc:
            self.failed = repr(exc)
            raise

    def _send(self, command: int, sizes: tuple[int, ...]) -> None:
        header = torch.tensor([command, *sizes], dtype=torch.int64, device=self.device)
        dist.broadcast(header, group=self.group, group_src=0)

    def close(self) -> None:
        """Tell the workers to return from run() (not after a failed step: they are inside it);
        idempotent."""
        if not self.closed:
            self.closed = True
            if self.failed is None:
                self._send(STOP, (0,) * NUM_SIZES)
        super().close()


class TensorParallelWorker:
    """A rank > 0: runs each step the leader sends over its shard and its KV cache, until the
    leader closes. Raises ValueError when the model is not split for this rank."""

    def __init__(self, model, cache, *, group=None):
        shard = _shard_of(model, cache, group, "TensorParallelWorker")
        if shard.rank == 0:
            raise ValueError("rank 0 schedules: run TensorParallelLoop there, TensorParallelWorker on the other ranks")
        self.model = model
        self.cache = cache
        self.group = group
        self.device = next(model.parameters()).device
        self.steps = 0
        self._data = torch.empty(0, dtype=torch.int64, device=self.device)    # grows to the largest step
        self.swapped: dict[int, torch.Tensor] = {}    # request id -> this rank's host copy of its K/V

    def _receive(self, sizes: tuple[int, int, int, int, int]) -> StepPlan:
        """The leader's plan, broadcast into a prefix of one buffer kept across steps."""
        length = StepPlan.data_len(sizes)
        if self._data.numel() < length:
            self._data = torch.empty(length, dtype=torch.int64, device=self.device)
        data = self._data[:length]
        dist.broadcast(data, group=self.group, group_src=0)
        return StepPlan(sizes, data)

    def run(self) -> int:
        """Follow the leader until it closes; returns the number of steps run."""
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        while True:
            dist.broadcast(header, group=self.group, group_src=0)
            command, *sizes = header.tolist()
            if command == STOP:
                return self.steps
            if command == MOVE:
                self._move(sizes[0])
                continue
            if command in (SWAP_OUT, SWAP_IN, DROP):
                self._swap(command, sizes[0], sizes[1])
                continue
            if command != STEP:
                raise RuntimeError(f"unknown command {command} from the leader (expected one of {STOP}-{DROP})")
            self._receive(tuple(sizes)).forward(self.model, self.cache, logits=False)
            self.steps += 1

    def _move(self, count: int) -> None:
        """The leader's block moves: copy them here, then tell it the copy is done (Note [Moving
        blocks at TP])."""
        pairs = torch.empty(2 * count, dtype=torch.int64, device=self.device)
        dist.broadcast(pairs, group=self.group, group_src=0)
        ids = pairs.tolist()
        self.cache.copy_blocks(ids[:count], ids[count:])
        dist.all_reduce(torch.zeros(1, dtype=torch.int64, device=self.device), group=self.group)

    def _swap(self, command: int, request_id: int, count: int) -> None:
        """The leader's swap command for one request: copy its blocks to this rank's host, back,
        or drop the copy; then report through an all-reduce whether that failed (Note [Swapping
        out at TP]). A host copy that cannot be had or written fails; the leader recomputes."""
        ids = torch.empty(count, dtype=torch.int64, device=self.device)
        if count:
            dist.broadcast(ids, group=self.group, group_src=0)
        failed = 0
        try:
            if command == SWAP_OUT:
                self.swapped[request_id] = self.cache.swap_out(ids.tolist())
            elif command == SWAP_IN:
                host = self.swapped.pop(request_id, None)
                if host is None:
                    failed = 1
                else:
                    self.cache.swap_in(host, ids.tolist())
            else:
                self.swapped.pop(request_id, None)
        except RuntimeError:
            failed = 1
        dist.all_reduce(torch.tensor([failed], dtype=torch.int64, device=self.device), group=self.group)


# Note [Leader and workers]
# As in vLLM, one process schedules and the others execute: requests, block ids, preemption and
# sampling exist only on rank 0, so the ranks never have to agree on anything but the step they
# are told. A step is two broadcasts from rank 0 over the model's group: a header (command and
# the five sizes, 48 bytes) and the StepPlan's one int64 tensor, both on the model's device
# (NCCL on GPUs, gloo on CPU). Each rank then runs its shard; the two all-reduces per layer inside
# the forward keep the ranks in lockstep, and only rank 0 computes logits (the workers ask for
# none, skipping the LM head). Greedy tokens never travel back: the next plan carries them.
#
# Block ids come from rank 0's cache. A worker's cache is the same kind of cache with the same
# number of blocks, used only through its tensors: with StaticKVCache every id exists on every
# rank; with kvcached's elastic cache rank 0's page table repeats its maps on the workers
# (PageTable.set_mirror) before alloc returns, so a block id in a plan is backed on every rank.
# Rank 0 frees blocks (and lowers limits, which unmaps) only between steps, after sampling: its
# logits needed the last all-reduce of the step, which a worker's stream reaches only after every
# KV read and write of that step, so a page never goes from a worker while its GPU still uses it.
#
# If the leader fails inside a step, the workers are left in a collective that will not
# complete and see the process group's timeout; the group is then unusable, as in any
# torch.distributed program. ServingLoop redoes a failed step (Note [Failed steps] in
# kvcached.serving.loop), but here a redo would start collectives the workers do not expect
# (a header broadcast against the failed step's all-reduce: a hang or mixed data), so the loop
# refuses every step after one that failed once sent, and close() sends no STOP either. A clean
# end is close() (or leaving the loop's ``with`` block, which closes on an exception too, before
# the step's broadcast if the failure came first).
#
# Note [Swapping out at TP]
# Every rank holds its own heads of a request's K/V, so a preemption that keeps them (Note
# [Swapping out] in kvcached.serving.swap) copies them on every rank: the leader copies its own
# shard, sends SWAP_OUT (the request id and block count in the sizes, then the ids), and each
# worker queues the copy to its host and keeps it under the request id. All ranks then join an
# all-reduce of a failure flag that the leader waits for on the host, so every copy is queued
# before the leader frees the blocks and a worker's page can go (the all-reduce runs on the
# worker's stream after its copy, as for block moves). If any rank failed, the leader sends DROP
# and recomputes the request. Readmitted, the leader sends SWAP_IN over the new block ids (mapped
# on every rank before alloc returned): each worker writes its copy back and forgets it, and the
# flag says whether every one could; then the leader writes its own. A worker without a copy or
# whose write failed makes the leader release the blocks and raise from the step, and the
# request is recomputed. An abort sends DROP. swap_bytes bounds the leader's host bytes; a
# worker's shard of the same request takes as many (every rank holds as many KV heads).
#
# Note [Moving blocks at TP]
# Under a fair budget the leader may move blocks instead of preempting (Note [Fair share in the
# loop]): every rank holds the blocks' heads, so every rank copies them. The leader sends a MOVE
# header (the count in the first size), the old and new ids in one int64 tensor, copies its own,
# and then all ranks join an all-reduce, which the leader waits for on the host (.item()). A
# worker's all-reduce runs on its stream after its copy, so once the leader has the result every
# rank's copy is done, and only then does the leader free the old ids, whose pages its page table
# unmaps on every rank (the mirror): no worker still reads a page that goes.
