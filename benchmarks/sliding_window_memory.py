"""KV memory held by a long generation with a sliding window, with and without freeing
the blocks that slid out of it.

    python benchmarks/sliding_window_memory.py [--model mistral|gemma2] [--window 512]
        [--max-tokens 4096] [--requests 1] [--block-size 16]

A tiny random Mistral (transformers' MistralConfig, window on every layer, no download;
float32), or with ``--model gemma2`` a tiny random Gemma 2 (window and full attention
alternating over 4 layers: one block table per KV cache group, docs/memory.md) generates
``max-tokens`` tokens after a 32-token prompt, ``requests`` at once,
twice: with ``free_sliding_window_blocks`` off (every block of a request is held until it
ends) and on (blocks that slid out go back to the pool).  Reported per run: the peak of
KV blocks held (``kv.peak_blocks_in_use``), those bytes (blocks x bytes per block over all
layers), the most blocks one request held, and the wall time.  The tokens of both runs are
compared (they must be equal: freeing changes memory, not outputs).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.testing.tiny_model import write_byte_tokenizer


def build_mistral(path: Path, window: int, max_positions: int) -> None:
    import transformers

    write_byte_tokenizer(path)
    config = transformers.MistralConfig(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_positions,
        sliding_window=window,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.MistralForCausalLM(config).to(torch.float32).save_pretrained(path, safe_serialization=True)


def build_gemma2(path: Path, window: int, max_positions: int) -> None:
    import transformers

    write_byte_tokenizer(path)
    config = transformers.Gemma2Config(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_positions,
        sliding_window=window,
        query_pre_attn_scalar=16,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    transformers.Gemma2ForCausalLM(config).to(torch.float32).save_pretrained(path, safe_serialization=True)


def run(path: Path, args, free: bool) -> dict:
    max_model_len = args.prompt_len + args.max_tokens + 1
    llm = LLM(
        model=str(path),
        dtype="float32",
        block_size=args.block_size,
        max_model_len=max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=args.max_num_batched_tokens,
        free_sliding_window_blocks=free,
    )
    eng = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for i in range(args.requests):
        eng.add_request(f"r{i}", [rng.randrange(3, 259) for _ in range(args.prompt_len)], params)
    most_per_request, tokens = 0, {}
    start = time.perf_counter()
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        for r in eng.scheduler.running:
            most_per_request = max(most_per_request, eng.kv.num_blocks_held(r.request_id))
    elapsed = time.perf_counter() - start
    peak = eng.kv.peak_blocks_in_use
    assert eng.kv.num_blocks_in_use == 0
    return {
        "free": free,
        "peak_blocks": peak,
        "peak_bytes": peak * eng.runner.kv_block_bytes(args.block_size),
        "most_per_request": most_per_request,
        "pool_blocks": eng.kv.pool.num_blocks,
        "seconds": elapsed,
        "tokens": tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("mistral", "gemma2"), default="mistral")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", default="64MiB")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        build = build_gemma2 if args.model == "gemma2" else build_mistral
        build(path, args.window, max_positions=2 * (args.prompt_len + args.max_tokens + 1))
        results = [run(path, args, free) for free in (False, True)]
    if results[0]["tokens"] != results[1]["tokens"]:
        raise SystemExit("outputs differ between freeing off and on")
    print(
        f"tiny {'Gemma 2' if args.model == 'gemma2' else 'Mistral'}, window {args.window}, "
        f"{args.requests} x ({args.prompt_len} prompt + "
        f"{args.max_tokens} generated) tokens, block_size {args.block_size}, float32\n"
    )
    print("| slid-out blocks | peak KV blocks held | peak KV bytes held | most blocks one request held | wall s |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {'freed' if r['free'] else 'kept'} | {r['peak_blocks']} | {r['peak_bytes'] / 2**20:.2f} MiB | "
            f"{r['most_per_request']} | {r['seconds']:.1f} |"
        )
    ratio = results[0]["peak_bytes"] / results[1]["peak_bytes"]
    print(f"\npeak KV memory {ratio:.1f}x smaller with freeing; outputs identical")


if __name__ == "__main__":
    main()
