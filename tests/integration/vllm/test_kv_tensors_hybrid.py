"""Hybrid models (attention + Mamba state groups) on the worker side of kvcached.integration.vllm:
for the KV cache config vLLM itself makes from a hybrid model's Hugging Face config (no
weights), every layer's view from allocate_kv_cache has the shape, dtype and in-block strides of
vLLM's own allocate_kv_cache, the Mamba layers cut the same state tensors out of it, and a block
id addresses the same bytes in both. See Note [Mamba state pages] in kv_tensors.

Skipped without a supported vLLM (tests/integration/vllm/_vllm_contract.py).
"""

from __future__ import annotations

import types

import pytest
import torch
import _vllm_contract  # noqa: F401 (skips this module without a supported vLLM)

transformers = pytest.importorskip("transformers")

from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.models import ModelRegistry
from vllm.platforms import current_platform
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec, MambaSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache as vllm_allocate_kv_cache

try:                    # vLLM 0.33 plans the groups apart
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    def kv_cache_config_of(vllm_config, specs) -> KVCacheConfig:
        (config,) = get_kv_cache_configs(vllm_config, [specs], [1 << 30],
                                         get_global_kv_cache_groups(vllm_config, [specs]))
        return config
except ImportError:     # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    def kv_cache_config_of(vllm_config, specs) -> KVCacheConfig:
        (config,) = get_kv_cache_configs(vllm_config, [specs], [1 << 30])
        return config

from kvcached.errors import KVCachedConfigError
from kvcached.integration.vllm import ElasticBlockPool, allocate_kv_cache, pool_geometry, set_pool_geometry
from kvcached.runtime import initialised_page_bytes

NUM_BLOCKS = 12

