"""Split a Llama-family model across tensor-parallel ranks: attention heads and MLP columns.

Every rank builds the full model (``build_model``, same seed, same weights) and keeps its part:
q/k/v and gate/up split by output rows (whole heads), o_proj and down_proj by input columns with a
sum over the ranks after them. Embeddings, norms and the LM head stay whole on every rank. See
Note [Head split] for which heads a rank keeps and why not transformers' own tp_plan.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from kvcached.checks import as_int

from .cache import kv_geometry


@dataclass(frozen=True)
class Shard:
    """The part of the model one rank holds."""

    rank: int
    world_size: int
    num_heads: int                  # query heads on this rank
    num_kv_heads: int               # KV heads on this rank (its KV cache holds exactly these)
    first_head: int
    first_kv_head: int
    intermediate: slice             # MLP columns of this rank


def plan_shard(config, rank: int, world_size: int) -> Shard:
    """Which heads and MLP columns rank `rank` of `world_size` keeps. Raises ValueError naming
    the count that does not divide. See Note [Head split]."""
    world_size = as_int(world_size, "world_size", minimum=1, error=ValueError)
    rank = as_int(rank, "rank", minimum=0, maximum=world_size - 1, error=ValueError)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    for name, count in (("num_attention_heads", heads), ("intermediate_size", config.intermediate_size)):
        if count % world_size:
            raise ValueError(f"{name}={count} does not divide by world_size={world_size}; "
                             f"use a world size that divides it")
    if kv_heads % world_size and world_size % kv_heads:
        raise ValueError(f"num_key_value_heads={kv_heads} and world_size={world_size}: one must divide the other "
                         f"(KV heads are split, or replicated when there are fewer than ranks)")
    width = config.intermediate_size // world_size
    return Shard(rank, world_size, heads // world_size, max(1, kv_heads // world_size),
                 rank * heads // world_size, rank * kv_heads // world_size, slice(rank * width, (rank + 1) * width))


def shard_config(config, shard: Shard):
    """A copy of `config` with this rank's head counts: what its KV cache is built from."""
    _, _, head_dim = kv_geometry(config)
    local = copy.deepcopy(config)
    local.num_attention_heads = shard.num_heads
    local.num_key_value_heads = shard.num_kv_heads
    local.head_dim = head_dim
    local.intermediate_size = shard.intermediate.stop - shard.intermediate.start
    return local


class RowParallelLinear(nn.Module):
    """This rank's input columns of a Linear; the partial outputs are summed over the group,
    then the bias is added once (so every rank ends with the same full output).

    reduce_dtype (None: the input's) is the dtype of the partial outputs and of their sum:
    float32 under a bfloat16 model rounds once after the sum, as one matmul over all columns
    does, instead of once per rank. See Note [Head split]."""

    def __init__(self, full: nn.Linear, columns: slice, group=None, reduce_dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach()[:, columns].clone(), requires_grad=False)
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone(), requires_grad=False)
        self.group = group
        self.reduce_dtype = reduce_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.reduce_dtype or x.dtype
        if dtype == x.dtype:
            out = nn.functional.linear(x, self.weight)
        elif x.is_cuda:         # accumulates in float32 and keeps it, without a float32 copy of the weight
            out = torch.mm(x.reshape(-1, x.shape[-1]), self.weight.t(), out_dtype=dtype)
            out = out.view(*x.shape[:-1], out.shape[-1])
        else:                   # no mm(out_dtype=) on the CPU
            out = nn.functional.linear(x.to(dtype), self.weight.to(dtype))
        dist.all_reduce(out, group=self.group)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype)


def _keep_rows(linear: nn.Linear, rows: slice) -> None:
    """Cut a Linear down to output rows `rows` in place (the full weight is freed)."""
    linear.weight = nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[rows].clone(), requires_grad=False)
    linear.out_features = rows.stop - rows.start


