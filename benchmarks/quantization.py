"""Weight footprint and decode throughput of each quantization method on one model.

    python benchmarks/quantization.py [--model PATH] [--methods none,gguf,int8,w8a8,fp8]
                                      [--batches 1,4,8] [--tokens 8] [--dtype bfloat16]
    python benchmarks/quantization.py --kernels     # one matmul: bf16 vs GGUF blocks

"none" is the model dequantized to --dtype (bf16).  Decode tokens/s: ``batch`` requests
are prefilled in one engine step, then ``tokens`` decode steps are timed.  Prints a markdown
table (plus `uptime`, since the machine is shared).
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import time

from pagedserve import LLM, SamplingParams

PROMPT = "The history of the printing press begins"


def decode_tps(llm: LLM, batch: int, tokens: int) -> float:
    """Tokens/s of ``tokens`` decode steps of ``batch`` sequences (after their prefill step)."""
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=tokens + 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"bench-{batch}-{i}-{time.monotonic_ns()}", f"{PROMPT} ({i})", sp)
    engine.step()  # the prefill of all prompts (one step: they fit the token budget)
    engine.step()  # first decode step: warm-up
    start = time.perf_counter()
    for _ in range(tokens):
        engine.step()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return batch * tokens / elapsed


def kernels(batches: list[int]) -> None:
    """Milliseconds per matmul of the default model's shapes: bf16 vs the GGUF CPU kernel."""
    import torch

    from pagedserve.kernels.cpu.quant_native import load_quant_kernels
    from pagedserve.kernels.quant_reference import GGUF_BLOCK_BYTES

    module = load_quant_kernels()
    print(f"kernel ISA: {module.isa()}; threads {torch.get_num_threads()}")
    print("| N x K | M | bf16 ms | Q4_1 ms | Q8_0 ms |\n|---|---|---|---|---|")
    for n, k in ((3072, 576), (576, 1536), (49152, 576)):
        w = torch.randn(n, k).bfloat16()
        raw = {t: torch.randint(0, 256, (n, k // 32, GGUF_BLOCK_BYTES[t]), dtype=torch.uint8) for t in ("Q4_1", "Q8_0")}
        for t in raw:  # finite fp16 scales
            raw[t][..., 0:2] = torch.full((n, k // 32), 0.01).half().view(torch.uint8).reshape(n, k // 32, 2)
            raw[t] = raw[t].reshape(n, -1)
        for m in batches:
            x = torch.randn(m, k).bfloat16()

            def ms(f, reps: int = 20) -> float:
                f()
                start = time.perf_counter()
                for _ in range(reps):
                    f()
                return (time.perf_counter() - start) / reps * 1e3

            dense = ms(lambda: torch.nn.functional.linear(x, w))
            q41 = ms(lambda: module.gguf_linear(x, raw["Q4_1"], 3))
            q80 = ms(lambda: module.gguf_linear(x, raw["Q8_0"], 8))
            print(f"| {n} x {k} | {m} | {dense:.2f} | {q41:.2f} | {q80:.2f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--methods", default="none,gguf,int8,w8a8,fp8")
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kernels", action="store_true", help="time single matmuls instead of the engine")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    if args.kernels:
        kernels(batches + [64])
        return
    print("| method | weights MiB | " + " | ".join(f"decode tok/s b={b}" for b in batches) + " |")
    print("|---|---|" + "---|" * len(batches))
    for method in args.methods.split(","):
        llm = LLM(model=args.model, quantization=method, dtype=args.dtype, kv_cache_memory="64MiB", max_model_len=256)
        mib = llm.llm_engine.runner.model.weight_bytes() / 2**20
        tps = [decode_tps(llm, b, args.tokens) for b in batches]
        print(f"| {method} | {mib:.1f} | " + " | ".join(f"{t:.2f}" for t in tps) + " |", flush=True)
        llm.shutdown()
        del llm
        gc.collect()
    print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
