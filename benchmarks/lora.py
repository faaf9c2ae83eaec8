"""Multi-LoRA throughput: a batch of 32 requests with 0, 1, 4 and 16 distinct adapters
against the base model alone, and adapter load time.

    python benchmarks/lora.py [--model PATH] [--rank 16] [--batch 32] [--max-tokens 32] [--reps 2]

Random PEFT-format adapters of rank ``--rank`` on every linear (q/k/v/o, gate/up/down)
are written to a temporary folder.  "base alone" is an engine without --enable-lora;
the others are one engine with ``max_loras=16`` serving the batch with its requests
spread round-robin over N adapters (N=0: the LoRA engine, no request with an adapter).
Tokens/s is generated tokens over wall time of the whole batch (best of ``--reps``),
prefill included.  Prints a markdown table and `uptime` (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.lora import LoRARequest, load_adapter
from pagedserve.lora.adapter import TARGET_MODULES, module_shapes


def write_random_adapter(path: Path, arch, rank: int, seed: int) -> Path:
    """A PEFT-format adapter on every targetable linear, A and B random."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES)})
    )
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for name, (fan_in, fan_out) in module_shapes(arch).items():
            pre = f"base_model.model.model.layers.{layer}.{TARGET_MODULES[name]}.{name}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
            tensors[f"{pre}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def run_batch(llm: LLM, prompts: list[list[int]], loras: list, max_tokens: int, reps: int) -> float:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # Warm-up: kernels compiled or first-touched, adapters read and put in slots.
    llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False, lora_request=loras
    )
    best = 0.0
    for _ in range(reps):
        start = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=loras)
        elapsed = time.perf_counter() - start
        best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--counts", default="0,1,4,16")
    args = ap.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    common = dict(model=args.model, kv_cache_memory="512MiB", max_model_len=512)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 5000, (args.prompt_len,), generator=gen).tolist() for _ in range(args.batch)]

    base = LLM(**common)
    rows = [("base alone (no --enable-lora)", run_batch(base, prompts, None, args.max_tokens, args.reps))]
    arch = base.llm_engine.arch
    del base
    llm = LLM(**common, enable_lora=True, max_loras=max(counts + [1]), max_lora_rank=args.rank)
    with tempfile.TemporaryDirectory() as tmp:
        paths = [write_random_adapter(Path(tmp) / f"a{i}", arch, args.rank, i) for i in range(max(counts + [1]))]
        start = time.perf_counter()
        for p in paths:
            load_adapter(p, arch, args.rank)
        load_ms = (time.perf_counter() - start) / len(paths) * 1e3
        reqs = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        for n in counts:
            loras = [reqs[i % n] if n else None for i in range(args.batch)]
            rows.append(
                (
                    f"{n} distinct adapters (rank {args.rank})",
                    run_batch(llm, prompts, loras, args.max_tokens, args.reps),
                )
            )
        manager = llm.llm_engine.lora
        start = time.perf_counter()
        manager._write_slot(0, manager.add_adapter(reqs[0]))
        slot_ms = (time.perf_counter() - start) * 1e3
    base_tps = rows[0][1]
    print(
        f"\nbatch {args.batch}, prompts {args.prompt_len} tokens, {args.max_tokens} generated each, "
        f"best of {args.reps}\n"
    )
    print("| batch | tokens/s | vs base alone |\n|---|---|---|")
    for name, tps in rows:
        print(f"| {name} | {tps:.1f} | {100 * (tps / base_tps - 1):+.1f}% |")
    print(
        f"\nadapter load (read + check, disk -> host): {load_ms:.1f} ms; host -> device slot: {slot_ms:.1f} ms; "
        f"slot memory: {manager.slot_bytes() / 2**20:.1f} MiB for {manager.max_loras} slots"
    )
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
