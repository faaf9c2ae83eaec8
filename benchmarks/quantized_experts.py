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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from moe_vs_dense import build, run  # noqa: E402


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
            results[method] = run(path, args, method)
            print(method, json.dumps(results[method]), flush=True)
    print(json.dumps({"config": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
