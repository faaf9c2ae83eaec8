"""`pagedserve simulate` on the GPU profiles against published throughput figures.

The reference is NVIDIA's TensorRT-LLM performance overview (docs/source/performance/
perf-overview.md of NVIDIA/TensorRT-LLM at commit 00f37686aa85, the v1.0 tables):
offline throughput (all requests queued at once, `trtllm-bench throughput`), FP8 weights
(nvidia/Llama-3.1-8B-Instruct-FP8, nvidia/Llama-3.3-70B-Instruct-FP8), fixed input and
output lengths, "Total Output Throughput (tokens/sec)", KV-cache memory fraction 0.90-0.95,
CUDA graphs.  We simulate pagedserve with the same model shapes, FP8 weights, lengths and
parallelism, max_num_seqs 1024 and a token budget of 8192 (TensorRT-LLM's default
max_num_tokens), with fewer requests than NVIDIA ran (steady state is reached well before).

    python benchmarks/simulate_published.py                       # a few minutes
    python benchmarks/simulate_published.py --kv-cache-dtype fp8  # FP8 KV cache
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile

# Llama-3.1-8B / Llama-3.3-70B config.json shapes (meta-llama on Hugging Face).
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
LLAMA_70B = {
    **LLAMA_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
}

SOURCE = (
    "NVIDIA TensorRT-LLM perf overview, docs/source/performance/perf-overview.md at commit 00f37686aa85 "
    "(FP8, trtllm-bench throughput, Total Output Throughput tokens/s)"
)

# (model, hardware, tp, input, output, published tokens/s, requests we simulate)
CASES = [
    ("llama-3.1-8b", "h100-sxm", 1, 128, 128, 28312, 4000),
    ("llama-3.1-8b", "h100-sxm", 1, 128, 2048, 22714, 1500),
    ("llama-3.1-8b", "h100-sxm", 1, 2048, 128, 3450, 1500),
    ("llama-3.1-8b", "h100-sxm", 1, 1000, 1000, 15220, 1500),
    ("llama-3.1-8b", "h200-sxm", 1, 128, 128, 27911, 4000),
    ("llama-3.1-8b", "h200-sxm", 1, 128, 2048, 26221, 1500),
    ("llama-3.1-8b", "h200-sxm", 1, 2048, 128, 3538, 1500),
    ("llama-3.1-8b", "h200-sxm", 1, 1000, 1000, 17744, 1500),
    ("llama-3.3-70b", "h200-sxm", 1, 128, 2048, 4336, 600),
    ("llama-3.3-70b", "h200-sxm", 1, 2048, 128, 442, 600),
    ("llama-3.3-70b", "h200-sxm", 1, 1000, 1000, 2909, 600),
    ("llama-3.3-70b", "h100-sxm", 2, 128, 2048, 6651, 600),
    ("llama-3.3-70b", "h100-sxm", 2, 2048, 128, 762, 600),
    ("llama-3.3-70b", "h100-sxm", 2, 1000, 1000, 4205, 600),
]


def simulate(
    config: pathlib.Path, hardware: str, tp: int, n_in: int, n_out: int, num: int, kv_cache_dtype: str = "auto"
) -> float:
    from pagedserve.entrypoints.cli import build_parser
    from pagedserve.simulate.cli import _simulate
    from pagedserve.simulate.setup import build_plan

    argv = [
        "simulate",
        "--model",
        str(config),
        "--hardware",
        hardware,
        "--quantization",
        "fp8",
        "--tensor-parallel-size",
        str(tp),
        "--num-prompts",
        str(num),
        "--input-len",
        str(n_in),
        "--output-len",
        str(n_out),
        "--max-num-seqs",
        "1024",
        "--max-num-batched-tokens",
        "8192",
        "--max-model-len",
        "8192",
        "--gpu-memory-utilization",
        "0.92",
        "--kv-cache-dtype",
        kv_cache_dtype,
        # vLLM's fp8 KV cache: one scale per layer, 1 byte per value (pagedserve's default
        # keeps a scale per row).
        "--kv-cache-scales",
        "tensor" if kv_cache_dtype != "auto" else "auto",
    ]
    args = build_parser(argv).parse_args(argv)
    return _simulate(build_plan(args), args)[1]["tokens_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    p.add_argument("--scale", type=float, default=1.0, help="fraction of the request counts to simulate")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp())
    configs = {}
    for name, cfg in (("llama-3.1-8b", LLAMA_8B), ("llama-3.3-70b", LLAMA_70B)):
        configs[name] = tmp / f"{name}.json"
        configs[name].write_text(json.dumps(cfg))
    rows = []
    print(f"{'model':14} {'hardware':9} {'tp':>2} {'in/out':>10} {'published':>10} {'predicted':>10} {'ratio':>6}")
    for model, hw, tp, n_in, n_out, published, num in CASES:
        pred = simulate(configs[model], hw, tp, n_in, n_out, max(50, int(num * args.scale)), args.kv_cache_dtype)
        rows.append(
            {
                "model": model,
                "hardware": hw,
                "tp": tp,
                "input_len": n_in,
                "output_len": n_out,
                "published_tokens_per_s": published,
                "predicted_tokens_per_s": pred,
            }
        )
        print(
            f"{model:14} {hw:9} {tp:>2} {f'{n_in}/{n_out}':>10} {published:>10,} {pred:>10,.0f} {pred / published:6.2f}"
        )
    print(f"source: {SOURCE}")
    if args.json_out:
        pathlib.Path(args.json_out).write_text(
            json.dumps({"source": SOURCE, "kv_cache_dtype": args.kv_cache_dtype, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
