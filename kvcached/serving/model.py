"""Llama-family causal LMs built from a config with seeded random weights (nothing is downloaded)."""

from __future__ import annotations

import torch

from kvcached.checks import as_int

from .attention import ATTENTION_NAME

FAMILIES = ("llama", "qwen2", "mistral")

# "tiny": CPU tests. initializer_range 0.5 makes attention sharp enough that a wrong mask or a
# wrong block changes the greedy tokens; a small sliding window (Mistral everywhere, Qwen2 on its
# second layer) puts windowed attention inside short test sequences.
# "llama3-8b": Llama-3-8B's shapes, for GPU runs in bf16.
PRESETS: dict[str, dict] = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 1024,
             "initializer_range": 0.5},
    "llama3-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                  "max_position_embeddings": 8192, "initializer_range": 0.02, "rms_norm_eps": 1e-5,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
}
TINY_SLIDING_WINDOW = 12


def model_config(family: str = "llama", preset: str = "tiny"):
    """The transformers config of `family` with `preset`'s shapes, eos disabled."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is unknown; use one of {', '.join(FAMILIES)}")
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r} is unknown; use one of {', '.join(PRESETS)}")
    fields = dict(PRESETS[preset], bos_token_id=None, eos_token_id=None, pad_token_id=0,
                  tie_word_embeddings=False)
    if family == "llama":
        return LlamaConfig(**fields)
    window = TINY_SLIDING_WINDOW if preset == "tiny" else None
    if family == "mistral":
        return MistralConfig(**fields, sliding_window=window)
    if window is None:
        return Qwen2Config(**fields)
    return Qwen2Config(**fields, use_sliding_window=True, sliding_window=window, max_window_layers=1)


def build_model(family: str = "llama", *, preset: str = "tiny", dtype: torch.dtype = torch.float32,
                device="cpu", seed: int = 0, attn_implementation: str | None = None):
    """A causal LM of `family` ("llama", "qwen2", "mistral") with seeded random weights, in eval mode.

    attn_implementation None means kvcached's paged attention (what ServingLoop runs); "sdpa" or
    "eager" give the same weights for transformers' own generate. Raises ValueError for an
    unknown family or preset."""
    from transformers import AutoModelForCausalLM

    seed = as_int(seed, "seed", minimum=0, error=ValueError)
    config = model_config(family, preset)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 attn_implementation=attn_implementation or ATTENTION_NAME)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()
