"""Speculative decoding on the default model: output tokens/s and time per output token
with and without each proposer, at several batch sizes, on two workloads.

    python benchmarks/spec_decode.py [--batches 1,4,16] [--max-tokens 48] [--rounds 3]
                                     [--k-ngram 4] [--k-self 3] [--threads N]

Workloads (chat-formatted prompts, greedy, EOS ignored so every run emits the same count):

    grounded   the answer copies from the prompt: repeat or lightly edit a given text,
               complete code that repeats itself (where n-gram lookup pays off)
    chat       open-ended questions (where it cannot; self-speculation may)

Configurations, each an engine built once and reused (for each workload and batch size,
runs alternate between them round by round, so that they are measured close in time and
the machine's load drifts evenly over all of them):

    q4           baseline: the GGUF blocks (the CPU default for the default model)
    q4+ngram     the same with n-gram lookup
    bf16         baseline: float weights (quantization none)
    bf16+ngram   the same with n-gram lookup
    bf16+selfq   float weights verified, the GGUF blocks drafting (self_quantized)

Every prompt of the workload runs in each measurement (at batch 1, one after the
other).  Per run: output tokens/s = all output tokens / wall time; TPOT = the mean over requests
of (finish - first token) / (tokens - 1).  The best of the rounds is reported (least
disturbed by other work), with acceptance = accepted / draft tokens of that run.
Prints a markdown table and `uptime` before and after.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from pagedserve import LLM, SamplingParams

TEXT = (
    "The printing press was invented by Johannes Gutenberg around 1440. It used movable metal type, "
    "oil-based ink and a wooden press adapted from the screw presses of the time. Within decades, "
    "printing spread to more than two hundred cities across Europe, and the cost of books fell sharply."
)
CODE = (
    "def area_of_square(side):\n    return side * side\n\n\ndef area_of_rectangle(width, height):\n"
    "    return width * height\n\n\ndef area_of_triangle(base, height):\n    return base * height / 2\n\n\n"
)
GROUNDED = [
    f"Repeat the following text exactly, word for word:\n\n{TEXT}",
    f"Rewrite the following text, replacing 'Gutenberg' by 'the inventor':\n\n{TEXT}",
    f"Here is some Python code:\n\n{CODE}Write the code again with a docstring in each function.",
    f"Copy this code and add a function area_of_circle(radius) at the end:\n\n{CODE}",
]
CHAT = [
    "What are three good habits for staying healthy?",
    "Tell me a short story about a lighthouse keeper.",
    "Why is the sky blue? Explain simply.",
    "Give me some ideas for a weekend trip in the mountains.",
]
CONFIGS = {
    "q4": {},
    "q4+ngram": {"spec": "ngram"},
    "bf16": {"quantization": "none"},
    "bf16+ngram": {"quantization": "none", "spec": "ngram"},
    "bf16+selfq": {"spec": "self_quantized"},
}


def chat(prompt: str) -> str:
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def build(name: str, args) -> LLM:
    cfg = dict(CONFIGS[name])
    spec = cfg.pop("spec", None)
    if spec == "ngram":
        cfg["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": args.k_ngram,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 5,
        }
    elif spec == "self_quantized":
        cfg["speculative_config"] = {"method": "self_quantized", "num_speculative_tokens": args.k_self}
    return LLM(kv_cache_memory="512MiB", max_model_len=1024, threads=args.threads, **cfg)


def run(llm: LLM, prompts: list[str], batch: int, max_tokens: int) -> dict[str, float]:
    """Every prompt at least once, ``batch`` requests at a time (below the number of
    prompts, several generations one after the other)."""
    engine = llm.llm_engine
    before = engine.stats()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [chat(prompts[i % len(prompts)]) for i in range(max(batch, len(prompts)))]
    wall, tokens, tpots = 0.0, 0, []
    for i in range(0, len(reqs), batch):
        start = time.perf_counter()
        outs = llm.generate(reqs[i : i + batch], params, use_tqdm=False)
        wall += time.perf_counter() - start
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        tpots += [
            (o.metrics["finished_time"] - o.metrics["first_token_time"]) / (len(o.outputs[0].token_ids) - 1)
            for o in outs
        ]
    after = engine.stats()
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return {
        "tps": tokens / wall,
        "tpot": sum(tpots) / len(tpots),
        "acc": accepted / drafted if drafted else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k-ngram", type=int, default=4)
    ap.add_argument("--k-self", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--workloads", default="grounded,chat")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    names = args.configs.split(",")
    workloads = {"grounded": GROUNDED, "chat": CHAT}
    print("load before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    engines = {name: build(name, args) for name in names}
    for llm in engines.values():  # warm-up: kernels built and caches touched
        run(llm, CHAT, 1, 4)
    best: dict[tuple[str, int, str], dict[str, float]] = {}
    for wl in args.workloads.split(","):
        for batch in batches:
            for _ in range(args.rounds):  # rounds inside the cell: its configs measured close in time
                for name in names:
                    r = run(engines[name], workloads[wl], batch, args.max_tokens)
                    print(
                        f"  {wl} batch {batch} {name}: {r['tps']:.1f} tok/s, TPOT {1000 * r['tpot']:.1f} ms, "
                        f"acceptance {r['acc']:.2f}",
                        file=sys.stderr,
                        flush=True,
                    )
                    key = (wl, batch, name)
                    if key not in best or r["tpot"] < best[key]["tpot"]:
                        best[key] = r
    print("\n| workload | batch | config | output tok/s | TPOT ms | vs baseline TPOT | acceptance |")
    print("|---|---|---|---|---|---|---|")
    for wl in args.workloads.split(","):
        for batch in batches:
            for name in names:
                r = best[(wl, batch, name)]
                base = best.get((wl, batch, name.split("+")[0]))
                speed = f"{base['tpot'] / r['tpot']:.2f}x" if base and "+" in name else ""
                acc = "" if r["acc"] != r["acc"] else f"{r['acc']:.0%}"
                print(f"| {wl} | {batch} | {name} | {r['tps']:.1f} | {1000 * r['tpot']:.1f} | {speed} | {acc} |")
    print("\nload after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
