"""Offline throughput: N prompts x M output tokens, with transformers' static-batching
``generate`` measured in the same run as the baseline.

Prints a human-readable summary and one JSON line (prefixed ``RESULT ``).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from pagedserve.entrypoints.engine_args import add_engine_arguments, default_kv_budget

__all__ = ["add_arguments", "run", "make_workload", "run_pagedserve", "run_transformers"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="model (default: smollm2-135m-instruct)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--mixed", action="store_true", help="seeded prompt lengths 16-1024 and outputs 16-512 instead of fixed lengths"
    )
    p.add_argument("--seed", type=int, default=0)
    # --seed above seeds the workload; the engine's own stays at its default.
    add_engine_arguments(p, exclude=["seed"])
    p.add_argument("--baseline", choices=["transformers", "none"], default="transformers")
    p.add_argument(
        "--hf-batch-size", type=int, default=None, help="transformers batch size (default: all prompts at once)"
    )
    p.add_argument("--json-out", default=None, help="also write the JSON result to this file")


def make_workload(
    num: int, input_len: int, output_len: int, mixed: bool, seed: int, vocab: int
) -> list[tuple[list[int], int]]:
    """Seeded (prompt token ids, output length) pairs; ids avoid the first 100 (specials)."""
    rng = random.Random(seed)
    work = []
    for _ in range(num):
        n_in = rng.randint(16, 1024) if mixed else input_len
        n_out = rng.randint(16, 512) if mixed else output_len
        work.append(([rng.randrange(100, vocab) for _ in range(n_in)], n_out))
    return work


def run_pagedserve(args: argparse.Namespace, work) -> dict:
    from pagedserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM.from_args(args, **default_kv_budget(args, "4GiB"))
    load_s = time.perf_counter() - t0
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    # Warm up (first-call allocations, kernel loading) outside the timed region.
    llm.generate([work[0][0][:16]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - c0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "engine": "pagedserve",
        "elapsed_s": elapsed,
        # The process's CPU seconds over the same span (every thread): on a shared machine
        # the steadier figure of the two.
        "cpu_s": cpu,
        "generated_tokens": gen,
        "tokens_per_s": gen / elapsed,
        "load_s": load_s,
        "dtype": str(llm.llm_engine.dtype).replace("torch.", ""),
        "platform": llm.llm_engine.platform.name,
        "block_size": llm.llm_engine.config.cache.block_size,
        "device_map": args.device_map,
        "preemptions": llm.llm_engine.scheduler.num_preemptions,
    }


def run_transformers(args: argparse.Namespace, work, model_path, fmt: str) -> dict:
    import torch
    import transformers

    dtype = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float32": torch.float32}.get(
        args.dtype, torch.float32
    )
    kwargs = {"torch_dtype": dtype}
    if fmt == "gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_path.parent), gguf_file=model_path.name, **kwargs
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_path), **kwargs)
    model.eval()
    bs = args.hf_batch_size or len(work)
    t0 = time.perf_counter()
    gen = 0
    with torch.inference_mode():
        for i in range(0, len(work), bs):
            chunk = work[i : i + bs]
            max_in = max(len(p) for p, _ in chunk)
            max_out = max(n for _, n in chunk)
            ids = torch.zeros((len(chunk), max_in), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, (p, _) in enumerate(chunk):  # left padding
                ids[j, max_in - len(p) :] = torch.tensor(p)
                mask[j, max_in - len(p) :] = 1
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_out,
                min_new_tokens=max_out,
                do_sample=False,
                pad_token_id=0,
            )
            # Static batching: every row runs max_out steps, only its own n are useful.
            gen += sum(n for _, n in chunk)
    elapsed = time.perf_counter() - t0
    return {
        "engine": "transformers",
        "elapsed_s": elapsed,
        "generated_tokens": gen,
        "tokens_per_s": gen / elapsed,
        "batch_size": bs,
    }


def run(args: argparse.Namespace) -> int:
    from pagedserve.loader import open_model

    source = open_model(args.model)
    vocab = source.hf_config["vocab_size"]
    work = make_workload(args.num_prompts, args.input_len, args.output_len, args.mixed, args.seed, vocab)
    ours = run_pagedserve(args, work)
    print(
        f"pagedserve:   {ours['tokens_per_s']:8.1f} tokens/s ({ours['generated_tokens']} tokens in "
        f"{ours['elapsed_s']:.1f} s, {ours['cpu_s']:.1f} CPU s; load {ours['load_s']:.1f} s)"
    )
    result = {
        "workload": {
            "num_prompts": args.num_prompts,
            "mixed": args.mixed,
            "input_len": None if args.mixed else args.input_len,
            "output_len": None if args.mixed else args.output_len,
            "seed": args.seed,
        },
        "model": args.model or "smollm2-135m-instruct",
        "pagedserve": ours,
    }
    if args.baseline == "transformers":
        base = run_transformers(args, work, source.path, source.format)
        result["transformers"] = base
        result["speedup_vs_transformers"] = ours["tokens_per_s"] / base["tokens_per_s"]
        print(f"transformers: {base['tokens_per_s']:8.1f} tokens/s (static batching, batch {base['batch_size']})")
        print(f"speedup:      {result['speedup_vs_transformers']:.2f}x")
    line = json.dumps(result)
    print("RESULT " + line)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    return 0
