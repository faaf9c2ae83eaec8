"""`pagedserve generate`: generate text for one or more prompts offline."""

from __future__ import annotations

import argparse
import json
import time

from pagedserve.entrypoints.engine_args import add_engine_arguments, default_kv_budget

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text offline")
    p.add_argument("model", nargs="?", default=None, help="model (default: smollm2-135m-instruct)")
    p.add_argument("-p", "--prompt", action="append", help="prompt (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    # --seed above is the sampling seed; the engine's own stays at its default.
    add_engine_arguments(p, exclude=["seed"])
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def run(args: argparse.Namespace) -> int:
    from pagedserve import LLM, SamplingParams
    from pagedserve.platforms import PlatformError

    t0 = time.perf_counter()
    try:
        llm = LLM.from_args(args, **default_kv_budget(args, "1GiB"))
    except (ValueError, PlatformError) as e:  # a bad setting: say which, without a traceback
        raise SystemExit(f"pagedserve generate: {e}") from None
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    prompts = args.prompt or ["What is the capital of France?"]
    if args.chat or not args.prompt:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        if args.json:
            print(
                json.dumps(
                    {"prompt": prompt, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                )
            )
        else:
            print(f"### {prompt}\n{c.text}\n")
    if not args.json:
        print(f"({elapsed:.1f} s including start-up)")
    return 0
