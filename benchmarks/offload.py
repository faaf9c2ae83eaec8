"""Host KV tier benchmark: a shared-prefix workload whose prefixes exceed the device pool.

    python benchmarks/offload.py                      # default model, bf16
    python benchmarks/offload.py --num-prefixes 6 --prefix-len 384 --uses 3

Requests arrive round-robin over the prefixes (p0, p1, ..., p0, p1, ...), so with a
device KV pool smaller than all the prefixes together each prefix has been evicted by
LRU before it is asked for again.  Without a host tier it is recomputed; with one it
spilled to host on eviction and is copied back.  Both engines run in the same process
on the same requests, alternately ``--repeat`` times, and the outputs are checked to be
identical.  Reported: output tokens/s, mean time to first token (from arrival; every
request arrives at the start), tokens computed by the model, tokens reloaded from host.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pagedserve import LLM, SamplingParams


def make_requests(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(100, vocab) for _ in range(args.prefix_len)] for _ in range(args.num_prefixes)]
    return [p + [rng.randrange(100, vocab) for _ in range(args.suffix_len)] for _ in range(args.uses) for p in prefixes]


def run_once(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    eng = llm.llm_engine
    kv = eng.kv
    computed0 = kv.num_scheduled_tokens
    reloaded0 = getattr(kv, "num_reloaded_tokens", 0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "seconds": elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "mean_ttft_s": statistics.fmean(ttft),
        "computed_tokens": kv.num_scheduled_tokens - computed0,
        "reloaded_tokens": getattr(kv, "num_reloaded_tokens", 0) - reloaded0,
        "token_ids": [o.outputs[0].token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prefixes", type=int, default=6)
    ap.add_argument("--prefix-len", type=int, default=384)
    ap.add_argument("--suffix-len", type=int, default=16)
    ap.add_argument("--uses", type=int, default=3, help="requests per prefix")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--kv-cache-memory", default="24MiB", help="device KV pool (small on purpose)")
    ap.add_argument("--kv-offload-memory", default="256MiB", help="host KV tier")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    common = dict(
        model=args.model,
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        threads=args.threads,
        max_model_len=args.prefix_len + args.suffix_len + args.output_len + 16,
    )
    engines = {"device-only": LLM(**common), "host-tier": LLM(**common, kv_offload_memory=args.kv_offload_memory)}
    vocab = engines["device-only"].llm_engine.arch.vocab_size
    prompts = make_requests(args, vocab)
    results: dict[str, list[dict]] = {k: [] for k in engines}
    for _ in range(args.repeat):
        for name, llm in engines.items():
            # A fresh prefix cache each time, so every repeat sees the same evictions.
            llm.llm_engine.kv.pool.reset_prefix_cache()
            host = getattr(llm.llm_engine.kv, "host", None)
            if host is not None:
                host.reset_prefix_cache()
            results[name].append(run_once(llm, prompts, args.output_len))
    if results["device-only"][0]["token_ids"] != results["host-tier"][0]["token_ids"]:
        raise SystemExit("outputs differ between the two engines")
    summary = {}
    for name, runs in results.items():
        summary[name] = {
            "output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in runs),
            "mean_ttft_s": statistics.median(r["mean_ttft_s"] for r in runs),
            "computed_tokens": runs[0]["computed_tokens"],
            "reloaded_tokens": runs[0]["reloaded_tokens"],
        }
    a, b = summary["device-only"], summary["host-tier"]
    summary["host-tier/device-only"] = {
        "throughput_ratio": b["output_tokens_per_s"] / a["output_tokens_per_s"],
        "ttft_ratio": b["mean_ttft_s"] / a["mean_ttft_s"],
    }
    summary["workload"] = {
        k: getattr(args, k)
        for k in (
            "num_prefixes",
            "prefix_len",
            "suffix_len",
            "uses",
            "output_len",
            "kv_cache_memory",
            "kv_offload_memory",
            "dtype",
            "max_num_seqs",
            "repeat",
        )
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
