"""Tokens/s of a small random Qwen3-MoE against dense Qwen3 models of the same shape,
through pagedserve's LLM in one process (random weights: speed only, no quality).

Dense models: one with the MoE's *active* MLP width (top_k * moe_intermediate_size:
the same FLOPs per token) and one with its *total* width (num_experts *
moe_intermediate_size: the same parameter count).

    python benchmarks/moe_vs_dense.py [--num-requests 16 --input-len 64 --output-len 64
                                       --experts 8 --top-k 2 --dtype bfloat16 --threads N]

On a loaded machine, --threads 1 keeps OpenMP barriers from waiting on descheduled
threads (the ratios then compare the kernels rather than the scheduler).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def build(path: Path, kind: str, args: argparse.Namespace) -> Path:
    import transformers

    from pagedserve.testing.tiny_model import write_byte_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    vocab = write_byte_tokenizer(path)
    common = dict(
        vocab_size=vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=args.hidden // 8,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "moe":
        config = transformers.Qwen3MoeConfig(
            **common,
            num_experts=args.experts,
            num_experts_per_tok=args.top_k,
            moe_intermediate_size=args.moe_inter,
            norm_topk_prob=True,
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        width = args.moe_inter * (args.top_k if kind == "dense-active" else args.experts)
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, intermediate_size=width))
    model.save_pretrained(path, safe_serialization=True)
    return path


def run(path: Path, args: argparse.Namespace, quantization: str | None = None) -> dict:
    """Tokens/s of one seeded batch (after a warm-up) and the model's weight bytes."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(model=str(path), dtype=args.dtype, kv_cache_memory="256MiB", quantization=quantization)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 259, (args.input_len,), generator=gen).tolist() for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    weights = llm.llm_engine.runner.model.weight_bytes()
    return {
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "weight_mib": round(weights / 2**20, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-inter", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("moe", "dense-active", "dense-total"):
            results[kind] = run(build(Path(tmp) / kind, kind, args), args)
            print(kind, json.dumps(results[kind]), flush=True)
    print(json.dumps({"config": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