# Small configs of the hybrid families vLLM 0.33 serves: layer kinds and state shapes as in the
# published models, sizes shrunk. Qwen3-Next's model module needs compressed-tensors to import.
HF_CONFIGS = {
    "granite-4.0-h": lambda: transformers.GraniteMoeHybridConfig(
        architectures=["GraniteMoeHybridForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba", "mamba", "attention"], mamba_n_heads=4, mamba_d_head=32,
        mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, num_local_experts=0,
        shared_intermediate_size=128, max_position_embeddings=4096),
    "jamba": lambda: transformers.JambaConfig(
        architectures=["JambaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, num_experts=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8),
    "falcon-h1": lambda: transformers.FalconH1Config(     # attention and Mamba side by side in every layer
        architectures=["FalconH1ForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_d_ssm=64,
        mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2),
}


def hybrid_kv_cache_config(hf_config, model_dir, layout: KVCacheLayout) -> tuple[KVCacheConfig, dict[str, KVCacheSpec]]:
    """The KVCacheConfig vLLM's engine core makes for this model with NUM_BLOCKS blocks, and each
    layer's spec as the model's layers report it.

    vLLM's own steps: ModelConfig from the config file, the platform's alignment of attention and
    Mamba pages (which vLLM runs once the layers exist, here with the CPU attention backend),
    the model class's Mamba state shapes and dtypes, the layout resolution, the global grouping
    (unify_hybrid_kv_cache_specs and the groups of one page size) and the worker's config."""
    hf_config.save_pretrained(model_dir)
    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128)
    assert model_config.is_hybrid, model_config.architecture
    # The SSM state in float32, as vLLM's CPU platform sets it where the CPU has AVX512-BF16 and
    # leaves it at the model's dtype elsewhere: so the pages (Granite's 12 KiB) are the same on
    # every machine.
    cache_config = CacheConfig(block_size=16, num_gpu_blocks_override=NUM_BLOCKS, mamba_ssm_cache_dtype="float32")
    vllm_config = VllmConfig(model_config=model_config, cache_config=cache_config)
    current_platform._align_hybrid_block_size(vllm_config, CPUAttentionBackend)
    cache = vllm_config.cache_config
    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
    attention = FullAttentionSpec(block_size=cache.block_size,
                                  num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
                                  head_size=model_config.get_head_size(), dtype=torch.bfloat16)
    mamba = MambaSpec(shapes=tuple(model_cls.get_mamba_state_shape_from_config(vllm_config)),
                      dtypes=tuple(model_cls.get_mamba_state_dtype_from_config(vllm_config)),
                      block_size=cache.mamba_block_size, page_size_padded=cache.mamba_page_size_padded,
                      mamba_cache_mode=cache.mamba_cache_mode)
    specs: dict[str, KVCacheSpec] = {}
    for index, kind in enumerate(hf_config.layer_types):
        if kind in ("full_attention", "attention", "hybrid"):
            specs[f"model.layers.{index}.self_attn.attn"] = attention
        if kind in ("linear_attention", "mamba", "hybrid"):
            specs[f"model.layers.{index}.mamba"] = mamba
    assert {type(spec) for spec in specs.values()} == {FullAttentionSpec, MambaSpec}
    resolve_kv_cache_layout(vllm_config, [[layout.name]], specs.values())
    config = kv_cache_config_of(vllm_config, specs)
    assert config.num_blocks == NUM_BLOCKS and config.has_mamba_layers
    return config, specs


def page_of(view: torch.Tensor, block_id: int, page_bytes: int) -> torch.Tensor:
    """The page_bytes bytes from the start of block block_id of a layer's [B, H, N, C] view."""
    raw = torch.empty(0, dtype=torch.int8).set_(view.untyped_storage())
    start = (view.storage_offset() + block_id * view.stride(0)) * view.element_size()
    return raw[start:start + page_bytes]


def mamba_states(view: torch.Tensor, spec: MambaSpec) -> tuple[torch.Tensor, ...]:
    """The state tensors a Mamba layer cuts out of its view (vLLM's MambaBase.bind_kv_cache)."""
    layer = types.SimpleNamespace(get_state_shape=lambda: spec.shapes, get_state_dtype=lambda: spec.dtypes)
    MambaBase.bind_kv_cache(layer, view)
    return layer.kv_cache


@pytest.fixture
def kv_uninitialised(kv_env):
    """kvcached not initialised (vLLM's allocation initialises it), no reserved pool."""
    kv_env(MIN_RESERVED_PAGES=0, MAX_RESERVED_PAGES=0)
    try:
        yield
    finally:
        set_pool_geometry(None)


@pytest.mark.parametrize("model", sorted(HF_CONFIGS))
@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BLNHC])
def test_hybrid_views_match_vllms_views_and_bytes(kv_uninitialised, tmp_path, model, layout):
    """Every block id of vLLM's pool is handed out (kvcached's page holds whole vLLM pages),
    and each layer's view, Mamba states included, is vLLM's, byte for byte."""
    config, specs = hybrid_kv_cache_config(HF_CONFIGS[model](), tmp_path, layout)
    kernel_block_sizes = [group.kv_cache_spec.block_size for group in config.kv_cache_groups]
    stock = vllm_allocate_kv_cache(config, torch.device("cpu"), layout, kernel_block_sizes)
    ours = allocate_kv_cache(config, "cpu", layout, kernel_block_sizes)
    assert ours.keys() == stock.keys() == specs.keys()
    for name, view in ours.items():
        assert (view.shape, view.dtype) == (stock[name].shape, stock[name].dtype), name
        assert view.stride()[1:] == stock[name].stride()[1:], name
        if isinstance(specs[name], MambaSpec):
            for state, stock_state in zip(mamba_states(view, specs[name]), mamba_states(stock[name], specs[name]),
                                          strict=True):
                assert (state.shape, state.dtype, state.stride()[1:]) == \
                    (stock_state.shape, stock_state.dtype, stock_state.stride()[1:]), name
    (page_bytes,) = {spec.page_size_bytes for spec in specs.values()}
    assert pool_geometry().cell_size == page_bytes and pool_geometry().num_blocks == NUM_BLOCKS
    assert initialised_page_bytes() % page_bytes == 0 and initialised_page_bytes() % (2 << 20) == 0

    pool = ElasticBlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=16)
    try:
        block_ids = [block.block_id for block in pool.get_new_blocks(NUM_BLOCKS - 1)]
        generator = torch.Generator().manual_seed(0)
        # Every layer writes its whole block, in one order in both: where groups overlay, the
        # last writer's bytes must win in both; Mamba layers write through their states.
        for name in ours:
            for block_id in block_ids:
                if isinstance(specs[name], MambaSpec):
                    for state, stock_state in zip(mamba_states(ours[name], specs[name]),
                                                  mamba_states(stock[name], specs[name])):
                        values = torch.randn(state.shape[1:], generator=generator).to(state.dtype)
                        state[block_id] = values
                        stock_state[block_id] = values
                else:
                    values = torch.randn(ours[name].shape[1:], generator=generator).to(ours[name].dtype)
                    ours[name][block_id] = values
                    stock[name][block_id] = values
        for name in ours:
            for block_id in block_ids:
                assert torch.equal(page_of(ours[name], block_id, page_bytes),
                                   page_of(stock[name], block_id, page_bytes)), (name, block_id)
    finally:
        pool.close()


