"""Time to first token of a prompt whose 1,024-token prefix was computed before, by where
the prefix's KV blocks come from (docs/memory.md#kv-connectors), on the default model:

  * cold: not cached anywhere (a fresh random prefix): the whole prompt is computed;
  * disk: ``kv_connector="disk:DIR"``: the prefix was computed and saved by this engine,
    then its device prefix cache was emptied, so the blocks are read from the block files
    (from the OS page cache: the files were just written);
  * disk, evicted: the same, but every block file is fsync'ed and dropped from the OS
    page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``) before the timed request, so its
    blocks are read from the disk itself (``fincore``, where installed, reports the bytes
    still resident: 0 means a cold read);
  * host connector: ``kv_connector="host"``, the same with the blocks in host memory;
  * host tier: ``kv_offload_memory``: the prefix was computed, then evicted from a small
    device cache by other prompts (spilled to the host tier), and is reloaded from it.

Each round runs every variant once with a new random prefix, so the variants interleave;
the medians over the rounds are printed.  Prompt = prefix + 16 new tokens, 1 output token.

    python benchmarks/kv_connector.py [--rounds 5 --prefix 1024] [--dir DIR (on a real disk, not tmpfs)]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time

from pagedserve import LLM, SamplingParams

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def ttft(llm: LLM, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    llm.generate([prompt], ONE, use_tqdm=False)
    return time.perf_counter() - t0


def evict(directory: str) -> int:
    """fsync every file of ``directory`` and drop it from the OS page cache; the bytes of
    them still resident afterwards (per ``fincore``; -1 where it is not installed)."""
    files = [os.path.join(directory, n) for n in os.listdir(directory)]
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if shutil.which("fincore") is None or not files:
        return -1
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *files],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return sum(int(x) for x in out.split())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--dir", default=None, help="where the disk connectors' directories go (default: the temp dir)")
    args = ap.parse_args()
    rng = random.Random(0)
    common = dict(kv_cache_memory="128MiB", max_model_len=2048)
    directory = tempfile.mkdtemp(prefix="pagedserve-kv-", dir=args.dir)
    evicted_dir = tempfile.mkdtemp(prefix="pagedserve-kv-evicted-", dir=args.dir)
    resident: list[int] = []
    engines = {
        "cold": LLM(args.model, **common),
        "disk": LLM(args.model, **common, kv_connector=f"disk:{directory}"),
        "disk, evicted": LLM(args.model, **common, kv_connector=f"disk:{evicted_dir}"),
        "host connector": LLM(args.model, **common, kv_connector="host"),
        # About 2.6 prompts fit on the device: three filler prompts evict the whole prefix to host.
        "host tier": LLM(args.model, kv_cache_memory="60MiB", max_model_len=2048, kv_offload_memory="512MiB"),
    }
    vocab = 49152
    times: dict[str, list[float]] = {name: [] for name in engines}

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    ttft(engines["cold"], tokens(args.prefix + 16))  # warm-up: kernels, threads
    for _ in range(args.rounds):
        for name, llm in engines.items():
            prefix, suffix = tokens(args.prefix), tokens(16)
            if name == "cold":
                times[name].append(ttft(llm, prefix + suffix))
                continue
            llm.generate([prefix + tokens(16)], ONE, use_tqdm=False)  # computes (and saves) the prefix
            if name == "host tier":
                for _ in range(3):
                    llm.generate([tokens(args.prefix + 16)], ONE, use_tqdm=False)
            else:
                assert llm.llm_engine.kv.reset_prefix_cache()  # the device cache forgets it
            if name == "disk, evicted":
                resident.append(evict(evicted_dir))
            kv = llm.llm_engine.kv
            before = getattr(kv, "num_loaded_tokens", None) or getattr(kv, "num_reloaded_tokens", 0)
            times[name].append(ttft(llm, prefix + suffix))
            after = getattr(kv, "num_loaded_tokens", None) or getattr(kv, "num_reloaded_tokens", 0)
            assert after - before >= args.prefix - 16, (name, after - before)  # the prefix did come from the store
    cold = statistics.median(times["cold"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(
            f"{name:15s} median TTFT {med * 1000:7.1f} ms ({cold / med:4.1f}x faster than cold)  all: "
            + ", ".join(f"{t * 1000:.0f}" for t in ts)
        )
    print(f"disk, evicted: bytes of its block files still in the page cache before each timed request: {resident}")


if __name__ == "__main__":
    main()
