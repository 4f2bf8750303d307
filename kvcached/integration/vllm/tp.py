"""vLLM at tensor parallelism > 1: the scheduler's pool leads, the workers follow.

Under vLLM's multiprocess executor the scheduler (with the BlockPool) runs in the engine core's
process, which owns no device, and TP worker r in a child process of its own. Each worker's
``allocate_kv_cache`` joins, as kvcached rank r + 1, an instance named after its parent
(kvcached.tp.named), reserves its shard's KV tensors and starts serving; TP rank 0 leaves a card
with the geometry. The engine core's first ElasticBlockPool finds that card, leads the
instance as rank 0 without pages (``init_kvcached(device="none")``), repeats the workers'
allocation and builds its manager over it: every block it hands out is mapped on every worker
first. See Note [vLLM at TP > 1].
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.distributed import parallel_state
from vllm.v1.executor.abstract import Executor
from vllm.v1.executor.multiproc_executor import MultiprocExecutor

from ...config import settings
from ...errors import KVCachedConfigError
from ...runtime import alloc_kv_cache, init_kvcached, initialised_as, initialised_page_bytes
from ...tp import named

CARD_VERSION = 1


def worker_world() -> tuple[int, int] | None:
    """(TP rank, TP size) of this vLLM worker when it runs at TP > 1 under vLLM's multiprocess
    executor; None at TP = 1 (the worker must then be in the scheduler's process). O(1).

    Raises KVCachedConfigError for pipeline parallelism, for another executor at TP > 1, or for a
    distributed world of several ranks that vLLM's model parallel groups do not describe."""
    if parallel_state.model_parallel_is_initialized():
        tp_group, pp_size = parallel_state.get_tp_group(), parallel_state.get_pp_group().world_size
        tp_size, tp_rank = tp_group.world_size, tp_group.rank_in_group
    elif torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        raise KVCachedConfigError(
            f"the distributed world has {torch.distributed.get_world_size()} ranks but vLLM's model parallel groups "
            f"are not initialised: kvcached's vLLM integration takes the TP rank from them (vLLM's workers make "
            f"them before allocating the KV cache)")
    else:
        return None
    if pp_size > 1:
        raise KVCachedConfigError(f"pipeline_parallel_size={pp_size}: kvcached's vLLM integration supports tensor "
                                  f"parallelism only; use pipeline_parallel_size=1")
    if tp_size == 1:
        return None
    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is not None:
        executor = Executor.get_class(vllm_config)
        if not issubclass(executor, MultiprocExecutor):
            raise KVCachedConfigError(
                f"tensor_parallel_size={tp_size} with the {executor.__name__}: kvcached's vLLM integration needs the "
                f"workers to be children of the scheduler's process, as vLLM's multiprocess executor starts them: "
                f"distributed_executor_backend='mp'. See Note [vLLM at TP > 1]")
    return tp_rank, tp_size


def join_scheduler(device, tp_rank: int, tp_size: int, page_size_bytes: int) -> None:
    """Make this worker rank tp_rank + 1 of the instance its parent (the engine core) will lead,
    on `device`, with pages of `page_size_bytes`. Idempotent once joined.

    Raises KVCachedConfigError if kvcached is already initialised otherwise in this process."""
    position = initialised_as()
    if position == (tp_rank + 1, tp_size + 1):
        return
    if position is not None:
        raise KVCachedConfigError(
            f"kvcached is initialised in this vLLM worker as rank {position[0]} of {position[1]}, but at "
            f"tensor_parallel_size={tp_size} TP rank {tp_rank} must be rank {tp_rank + 1} of {tp_size + 1} (the "
            f"scheduler leads): leave kvcached uninitialised in vLLM's workers, allocate_kv_cache initialises it")
    link = named.join(named.parent_identity(), tp_rank + 1, tp_size + 1, settings().tp_timeout_s)
    init_kvcached(tp_rank=tp_rank + 1, world_size=tp_size + 1, device=device, page_size_bytes=page_size_bytes,
                  tp_link=link)


def publish_geometry(tp_rank: int, tp_size: int, page_bytes: int, num_blocks: int, num_buffers: int,
                     group_id: int) -> None:
    """TP rank 0: leave the scheduler the card of what allocate_kv_cache made (num_buffers
    buffers of num_blocks blocks of page_bytes in group group_id)."""
    if tp_rank:
        return
    named.publish_card(named.parent_identity(), {
        "version": CARD_VERSION, "world_size": tp_size + 1, "page_size_bytes": initialised_page_bytes(),
        "block_bytes": page_bytes, "num_blocks": num_blocks, "num_buffers": num_buffers, "group_id": group_id})


def lead_workers() -> dict | None:
    """In the scheduler's process: if this process's workers left a card, lead them (rank 0
    without pages), make the group they made and return its pool geometry (the PoolGeometry
    fields); else None (a pool beside its worker, or a standalone one). O(1) without a card:
    one failed open.

    Raises KVCachedConfigError for a card of another version or a runtime already initialised
    otherwise; KVCachedTPError if a worker did not join or died."""
    card = named.read_card()
    if card is None:
        return None
    if card.get("version") != CARD_VERSION:
        raise KVCachedConfigError(f"the vLLM workers left a card of version {card.get('version')}, this kvcached reads "
                                  f"version {CARD_VERSION}: install one kvcached for the engine and its workers")
    world_size = card["world_size"]
    link = named.lead(world_size, settings().tp_timeout_s)
    init_kvcached(tp_rank=0, world_size=world_size, device="none", page_size_bytes=card["page_size_bytes"],
                  tp_link=link)
    num_blocks, block_bytes, num_buffers, group_id = (card[k] for k in ("num_blocks", "block_bytes", "num_buffers",
                                                                      "group_id"))
    # The workers' own call (allocate_kv_cache), repeated: the same group, no tensors here.
    alloc_kv_cache((num_blocks, 1, block_bytes), 1, torch.int8, "none", num_buffers, attention_type="MLA",
                   group_id=group_id)
    return dict(block_size=1, cell_size=block_bytes, num_layers=num_buffers, num_kv_buffers=1, group_id=group_id,
                num_blocks=num_blocks)


# Note [vLLM at TP > 1]
# vLLM's multiprocess executor runs the scheduler in the engine core's process and TP worker r in
# a child process of its own; the scheduler is in no process group of the workers. kvcached's
# instance is then the engine core (rank 0, a leader without pages: it owns no device) and the
# workers (ranks 1..TP), met through a rendezvous named after the engine core
# (Note [Named rendezvous] in kvcached/tp/named.py). The order is vLLM's: every worker's
# allocate_kv_cache runs (initialize_from_config) before the engine core builds its scheduler, so
# a worker joins, reserves its tensors and serves without waiting for anyone, and the first
# ElasticBlockPool of the engine core leads. The pool's geometry, which the single-process case
# sets in-process (set_pool_geometry), comes in the card TP rank 0 leaves; the engine core repeats
# that allocate_kv_cache's alloc_kv_cache without tensors, so the ranks compare their groups
# (REGISTER) before any block is handed out. Limits, the tracker and the budget count the TP
# workers' pages (the leader's managers have world_size TP). A worker that dies makes the next
# map fail with KVCachedTPError within 20 ms (its process is watched by pid); the error leaves
# vLLM's schedule() like any exception of the scheduler, so the engine core stops and vLLM
# reports the engine dead, as when the executor sees a worker die. The executor must start the
# workers as children of the scheduler's process: Ray and external launchers do not, and are
# refused; so is pipeline parallelism (one rank 0 per stage would be needed). TP = 1 keeps the
# single-process rule (Note [One process] in kv_tensors.py).
