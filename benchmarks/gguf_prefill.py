"""Prefill speed of the default GGUF path with the gated MLP fused or not, interleaved.

    python benchmarks/gguf_prefill.py [--threads 2] [--reps 5] [--prompt-len 1024]
        [--mixed-requests 16] [--mixed-reps 2]

One engine on the default model's own GGUF file (the default path: Q4_1 blocks kept,
linear weights repacked for the tiled int8 GEMM).  Two modes alternate in the same
process, so they see the same machine load: "fused", the default (each MLP's [gate; up]
weight runs ``gguf_linear_silu_and_mul``), and "unfused" (``gguf_linear``, then the
registry's ``silu_and_mul``, as before that op).  Measured per mode:

- prefill of one ``--prompt-len``-token prompt (``max_tokens=1``: the prefill step and a
  one-row LM head), a fresh random prompt every repetition (no prefix-cache hits),
  ``--reps`` times; reported as prompt tokens/s (median) and the median of the per-pair
  time ratios unfused / fused;
- the mixed workload of benchmarks/workloads.py (``--mixed-requests`` of its requests,
  16-1024 prompt tokens, 16-512 output tokens, greedy, ``ignore_eos``), ``--mixed-reps``
  times per mode: the whole ``generate`` wall time, output tokens/s, and the time spent
  in prefill steps (any request in its prompt), from which prompt tokens/s of those steps.

The load average (``os.getloadavg``) is printed before and after: other processes on
the machine change the absolute figures, the interleaved ratios much less.  Both modes
give the same tokens (tests/quantization/test_quant_gguf_gated.py); the script checks
the mixed workload's outputs agree between modes.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from workloads import default_gguf_path, make_workload  # noqa: E402

MODES = ("fused", "unfused")


def set_mode(model, gated: dict[int, object], mode: str) -> None:
    """Give each [gate; up] GGUF weight its fused op back (fused) or none (unfused)."""
    for i, layer in enumerate(model.layers):
        layer.gate_up.gated_op = gated[i] if mode == "fused" else None


def time_prefill_steps(runner_cls) -> list[float]:
    """Patch the model runner so that each step with a prompt chunk adds its wall time
    to the returned list (the list is cleared by the caller)."""
    spent: list[float] = []
    execute = runner_cls.execute

    def timed(self, out, block_ids):
        t0 = time.perf_counter()
        try:
            return execute(self, out, block_ids)
        finally:
            if any(s.num_new_tokens > 1 for s in out.scheduled):
                spent.append(time.perf_counter() - t0)

    runner_cls.execute = timed
    return spent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--reps", type=int, default=5, help="prefills of one long prompt per mode")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--mixed-requests", type=int, default=16, help="requests of the mixed workload (0: skip)")
    p.add_argument("--mixed-reps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from pagedserve import LLM, SamplingParams
    from pagedserve.executor import model_runner
    from pagedserve.quantization import GGUFWeight

    print(f"load average before: {os.getloadavg()}")
    llm = LLM(
        model=str(default_gguf_path()),
        threads=args.threads,
        max_model_len=2048,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        kv_cache_memory="4GiB",
        enable_prefix_caching=False,
        seed=args.seed,
    )
    engine = llm.llm_engine
    model = engine.runner.model
    if not all(isinstance(layer.gate_up, GGUFWeight) for layer in model.layers):
        raise SystemExit("the default model did not load with GGUF blocks kept (quantization off?)")
    gated = {i: layer.gate_up.gated_op for i, layer in enumerate(model.layers)}
    print(f"gguf_linear_silu_and_mul: {engine.ops.source('gguf_linear_silu_and_mul')}")
    vocab = engine.runner.arch.vocab_size
    rng = random.Random(args.seed)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def prefill_once() -> float:
        prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
        t0 = time.perf_counter()
        llm.generate([prompt], one, use_tqdm=False)
        return time.perf_counter() - t0

    for mode in MODES:  # warm-up: first-touch of buffers, thread start
        set_mode(model, gated, mode)
        prefill_once()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for rep in range(args.reps):
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            set_mode(model, gated, mode)
            times[mode].append(prefill_once())
    ratios = [u / f for u, f in zip(times["unfused"], times["fused"], strict=True)]
    print(f"\none {args.prompt_len}-token prefill, {args.reps} reps per mode, interleaved:")
    print("| mode | median s | prompt tok/s | all s |")
    print("|---|---:|---:|---|")
    for mode in MODES:
        med = statistics.median(times[mode])
        print(f"| {mode} | {med:.3f} | {args.prompt_len / med:.0f} | {', '.join(f'{t:.3f}' for t in times[mode])} |")
    print(
        f"unfused / fused time: median {statistics.median(ratios):.3f} "
        f"(per pair {', '.join(f'{r:.3f}' for r in ratios)})"
    )

    if args.mixed_requests:
        w = make_workload("mixed", vocab, args.seed, args.mixed_requests)
        prompts = [r.prompt_token_ids for r in w.requests]
        params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in w.requests]
        prompt_tokens = sum(len(q) for q in prompts)
        spent = time_prefill_steps(model_runner.ModelRunner)
        rows: dict[str, list[tuple[float, int, float]]] = {m: [] for m in MODES}
        outputs: dict[str, list[list[int]]] = {}
        for rep in range(args.mixed_reps):
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                set_mode(model, gated, mode)
                spent.clear()
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                wall = time.perf_counter() - t0
                tokens = [list(o.outputs[0].token_ids) for o in outs]
                outputs.setdefault(mode, tokens)
                rows[mode].append((wall, sum(len(t) for t in tokens), sum(spent)))
        same = outputs["fused"] == outputs["unfused"]
        print(f"\nmixed workload, {args.mixed_requests} requests ({prompt_tokens} prompt tokens), interleaved:")
        print("| mode | wall s | output tok/s | prefill-step s | prompt tok/s in prefill steps |")
        print("|---|---|---|---|---|")
        for mode in MODES:
            walls = ", ".join(f"{r[0]:.2f}" for r in rows[mode])
            tps = ", ".join(f"{r[1] / r[0]:.1f}" for r in rows[mode])
            pre = ", ".join(f"{r[2]:.2f}" for r in rows[mode])
            ptps = ", ".join(f"{prompt_tokens / r[2]:.0f}" for r in rows[mode])
            print(f"| {mode} | {walls} | {tps} | {pre} | {ptps} |")
        print(f"outputs identical between modes: {same}")
    print(f"\nload average after: {os.getloadavg()}")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
