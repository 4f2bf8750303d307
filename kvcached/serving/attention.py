"""The paged attention function transformers models call through ``AttentionInterface``.

Registered under ATTENTION_NAME; a model built with ``attn_implementation=ATTENTION_NAME`` runs
unchanged. Each layer writes its new K/V into the cache's blocks and attends through the block
tables of the step. The step travels as the model kwarg STEP_KWARG, which transformers hands to
every layer's attention call unchanged (a kwarg named ``cache`` or ``past_key_values`` would be
taken as the model's own cache). With a custom name the model builds no mask: causal, per-request
and sliding-window masking all happen in ``paged_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from kvcached.ops import paged_attention, write_kv

from .cache import PagedKVCache

ATTENTION_NAME = "kvcached_paged"
STEP_KWARG = "kv_step"


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


def paged_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask, dropout: float = 0.0, scaling: float | None = None,
                            sliding_window: int | None = None, **kwargs):
    """query [1, H, T, D], key/value [1, KVH, T, D] (RoPE applied) -> ([1, T, H, D], None)."""
    step = kwargs.get(STEP_KWARG)
    if not isinstance(step, StepMetadata):
        raise TypeError(f"attn_implementation={ATTENTION_NAME!r} needs the step metadata as the model kwarg "
                        f"{STEP_KWARG}=; run the model through kvcached.serving.ServingLoop")
    if query.shape[0] != 1:
        raise RuntimeError(f"{ATTENTION_NAME} runs packed steps of batch 1, got batch {query.shape[0]}")
    k_cache, v_cache = step.cache.layer(module.layer_idx)
    layout = step.cache.kv_layout
    write_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache, step.slot_mapping,
             kv_layout=layout)
    scale = module.scaling if scaling is None else scaling
    out = paged_attention(query[0].transpose(0, 1), k_cache, v_cache, step.block_tables, step.seq_lens,
                          step.query_start_loc, scale, sliding_window=sliding_window, kv_layout=layout)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
