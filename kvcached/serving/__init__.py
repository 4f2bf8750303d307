"""A continuous-batching loop that runs transformers causal LMs over a kvcached KV cache."""
