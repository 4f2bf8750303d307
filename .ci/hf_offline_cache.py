"""Write an offline Hugging Face cache holding only the config.json of the models vLLM's tests name.

Nothing can be downloaded here, and vLLM's ModelConfig resolves a model name through the hub cache
(HF_HUB_OFFLINE=1). The scheduling-side tests read only the architecture fields below, so a config
with the published shapes of each model stands in for the real repository.

Usage: python .ci/hf_offline_cache.py HF_HOME
"""

import json
import sys
from pathlib import Path

# A fixed snapshot name: the cache layout wants a commit hash, and refs/main points at it.
SNAPSHOT = "0" * 40

CONFIGS: dict[str, dict] = {
    "facebook/opt-125m": {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "hidden_size": 768,
        "word_embed_proj_dim": 768,
        "ffn_dim": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "max_position_embeddings": 2048,
        "vocab_size": 50272,
        "activation_function": "relu",
        "do_layer_norm_before": True,
        "enable_bias": True,
        "pad_token_id": 1,
        "bos_token_id": 2,
        "eos_token_id": 2,
        "torch_dtype": "float16",
    },
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "vocab_size": 151936,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    "Qwen/Qwen1.5-7B": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "vocab_size": 151936,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "torch_dtype": "bfloat16",
    },
}


def write_cache(hf_home: Path) -> None:
    """Lay out hub/models--ORG--NAME/{refs/main, snapshots/SNAPSHOT/config.json} for each model."""
    for name, config in CONFIGS.items():
        repo = hf_home / "hub" / ("models--" + name.replace("/", "--"))
        snapshot = repo / "snapshots" / SNAPSHOT
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(SNAPSHOT)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python .ci/hf_offline_cache.py HF_HOME")
    write_cache(Path(sys.argv[1]))
