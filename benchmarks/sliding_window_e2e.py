"""Tokens/s of a tiny random Gemma 2 (every other layer a sliding window, attention
soft-cap) through ``LLM`` on the CPU, with its windowed and soft-capped layers on the
native attention kernel ("after") and on the torch reference ("before": what the CPU
platform ran for such layers until the native kernel took them).  One process, one
engine, the two modes alternating, so a busy machine slows both alike.

    python benchmarks/sliding_window_e2e.py [--prompts 8] [--prompt-len 768]
                                            [--max-tokens 64] [--window 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.kernels import reference
from pagedserve.testing.tiny_model import write_byte_tokenizer


def build_gemma2(path: Path, window: int) -> None:
    """A random Gemma 2 with head size 64 (a native kernel size), GQA 2:1, 4 layers."""
    import transformers

    write_byte_tokenizer(path)
    config = transformers.Gemma2Config(
        vocab_size=259,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        sliding_window=window,
        query_pre_attn_scalar=64,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.Gemma2ForCausalLM(config).to(torch.float32).save_pretrained(path, safe_serialization=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=768)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        build_gemma2(Path(tmp), args.window)
        llm = LLM(model=tmp, dtype="float32", enable_prefix_caching=False)
    ops = llm.llm_engine.ops
    native = ops.get("paged_attention")
    print(f"# paged_attention from {ops.source('paged_attention')}, {torch.get_num_threads()} threads")
    before = {"on": False}

    def switch(*a, sliding_window=None, soft_cap=None, **k):
        fn = reference.paged_attention if before["on"] and (sliding_window or soft_cap) else native
        return fn(*a, sliding_window=sliding_window, soft_cap=soft_cap, **k)

    ops.register("paged_attention", switch, source=ops.source("paged_attention"))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 259, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    rates: dict[str, list[float]] = {"before (reference)": [], "after (native)": []}
    texts = {}
    for _ in range(args.rounds):
        for label in rates:
            before["on"] = label.startswith("before")
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            secs = time.perf_counter() - start
            rates[label].append(len(prompts) * (args.prompt_len + args.max_tokens) / secs)
            texts[label] = [o.outputs[0].token_ids for o in outs]
    same = texts["before (reference)"] == texts["after (native)"]
    print(
        f"{args.prompts} prompts x {args.prompt_len} tokens + {args.max_tokens} new, window {args.window}, "
        f"soft-cap 50; tokens/s (prompt + generated, median of {args.rounds}); same greedy tokens: {same}"
    )
    for label, r in rates.items():
        print(f"  {label:<20} {statistics.median(r):8.1f} tokens/s  (runs: {', '.join(f'{x:.0f}' for x in r)})")


if __name__ == "__main__":
    main()
