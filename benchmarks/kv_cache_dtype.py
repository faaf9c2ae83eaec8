"""8-bit KV caches against the model-dtype cache on the default model (docs/memory.md).

Reports, for kv_cache_dtype auto and each of --dtypes (fp8_e4m3, fp8_e5m2, int8) in one
process (a dtype may name its fp8 scales: ``fp8_e4m3@tensor`` is the per-layer scale 1.0
of vLLM's fp8 cache, ``fp8_e4m3`` alone rows with their computed scales):
  * KV blocks at a fixed kv_cache_memory;
  * greedy agreement with the auto cache on 16 prompts (identical continuations, tokens
    before the first difference, positions equal), and over the prompts' own tokens the
    top-1 agreement and the largest per-position KL divergence of the next-token
    distributions (teacher-forced, so one early difference does not hide the rest);
  * decode throughput at a batch of --batch sequences over --context-token prompts, and
    with --mixed a mixed workload (prompts of 32-512 tokens arriving while others
    decode, chunked prefill): prompt + output tokens per second.

    python benchmarks/kv_cache_dtype.py [--batch 64 --context 192 --decode 16] [--dtypes int8]
    python benchmarks/kv_cache_dtype.py --rounds 5 --throughput auto,int8   # decode rates only, A B A B ...
    python benchmarks/kv_cache_dtype.py --rounds 3 --mixed --throughput auto,fp8_e4m3,fp8_e4m3@tensor,int8
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n",
    "The theory of relativity states that",
    "Here is a recipe for pancakes:",
    "import numpy as np\n\ndef normalize(x):",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    "The three laws of thermodynamics are",
    "In 1492, Columbus",
    "SELECT name, age FROM users WHERE",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "Photosynthesis is the process by which",
    "The quick brown fox",
    "To install the package, run",
    "<|im_start|>user\nExplain what a linked list is.<|im_end|>\n<|im_start|>assistant\n",
]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def decode_throughput(llm: LLM, args) -> float:
    """Decode tokens/s of a batch of ``args.batch`` sequences over ``args.context``-token
    random prompts: the steps after every sequence has its first token, timed alone."""
    engine = llm.llm_engine
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=1 + args.decode, ignore_eos=True)
    for i in range(args.batch):
        ids = torch.randint(100, 40000, (args.context,), generator=gen).tolist()
        engine.add_request(f"tp{i}", None, params, prompt_token_ids=ids)
    started: set[str] = set()
    while len(started) < args.batch:  # prefill (and the first decodes of early finishers)
        started.update(o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids)
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - t0
    # The whole batch prefills in one step (the budget holds it), so each timed step is a
    # decode of every sequence.
    assert steps == args.decode, f"{steps} decode steps, expected {args.decode}"
    return round(args.batch * steps / elapsed, 1)


def mixed_throughput(llm: LLM, args) -> float:
    """Prompt + output tokens/s of --mixed-requests requests with prompts of 32-512 random tokens
    and 8-48 output tokens, at most 16 running and a 512-token step budget, so that most
    steps carry prefill chunks beside decodes."""
    engine = llm.llm_engine
    gen = torch.Generator().manual_seed(1)
    total = 0
    for i in range(args.mixed_requests):
        n = int(torch.randint(32, 513, (1,), generator=gen))
        out = int(torch.randint(8, 49, (1,), generator=gen))
        ids = torch.randint(100, 40000, (n,), generator=gen).tolist()
        engine.add_request(f"mx{i}", None, SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True),
                           prompt_token_ids=ids)  # fmt: skip
        total += n + out
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return round(total / (time.perf_counter() - t0), 1)


def make_llm(spec: str, args, mixed: bool = False) -> LLM:
    """``spec``: a kv_cache_dtype, optionally ``@`` its kv_cache_scales (``fp8_e4m3@tensor``)."""
    cd, _, scales = spec.partition("@")
    budget = dict(max_num_seqs=16, max_num_batched_tokens=512) if mixed else dict(
        max_num_batched_tokens=max(2048, args.batch * args.context))  # fmt: skip
    return LLM(
        None,
        dtype="bfloat16",
        kv_cache_dtype=cd,
        kv_cache_scales=scales or "auto",
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=1024,
        **budget,
    )


def interleaved_throughput(args) -> None:
    """Decode tok/s (and with --mixed the mixed workload's tok/s) of each --throughput
    dtype, the engines held together and measured in turn (A B C A B C ...) for --rounds
    rounds; the median of each, and the median of the per-round ratios to the first dtype
    (a loaded machine's drift hits both sides)."""
    names = args.throughput
    kinds = {"decode": (decode_throughput, False)}
    if args.mixed:
        kinds["mixed"] = (mixed_throughput, True)
    llms = {(cd, kind): make_llm(cd, args, mixed) for cd in names for kind, (_, mixed) in kinds.items()}
    rates: dict[tuple[str, str], list[float]] = {key: [] for key in llms}
    for r in range(args.rounds):
        for kind, (measure, _) in kinds.items():
            for cd in names:
                rates[cd, kind].append(measure(llms[cd, kind], args))
            print(f"round {r + 1} {kind}: " + ", ".join(f"{cd} {rates[cd, kind][-1]}" for cd in names), flush=True)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    base = names[0]
    for kind in kinds:
        for cd in names:
            ratios = [a / b for a, b in zip(rates[cd, kind], rates[base, kind])]
            print(f"{kind} {cd}: median {med(rates[cd, kind])} tok/s; per-round ratio to {base} median "
                  f"{med(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})", flush=True)  # fmt: skip
    for llm in llms.values():
        llm.shutdown()


def run(cd: str, args) -> dict:
    llm = make_llm(cd, args)
    blocks = llm.llm_engine.executor.num_blocks
    greedy = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)
    toks = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    if args.forced is None:  # the first (auto) run: teacher-force its continuations
        args.forced = [llm.get_tokenizer().encode(s) + t for s, t in zip(PROMPTS, toks)]
    rows_params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=-1)
    outs = llm.generate([{"prompt_token_ids": p} for p in args.forced], rows_params, use_tqdm=False)
    rows = [o.prompt_logprob_rows for o in outs]
    decode_tok_s = decode_throughput(llm, args) if cd in args.throughput else None
    llm.shutdown()
    return dict(blocks=blocks, toks=toks, rows=rows, decode_tok_s=decode_tok_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=192)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--dtypes", default="fp8_e4m3,fp8_e5m2,int8", help="quantized cache dtypes compared with auto")
    p.add_argument("--throughput", default="auto,fp8_e4m3,int8", help="cache dtypes whose decode rate is measured")
    p.add_argument("--rounds", type=int, default=0, help="only the decode rates, interleaved over this many rounds")
    p.add_argument("--mixed", action="store_true", help="with --rounds: also the mixed workload's rates")
    p.add_argument("--mixed-requests", type=int, default=32, help="requests of the mixed workload")
    args = p.parse_args()
    args.forced = None
    args.throughput = args.throughput.split(",")
    if args.rounds:
        interleaved_throughput(args)
        return
    base = run("auto", args)
    print(f"auto: {base['blocks']} blocks at {args.kv_cache_memory}; decode {base['decode_tok_s']} tok/s "
          f"(batch {args.batch}, {args.context}-token prompts, {args.decode} steps)", flush=True)  # fmt: skip
    for cd in args.dtypes.split(","):
        r = run(cd, args)
        same = sum(a == b for a, b in zip(base["toks"], r["toks"]))
        firsts = [first_difference(a, b) for a, b in zip(base["toks"], r["toks"])]
        pos = sum(x == y for a, b in zip(base["toks"], r["toks"]) for x, y in zip(a, b))
        total = sum(len(a) for a in base["toks"])
        top1 = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(base["rows"], r["rows"]))
        n = sum(a.shape[0] for a in base["rows"])
        kl = [torch.nn.functional.kl_div(b, a, log_target=True, reduction="none").sum(-1)
              for a, b in zip(base["rows"], r["rows"])]  # fmt: skip
        kl_all = torch.cat(kl)
        print(
            f"{cd}: {r['blocks']} blocks ({r['blocks'] / base['blocks']:.2f}x); greedy identical {same}/16, "
            f"first difference at token {sorted(firsts)} (median {sorted(firsts)[8]}), positions equal "
            f"{pos}/{total}; teacher-forced top-1 {top1}/{n} = {top1 / n:.3f}, KL mean {kl_all.mean():.4f} "
            f"max {kl_all.max():.3f}; decode {r['decode_tok_s']} tok/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
