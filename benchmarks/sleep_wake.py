"""Sleep mode on the default model (docs/memory.md#sleep-mode): memory freed and time to wake.

For each level, in one process: the process RSS awake (after a short generation, with the
KV cache's pages made resident by filling it, as a server that has used every block), after
``sleep(level)`` and after ``wake_up()``; the time sleep and wake take and the time to the
first token after waking; and whether greedy outputs with logprobs match the ones before.

    python benchmarks/sleep_wake.py [--kv-cache-memory 512MiB]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pagedserve import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def outputs(llm: LLM, max_tokens: int = 16) -> list:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    return [
        (o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
        for o in llm.generate(PROMPTS, sp, use_tqdm=False)
    ]


def fill_kv(llm: LLM) -> None:
    for k, v in llm.llm_engine.runner.kv_caches:
        k.fill_(0.5)
        v.fill_(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--kv-cache-memory", default="512MiB")
    args = ap.parse_args()
    llm = LLM(args.model, kv_cache_memory=args.kv_cache_memory, enable_sleep_mode=True)
    runner = llm.llm_engine.runner
    kv_mib = runner.num_blocks * runner.kv_block_bytes(runner.block_size) / 2**20
    print(f"weights {runner.weight_bytes() / 2**20:.0f} MiB, KV cache {kv_mib:.0f} MiB ({runner.num_blocks} blocks)")
    reference = outputs(llm)
    for level in (1, 2):
        fill_kv(llm)
        awake = rss_mib()
        t0 = time.perf_counter()
        llm.sleep(level)
        t1 = time.perf_counter()
        asleep = rss_mib()
        llm.wake_up()
        t2 = time.perf_counter()
        woken = rss_mib()
        outputs(llm, max_tokens=1)  # the first token after waking
        t3 = time.perf_counter()
        same = outputs(llm) == reference
        print(
            f"level {level}: RSS awake {awake:.0f} MiB, asleep {asleep:.0f} MiB (freed {awake - asleep:.0f}), "
            f"after wake {woken:.0f} MiB; sleep {t1 - t0:.2f} s, wake {t2 - t1:.2f} s, "
            f"first token after wake {t3 - t2:.2f} s; outputs identical: {same}"
        )


if __name__ == "__main__":
    main()
