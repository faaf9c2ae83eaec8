"""Shared helpers of the distributed tests: prompts, the single-process reference, and an
LLM that is always shut down (a leaked process group would break every later test)."""

from __future__ import annotations

import contextlib
import random

from pagedserve import LLM, SamplingParams

BASE = dict(dtype="float32", kv_cache_memory="8MiB", block_size=4, max_num_batched_tokens=24)


def make_prompts(seed: int = 0, vocab: int = 259) -> list[list[int]]:
    """Lengths 1..30 plus two prompts sharing a 13-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(13)]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 6, 17, 30)]
    return prompts + [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (2, 9)]


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def token_ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@contextlib.contextmanager
def running_llm(**kwargs):
    llm = LLM(**{**BASE, **kwargs})
    try:
        yield llm
    finally:
        llm.shutdown()
