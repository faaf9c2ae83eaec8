"""Rough figures for tensor/pipeline parallelism and disaggregated prefill/decode.

    python benchmarks/distributed.py parallel --tp 2          # TP=2 vs TP=1, same workload
    python benchmarks/distributed.py parallel --pp 2
    python benchmarks/distributed.py disagg                   # long prompts: 1 instance vs prefill+decode

The model is a random float32 Llama (hidden 1024, 16 heads / 8 KV heads, 8 layers,
intermediate 4096: ~120M parameters) made with the tests' checkpoint helper, unless
``--model`` names a checkpoint.  Prompts are random token ids; decoding is greedy with
EOS ignored, so every configuration generates the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def random_model(path: Path) -> Path:
    if not (path / "config.json").exists():
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import make_tiny_checkpoint

        make_tiny_checkpoint(
            path,
            hidden_size=1024,
            num_layers=8,
            num_heads=16,
            num_kv_heads=8,
            intermediate_size=4096,
            max_position_embeddings=4096,
        )
    return path


def workload(n: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(prompt_len)] for _ in range(n)]


def summarize(outs, start: float) -> dict:
    """Every request is submitted at ``start`` (time.monotonic): TTFT counts from there, so
    the disaggregated prefill's time is included (the decode side's arrival is later)."""
    elapsed = time.monotonic() - start
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = [o.metrics["first_token_time"] - start for o in outs]
    tpot = [
        (o.metrics["finished_time"] - o.metrics["first_token_time"]) / max(1, len(o.outputs[0].token_ids) - 1)
        for o in outs
    ]
    return {
        "elapsed_s": round(elapsed, 2),
        "output_tok_per_s": round(gen / elapsed, 1),
        "mean_ttft_s": round(sum(ttft) / len(ttft), 3),
        "mean_tpot_ms": round(1000 * sum(tpot) / len(tpot), 1),
    }


def run_llm(model: str, prompts, max_tokens: int, **kwargs) -> dict:
    from pagedserve import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", kv_cache_memory="1GiB", max_model_len=2048, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        start = time.monotonic()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return summarize(outs, start) | {"tokens": [o.outputs[0].token_ids for o in outs]}
    finally:
        llm.shutdown()


def run_disagg(model: str, prompts, max_tokens: int, threads: int) -> dict:
    from pagedserve import SamplingParams
    from pagedserve.serving.disagg import DisaggregatedLLM

    dllm = DisaggregatedLLM(
        model=model,
        prefill_threads=threads,
        threads=threads,
        dtype="float32",
        kv_cache_memory="1GiB",
        max_model_len=2048,
    )
    try:
        dllm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
        start = time.monotonic()
        outs = dllm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        return summarize(outs, start) | {"tokens": [o.outputs[0].token_ids for o in outs]}
    finally:
        dllm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["parallel", "disagg"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--backend", default="mp")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads of the single-rank baseline")
    args = ap.parse_args()
    model = args.model or str(random_model(Path("/tmp/pagedserve-bench-llama-120m")))
    results = {}
    if args.mode == "parallel":
        prompts = workload(args.num_prompts or 16, args.prompt_len or 64)
        results["single"] = run_llm(model, prompts, args.max_tokens, threads=args.threads)
        # Every rank, the driver included, gets its share of the cores (no oversubscription).
        results[f"tp{args.tp}-pp{args.pp}-{args.backend}"] = run_llm(
            model,
            prompts,
            args.max_tokens,
            tensor_parallel_size=args.tp,
            pipeline_parallel_size=args.pp,
            distributed_executor_backend=args.backend,
            threads=max(1, (os.cpu_count() or 1) // (args.tp * args.pp)),
        )
    else:
        prompts = workload(args.num_prompts or 8, args.prompt_len or 768)
        results["single"] = run_llm(model, prompts, args.max_tokens, threads=args.threads)
        results["disagg"] = run_disagg(model, prompts, args.max_tokens, threads=1)
    tokens = [r.pop("tokens") for r in results.values()]
    print(json.dumps(results, indent=1))
    print("greedy tokens identical:", all(t == tokens[0] for t in tokens))


if __name__ == "__main__":
    main()
