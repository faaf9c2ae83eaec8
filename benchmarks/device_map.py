"""The cost of a layer map: the same engine steps with and without ``--device-map``.

Two engines in one process (no map, and the given map) take the same step back to
back, so both see the same machine load; the ratio of their step times, over every
step of a few rounds of a batch, is the map's overhead.  Greedy tokens are compared.

    python benchmarks/device_map.py [--map cpu:15,cpu] [--num-prompts 8] [--input-len 64]
                                    [--output-len 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pagedserve import LLM, SamplingParams


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--map", default="cpu:15,cpu", help="the layer map to compare with no map")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-cache-memory", default="256MiB")
    args = ap.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49152) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    engines = [
        LLM(model=args.model, device_map=m, kv_cache_memory=args.kv_cache_memory).llm_engine for m in (None, args.map)
    ]
    ratios: list[float] = []
    totals = [0.0, 0.0]
    tokens: list[dict[str, list[int]]] = [{}, {}]
    for rnd in range(args.rounds):
        for e in engines:
            for i, p in enumerate(prompts):
                e.add_request(f"{rnd}-{i}", p, params)
        while engines[0].has_unfinished_requests():
            times = []
            for k, e in enumerate(engines):  # the same step on both engines, back to back
                t0 = time.perf_counter()
                for out in e.step():
                    if out.finished:
                        tokens[k][out.request_id] = list(out.outputs[0].token_ids)
                times.append(time.perf_counter() - t0)
                totals[k] += times[-1]
            ratios.append(times[1] / times[0])
    q = statistics.quantiles(ratios, n=4)
    n_tok = args.rounds * args.num_prompts * args.output_len
    print(
        f"{len(ratios)} paired steps; step time with --device-map {args.map} / without: median "
        f"{statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})"
    )
    print(
        f"output tokens/s: no map {n_tok / totals[0]:.1f}, with map {n_tok / totals[1]:.1f}; "
        f"greedy tokens identical: {tokens[0] == tokens[1]}"
    )


if __name__ == "__main__":
    main()
