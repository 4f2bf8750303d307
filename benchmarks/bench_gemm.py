"""The model's own GEMMs at a decode step's token count: the floor they put under a serving step.

    python benchmarks/bench_gemm.py [--m 64,256] [--json PATH] [--quick]

A decode step of a transformers model runs, per layer, the q, k, v and o projections and the
gate, up and down projections, then the LM head once; kvcached's kernels add the attention
between them. This times those projections alone through torch's linear (cuBLAS on CUDA) at M
tokens, Llama-3-8B's shapes in bf16 (--quick: the tiny preset in float32 on the CPU), each with
one weight per layer so that nothing is read from L2 twice, in two arrangements:
  separate: the model as transformers builds it (q, k, v, gate, up: five GEMMs a layer);
  fused:    q/k/v and gate/up concatenated into one weight each (three GEMMs a layer), as engines
            with their own model code do.
On CUDA every projection's L calls are captured in one CUDA graph and timed over its replays (no
launch cost); the step's figure is the sum over layers and the LM head. GB/s counts the weight
bytes read. A benchmark, never a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402  (after the path insert)
import torch.nn.functional as F  # noqa: E402

from kvcached.serving.model import model_config  # noqa: E402

from bench_layout import time_calls  # noqa: E402

ARRANGEMENTS = {"separate": ("q", "k", "v", "o", "gate", "up", "down"), "fused": ("qkv", "o", "gate_up", "down")}


def projection_shapes(config) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of every projection of one layer, both arrangements, and the LM head."""
    hidden, head_dim = config.hidden_size, config.hidden_size // config.num_attention_heads
    q, kv, inter = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim, config.intermediate_size
    return {"q": (q, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, q), "gate": (inter, hidden),
            "up": (inter, hidden), "down": (hidden, inter), "qkv": (q + 2 * kv, hidden), "gate_up": (2 * inter, hidden),
            "lm_head": (config.vocab_size, hidden)}


def time_layers(x: torch.Tensor, weights: list[torch.Tensor], reps: int) -> float:
    """Median seconds of one call of F.linear(x, w), over one call per weight (CUDA: a captured graph)."""
    def run() -> None:
        for w in weights:
            F.linear(x, w)

    run()
    if x.is_cuda:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        graph.replay()
        run = graph.replay
    return time_calls(run, x.device.type, reps) / len(weights)


def bench(config, ms: list[int], dtype: torch.dtype, device: str, reps: int) -> list[dict]:
    shapes = projection_shapes(config)
    layers = config.num_hidden_layers
    rows = []
    for m in ms:
        x = torch.randn(m, config.hidden_size, dtype=dtype, device=device)
        seconds = {}
        for name, (n, k) in shapes.items():
            copies = 2 if name == "lm_head" else layers
            weights = [torch.randn(n, k, dtype=dtype, device=device) for _ in range(copies)]
            inputs = x if k == config.hidden_size else torch.randn(m, k, dtype=dtype, device=device)
            seconds[name] = time_layers(inputs, weights, reps)
            nbytes = n * k * weights[0].element_size()
            rows.append({"m": m, "gemm": name, "out": n, "in": k, "us": seconds[name] * 1e6,
                         "gb_per_s": nbytes / seconds[name] / 1e9})
            del weights
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        for arrangement, names in ARRANGEMENTS.items():
            step = layers * sum(seconds[name] for name in names) + seconds["lm_head"]
            nbytes = (layers * sum(shapes[name][0] * shapes[name][1] for name in names)
                      + shapes["lm_head"][0] * shapes["lm_head"][1]) * x.element_size()
            rows.append({"m": m, "gemm": f"step, {arrangement}", "us": step * 1e6, "gb_per_s": nbytes / step / 1e9})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", default="64,256", help="comma list of token counts (a decode step's batch)")
    parser.add_argument("--reps", type=int, default=20, help="timed replays per projection")
    parser.add_argument("--quick", action="store_true", help="the tiny preset in float32 on the CPU (smoke test)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    args = parser.parse_args()
    ms = [int(m) for m in args.m.split(",")]
    if args.quick or not torch.cuda.is_available():
        config, dtype, device = model_config("llama", "tiny"), torch.float32, "cpu"
    else:
        config, dtype, device = model_config("llama", "llama3-8b"), torch.bfloat16, "cuda"
    print(f"bench_gemm: {config.num_hidden_layers} layers, hidden {config.hidden_size}, {dtype} on {device}, "
          f"torch {torch.__version__}", flush=True)
    rows = bench(config, ms, dtype, device, args.reps)
    print("\n| M | GEMM | µs | weights read, GB/s |")
    print("|--:|---|--:|--:|")
    for r in rows:
        us = f"{r['us']:.1f}" if "step" not in r["gemm"] else f"**{r['us'] / 1e3:.3f} ms**"
        print(f"| {r['m']} | {r['gemm']} | {us} | {r['gb_per_s']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
        print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