def test_pages_that_would_split_hybrid_blocks_are_refused(vllm_kv, tmp_path):
    """kvcached initialised with 64 KiB pages, which Granite's 12 KiB hybrid page does not divide:
    refused before anything is allocated, naming the page size that fits (3 MiB)."""
    config, specs = hybrid_kv_cache_config(HF_CONFIGS["granite-4.0-h"](), tmp_path, KVCacheLayout.LBNHC)
    assert {spec.page_size_bytes for spec in specs.values()} == {12288}
    with pytest.raises(KVCachedConfigError, match=r"pages of 65536 bytes.*KVCACHED_PAGE_SIZE_MB=3\b"):
        allocate_kv_cache(config, "cpu", KVCacheLayout.LBNHC)
    assert pool_geometry() is None                  # nothing was allocated, no geometry set


def test_hybrid_scheduler_hands_out_rows_of_the_hybrid_tensors(kv_uninitialised, tmp_path):
    """vLLM's scheduler-side KVCacheManager over a hybrid config (its hybrid coordinator, one
    pool for the attention and Mamba groups) with the ElasticBlockPool the worker hook pointed at
    the tensors: every group's blocks of an admitted request are mapped rows, written through the
    attention view and the Mamba states; freeing and resetting give every page back."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from _vllm_contract import make_request, scheduler_manager

    init_none_hash(sha256)
    config, specs = hybrid_kv_cache_config(HF_CONFIGS["granite-4.0-h"](), tmp_path, KVCacheLayout.LBNHC)
    tensors = allocate_kv_cache(config, "cpu", KVCacheLayout.LBNHC)
    block_size = config.kv_cache_groups[0].kv_cache_spec.block_size
    manager = scheduler_manager(config, block_size=block_size, max_model_len=128, enable_caching=True)
    pool = manager.block_pool
    try:
        request = make_request("a", list(range(100)))
        blocks = manager.allocate_slots(request, request.num_tokens)
        assert blocks is not None
        ids_by_group = blocks.get_block_ids()
        assert len(ids_by_group) == len(config.kv_cache_groups) >= 2
        for group, block_ids in zip(config.kv_cache_groups, ids_by_group):
            live = [block_id for block_id in block_ids if block_id != pool.null_block.block_id]
            assert live, group.layer_names
            for name in group.layer_names:
                if isinstance(specs[name], MambaSpec):
                    for state in mamba_states(tensors[name], specs[name]):
                        state[live] = 3
                        assert bool((state[live] == 3).all()), name
                else:
                    tensors[name][live] = 2.0
                    assert bool((tensors[name][live] == 2.0).all()), name
        pool.check_invariants()
        manager.free(request)
        assert manager.reset_prefix_cache()
        assert pool.manager.stats()["pages"]["mapped"] == 1       # the null block's page
        pool.check_invariants()
    finally:
        pool.close()
