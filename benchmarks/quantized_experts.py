"""Tokens/s and weight bytes of a small random Qwen3-MoE with float experts (``fused_moe``)
against the same model quantized at load (quantized experts through
``pagedserve.models.quantized_experts``), through pagedserve's LLM in one process.

    python benchmarks/quantized_experts.py [--methods none,int8 --num-requests 8
                                            --output-len 32 --dtype bfloat16]

Shapes and other flags as benchmarks/moe_vs_dense.py (random weights: speed only).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from moe_vs_dense import build  # noqa: E402


def run(path: Path, method: str, args: argparse.Namespace) -> dict:
    from pagedserve import LLM, SamplingParams

    llm = LLM(model=str(path), dtype=args.dtype, kv_cache_memory="256MiB", quantization=method)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 259, (args.input_len,), generator=gen).tolist() for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "weight_mib": round(llm.llm_engine.runner.model.weight_bytes() / 2**20, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="none,int8", help="comma-separated quantization values")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-inter", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp) / "moe", "moe", args)
        for method in args.methods.split(","):
            results[method] = run(path, method, args)
            print(method, json.dumps(results[method]), flush=True)
    print(json.dumps({"config": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
