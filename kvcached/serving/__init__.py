"""A continuous-batching loop that runs transformers causal LMs over a kvcached KV cache.

- ``build_model(family, preset=, dtype=, device=, seed=, attn_implementation=)``: a Llama, Qwen2
  or Mistral model from a config with seeded random weights, wired to kvcached's paged attention
  (``ATTENTION_NAME``, registered with transformers' ``AttentionInterface``).
- ``ElasticKVCache(config, num_blocks, block_size=, dtype=, device=, kv_layout=, group_id=,
  pool_name=)``: kvcached tensors + a KVCacheManager (``.manager`` takes limits);
  ``StaticKVCache(...)``: a torch slab and a free list, the baseline. Both are PagedKVCache.
- ``ServingLoop(model, cache, max_batch_tokens=, max_running=, max_tokens=, cuda_graphs=,
  compile_model=, overlap=, swap_bytes=)``:
  ``add_request(prompt_ids, max_new_tokens) -> id``, ``step() -> finished Requests``,
  ``run_until_done() -> {id: tokens}`` (``LoopStalledError`` when no request can progress),
  ``take_finished()``, ``has_work()``, ``abort(id)``, ``check_invariants()``, ``capture_graphs()``,
  ``close()`` (gives the pad block back; also ``with``), ``stats`` (LoopStats: running, waiting,
  finished, preemptions, swapped_out, swapped_in, generated_tokens, tokens_per_s, runner_steps,
  graph_replays, ...).
  Steps are packed into persistent buffers (``StepBuffers``); decode-only steps replay a CUDA
  graph per padded batch size (``DecodeRunner``, ``decode_buckets``; on by default on CUDA).
- Tensor parallelism: ``shard_model(model, rank, world_size, group=, reduce_dtype=)`` keeps one
  rank's heads and MLP columns; ``shard_config(model.config, model.kvcached_shard)`` is what that rank's KV cache
  is built from; ``TensorParallelLoop(model, cache, group=, swap_bytes=)`` (a ServingLoop) runs on rank 0 and
  ``TensorParallelWorker(model, cache, group=).run()`` on the others. ``StepPlan`` is one step's
  inputs as one tensor (what rank 0 broadcasts); ``plan.forward(model, cache)`` runs the model
  over it inside ``running_step(StepMetadata(...))``, which is where the attention finds the step.
"""

from .attention import ATTENTION_NAME, StepMetadata, running_step
from .buffers import StepBuffers
from .cache import ElasticKVCache, PagedKVCache, StaticKVCache, kv_geometry
from .graphs import DecodeRunner, decode_buckets
from .loop import LoopStalledError, ServingLoop
from .model import FAMILIES, PRESETS, build_model, model_config
from .plan import StepPlan
from .scheduler import Request
from .shard import Shard, shard_config, shard_model
from .stats import LoopStats
from .tp import TensorParallelLoop, TensorParallelWorker

__all__ = [
           "ATTENTION_NAME",
           "FAMILIES",
           "PRESETS",
           "DecodeRunner",
           "ElasticKVCache",
           "LoopStalledError",
           "LoopStats",
           "PagedKVCache",
           "Request",
           "ServingLoop",
           "Shard",
           "StaticKVCache",
           "StepBuffers",
           "StepMetadata",
           "StepPlan",
           "TensorParallelLoop",
           "TensorParallelWorker",
           "build_model",
           "decode_buckets",
           "kv_geometry",
           "model_config",
           "running_step",
           "shard_config",
           "shard_model",
]
