"""The paged attention function transformers models call through ``AttentionInterface``.

Registered under ATTENTION_NAME; a model built with ``attn_implementation=ATTENTION_NAME`` runs
unchanged. Each layer writes its new K/V into the cache's blocks and attends through the block
tables of the step that ``running_step`` made current (StepPlan.forward does): the step never
passes through the model's arguments, so a compiled model sees only its token inputs (Note [A
compiled model]). With a custom name the model builds no mask: causal, per-request and
sliding-window masking all happen in ``paged_attention``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from kvcached.ops import paged_attention, write_kv

from .cache import PagedKVCache

ATTENTION_NAME = "kvcached_paged"


@dataclass
class StepMetadata:
    """Where one packed step's tokens go and what each request attends to (ops' conventions).

    The index tensors are int64 views of the step's one StepPlan tensor (kvcached.serving.plan);
    the ops take int32 or int64."""

    cache: PagedKVCache
    slot_mapping: torch.Tensor          # [T] int64, block_id * block_size + offset
    block_tables: torch.Tensor          # [B, max_blocks] int64
    seq_lens: torch.Tensor              # [B] int64, cached tokens including this step's
    query_start_loc: torch.Tensor       # [B + 1] int64
    num_decodes: int = 0                # the first requests that run one token each


_current: contextvars.ContextVar[StepMetadata | None] = contextvars.ContextVar("kvcached_step", default=None)


@contextlib.contextmanager
def running_step(step: StepMetadata) -> Iterator[None]:
    """Make `step` the one every layer's attention writes and reads while the block runs (the
    model call of that step); the previous one, if any, is current again after it."""
    token = _current.set(step)
    try:
        yield
    finally:
        _current.reset(token)


def paged_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask, dropout: float = 0.0, scaling: float | None = None,
                            sliding_window: int | None = None, **kwargs):
    """query [1, H, T, D], key/value [1, KVH, T, D] (RoPE applied) -> ([1, T, H, D], None)."""
    if query.shape[0] != 1:
        raise RuntimeError(f"{ATTENTION_NAME} runs packed steps of batch 1, got batch {query.shape[0]}")
    scale = module.scaling if scaling is None else scaling
    attend = torch.ops.kvcached.attend if torch.compiler.is_compiling() else _attend
    out = attend(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), module.layer_idx,
                 scale, sliding_window)
    return out.unsqueeze(0), None


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float,
            sliding_window: int | None) -> torch.Tensor:
    """One layer's attention of the current step: write its K/V, then attend through the tables."""
    step = _current.get()
    if step is None:
        raise RuntimeError(f"attn_implementation={ATTENTION_NAME!r} attends within a step: run the model "
                           f"through kvcached.serving.ServingLoop (or StepPlan.forward, or inside "
                           f"running_step(StepMetadata(...)))")
    k_cache, v_cache = step.cache.layer(layer)
    layout = step.cache.kv_layout
    write_kv(key, value, k_cache, v_cache, step.slot_mapping, kv_layout=layout)
    return paged_attention(query, k_cache, v_cache, step.block_tables, step.seq_lens, step.query_start_loc, scale,
                           sliding_window=sliding_window, kv_layout=layout, num_decodes=step.num_decodes)


# The same function as an operator torch.compile keeps whole. See Note [A compiled model].
torch.library.custom_op("kvcached::attend", _attend, mutates_args=())


@torch.library.register_fake("kvcached::attend")
def _attend_shape(query, key, value, layer, scale, sliding_window):
    return query.new_empty(query.shape)         # contiguous, as the kernels' and the torch path's outputs


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


# Note [A compiled model]
# ServingLoop(compile_model=True) runs torch.compile(model, dynamic=True, fullgraph=True): one
# graph of the whole forward for every step size, in which the compiler fuses transformers' small
# ops. kvcached's part of each layer is the operator kvcached::attend(q, k, v, layer, scale,
# window), which the compiler keeps whole and calls as it is: the Triton kernels' launch code
# (grids from shapes, geometry memo) and the torch path on the CPU run unchanged, under a CUDA
# graph too. Tracing into them instead would break the graph at every host-side check.
#
# The step (caches, slot mapping, block tables, lengths) reaches the operator through a context
# variable, not through the model's arguments: as arguments its tensors would be inputs of the
# compiled graph, each size and storage offset a symbol to guard on, and every new table width,
# cache or coincidence of sizes a recompile. So the compiled graph's inputs are the token ids,
# positions and logit indices only: a few graphs in all (a size of 1 is specialised).
#
# The operator declares no mutation although it writes the step's K/V into the layer's caches,
# which are not its arguments either: nothing else in the compiled graph reads or writes a cache,
# each layer's write and read happen inside its own call, in order, and calls of different layers
# touch different tensors. The fake (meta) function gives the output: the query's shape,
# contiguous.
