"""async_scheduling on and off, same process, interleaved runs of one workload.

    python benchmarks/async_scheduling.py --workload fixed --num-requests 64 --output-len 32 --rounds 2
    python benchmarks/async_scheduling.py --workload mixed --num-requests 16 --max-output 64

Builds two engines over the bf16 benchmark folder (benchmarks/README.md) with the
settings of compare_vllm.py, one with ``async_scheduling``, and runs the same
token-id workload (benchmarks/workloads.py, greedy, EOS ignored) through each in turn,
alternating which goes first each round so that load drifting on a shared machine
hits both alike.  ``--gguf`` builds both over the default model's GGUF file instead
(the default path, dtype auto).  Prints output tokens/s of every run, the async/sync ratio of each
round and the load average, and checks that both engines produced the same tokens.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from workloads import WORKLOADS, default_gguf_path, make_workload  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="fixed", choices=WORKLOADS)
    p.add_argument(
        "--model-dir",
        default=str(pathlib.Path.home() / ".cache/pagedserve-bench/SmolLM2-135M-Instruct-bf16"),
        help="bf16 checkpoint folder (benchmarks/README.md makes it)",
    )
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None, help="output length (not for mixed)")
    p.add_argument("--max-output", type=int, default=None, help="cap every request's output length")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--build-async-first", action="store_true", help="build the async engine first (rules out placement effects)"
    )
    p.add_argument(
        "--gguf", action="store_true", help="the default model's GGUF file (dtype auto) instead of --model-dir"
    )
    args = p.parse_args(argv)

    from pagedserve import LLM, SamplingParams

    kw = dict(
        model=str(default_gguf_path()) if args.gguf else args.model_dir,
        dtype="auto" if args.gguf else "bfloat16",
        threads=args.threads,
        max_model_len=2048,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        kv_cache_memory="2GiB",
        seed=args.seed,
    )
    if args.build_async_first:
        engines = {"async": LLM(async_scheduling=True, **kw)}
        engines["sync"] = LLM(**kw)
    else:
        engines = {"sync": LLM(**kw), "async": LLM(async_scheduling=True, **kw)}
    vocab = engines["sync"].llm_engine.runner.arch.vocab_size
    w = make_workload(args.workload, vocab, args.seed, args.num_requests, None, args.output_len)
    prompts = [r.prompt_token_ids for r in w.requests]
    cap = args.max_output or 1 << 30
    params = [SamplingParams(temperature=0.0, max_tokens=min(r.max_tokens, cap), ignore_eos=True) for r in w.requests]
    for llm in engines.values():  # warm-up: first-call costs out of the timed runs
        llm.generate([prompts[0]], SamplingParams(max_tokens=4), use_tqdm=False)
    print(f"{args.workload}: {len(prompts)} requests, {sum(s.max_tokens for s in params)} output tokens")
    tokens: dict[str, list[list[int]]] = {}
    for rnd in range(args.rounds):
        order = ["sync", "async"] if rnd % 2 == 0 else ["async", "sync"]
        rate = {}
        for name in order:
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            outs = engines[name].generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            got = [o.outputs[0].token_ids for o in outs]
            if tokens.setdefault(name, got) != got:
                print(f"  {name}: outputs differ from its own first run")
            rate[name] = sum(map(len, got)) / wall
            print(f"  round {rnd} {name:5s}: {rate[name]:7.1f} tok/s ({wall:.1f} s, load {load:.1f} at start)")
        print(f"  round {rnd} async/sync: {rate['async'] / rate['sync']:.3f}")
    same = tokens["sync"] == tokens["async"]
    print(f"outputs identical in both modes: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