def shard_model(model, rank: int, world_size: int, group=None, *, reduce_dtype: torch.dtype | None = None):
    """Keep rank `rank`'s part of every decoder layer of `model` (in place) and return the model;
    ``model.kvcached_shard`` records the Shard. The group's all-reduce joins the parts, so every
    rank must run each forward together; reduce_dtype is RowParallelLinear's (None: the model's
    dtype, as vLLM does; torch.float32 under bfloat16 follows TP = 1 more closely, at twice the
    bytes per all-reduce). Raises ValueError (model unchanged) for a model that does not split
    `world_size` ways or is split already."""
    if getattr(model, "kvcached_shard", None) is not None:
        raise ValueError(f"the model is split already ({model.kvcached_shard}); build a fresh one to split it again")
    config = model.config
    shard = plan_shard(config, rank, world_size)
    _, _, head_dim = kv_geometry(config)
    q_rows = slice(shard.first_head * head_dim, (shard.first_head + shard.num_heads) * head_dim)
    kv_rows = slice(shard.first_kv_head * head_dim, (shard.first_kv_head + shard.num_kv_heads) * head_dim)
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        _keep_rows(attention.q_proj, q_rows)
        _keep_rows(attention.k_proj, kv_rows)
        _keep_rows(attention.v_proj, kv_rows)
        attention.o_proj = RowParallelLinear(attention.o_proj, q_rows, group, reduce_dtype)
        attention.num_key_value_groups = shard.num_heads // shard.num_kv_heads
        _keep_rows(mlp.gate_proj, shard.intermediate)
        _keep_rows(mlp.up_proj, shard.intermediate)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, shard.intermediate, group, reduce_dtype)
    model.kvcached_shard = shard
    return model


# Note [Head split]
# Rank r of w keeps query heads [r*H/w, (r+1)*H/w) and the KV heads they read: with KVH >= w
# that is KV heads [r*KVH/w, (r+1)*KVH/w); with fewer KV heads than ranks (w a multiple of KVH)
# each rank keeps the one KV head r*KVH//w, replicated on w/KVH ranks, as vLLM does. Both cases
# are first = r*KVH//w: the query heads of a rank then all fall in that rank's KV groups (a group
# holds H/KVH >= H/w heads). Each rank's KV cache holds only its KV heads (shard_config), so the
# cache bytes per rank drop by w (or to one head). The attention output rows of a rank are its
# query heads, so o_proj is split by the same columns and summed over the ranks; the MLP is split
# by intermediate columns the same way: two all-reduces per layer, none elsewhere.
#
# The sum over ranks rounds differently from one matmul over all columns: in float32 the greedy
# tokens match TP=1 (the tests check it, on the CPU and on two GPUs). In bfloat16 each rank's
# partial output is rounded to bfloat16 before the sum, where TP=1 rounds once: the logits differ
# in their last bits and a near tie flips a token, which the flat logits of a random model have
# early (bench_serve_tp counts the requests that kept TP=1's tokens). reduce_dtype=float32 keeps
# the partials and their sum in float32 and rounds once, as TP=1 does; what still differs is the
# order of float32 additions and the GEMM tiling of the narrower column-split matrices. On two
# GPUs, Llama-3-8B shapes with random weights (initializer_range 0.02, nearly flat logits):
# float32 kept TP=1's tokens in every request; bfloat16 in none, the first differing token at a
# median position under 10 with bfloat16 or float32 sums; the tiny preset (sharper logits) in
# bfloat16 kept them in about one request of six (benchmarks/HISTORY.md). So float32 is what the
# identity tests run; bfloat16 agrees only up to ties.
#
# transformers' own tensor-parallel plan is applied by ``from_pretrained`` while it loads a
# checkpoint (``tp_plan=`` until 5.17, ``distributed_config=`` from 5.18): a model built from a
# config with random weights never goes through it, and it gives no KV-head count per rank to size
# a paged cache. The split is done here instead, on the plain Linears, for both versions.
