"""Time to first token of a hybrid model's prompt whose 1,024-token prefix is in the
prefix cache (its attention blocks and a recurrent-state checkpoint at the prefix's last
boundary; docs/models.md, "Prefix caching") against the same prompt computed cold.

The model is a random Qwen3.5 (Gated DeltaNet : gated attention 3 : 1) built from
transformers' config class: 8 layers, hidden 512, float32 (``--dtype``), byte tokenizer.
Variants, one engine each, interleaved round by round (a fresh random prefix each round):

  * off: ``enable_prefix_caching=False``: the whole prompt computed (no checkpoints);
  * cold (interval k): prefix caching on, ``state_checkpoint_interval=k``, a prompt never
    seen: the whole prompt computed, with a checkpoint every k blocks written on the way;
  * cached: prefix caching on (the default interval), the prefix computed before with
    other 16 tokens after it; the prompt = prefix + 16 new tokens, 1 output token.

Prints the medians and the memory of one checkpoint (pool pages and the state's bytes).

    python benchmarks/hybrid_prefix_cache.py [--rounds 5 --prefix 1024 --intervals 1,4,16]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import CacheConfig
from pagedserve.config_rules import RECURRENT_STATE
from pagedserve.testing.tiny_model import write_byte_tokenizer

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
VOCAB = 259


def build_model(path: Path, layers: int, hidden: int) -> None:
    import transformers

    write_byte_tokenizer(path)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
        num_attention_heads=hidden // 64,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=hidden // 128,
        linear_num_value_heads=hidden // 64,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)


#: CPU seconds of this process per variant (the engine runs in it): steadier than wall
#: time on a loaded machine.
CPU: dict[int, float] = {}


def ttft(llm: LLM, prompt: list[int]) -> float:
    t0, c0 = time.perf_counter(), time.process_time()
    llm.generate([prompt], ONE, use_tqdm=False)
    CPU[id(llm)] = time.process_time() - c0
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--intervals", default="1,4,16", help="checkpoint intervals (blocks) of the cold variants")
    args = ap.parse_args()
    path = Path(tempfile.mkdtemp(prefix="pagedserve-hybrid-"))
    build_model(path, args.layers, args.hidden)
    common = dict(dtype=args.dtype, kv_cache_memory="256MiB", max_model_len=4096, max_num_batched_tokens=2048)
    default = CacheConfig().state_checkpoint_interval
    engines = {"off": LLM(str(path), enable_prefix_caching=False, **common)}
    for k in (int(x) for x in args.intervals.split(",")):
        engines[f"cold (interval {k})"] = LLM(str(path), state_checkpoint_interval=k, **common)
    engines["cached"] = LLM(str(path), **common)
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    for llm in engines.values():
        ttft(llm, tokens(args.prefix + 16))  # warm-up: kernels, threads
    times: dict[str, list[float]] = {name: [] for name in engines}
    cpu: dict[str, list[float]] = {name: [] for name in engines}
    cached = engines["cached"]
    for _ in range(args.rounds):
        prefix = tokens(args.prefix)
        ttft(cached, prefix + tokens(16))  # computes the prefix and its checkpoints
        hits = cached.llm_engine.kv.prefix_hits
        times["cached"].append(ttft(cached, prefix + tokens(16)))
        cpu["cached"].append(CPU[id(cached)])
        assert cached.llm_engine.kv.prefix_hits - hits == args.prefix  # the prefix hit, whole
        for name, llm in engines.items():
            if name != "cached":
                times[name].append(ttft(llm, tokens(args.prefix + 16)))
                cpu[name].append(CPU[id(llm)])
        print("round:", ", ".join(f"{name} {ts[-1] * 1e3:.0f} ms" for name, ts in times.items()), flush=True)
    base, base_cpu = statistics.median(times["off"]), statistics.median(cpu["off"])
    for name, ts in times.items():
        med, c = statistics.median(ts), statistics.median(cpu[name])
        print(
            f"{name:>20}: median TTFT {med * 1e3:8.1f} ms ({med / base:5.2f}x off), CPU {c:6.2f} s "
            f"({c / base_cpu:5.2f}x off), runs {len(ts)}"
        )
    eng = cached.llm_engine
    runner, kv = eng.runner, eng.kv
    page = runner.kv_block_bytes(eng.config.cache.block_size)
    groups = len(kv.state_groups)
    layers = sum(1 for w in runner.model.windows if w == RECURRENT_STATE)
    state_bytes = layers * runner.model.state_bytes(runner.kv_dtype)
    pool_mib = groups * kv.state_pages * page / 2**20
    print(
        f"one checkpoint (every {default} blocks of {eng.config.cache.block_size} tokens by default): {groups} "
        f"state groups x {kv.state_pages} pages of {page / 2**10:.1f} KiB = {pool_mib:.2f} MiB of the pool, "
        f"holding {layers} recurrent layers' states of {state_bytes / 2**20:.2f} MiB"
    )


if __name__ == "__main__":
    main()
