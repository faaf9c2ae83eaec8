"""What the vision-language tests share: the engine they build and how they compare its
outputs with transformers' (greedy tokens equal, logprobs within 2e-4)."""

from __future__ import annotations

import math

from pagedserve import LLM, SamplingParams
from pagedserve.testing.tiny_vlm import random_image

__all__ = ["make_images", "make_llm", "check_output", "greedy_params"]


def make_images(spec):
    return [random_image(seed, size) for seed, size in spec]


def make_llm(folder, **kw) -> LLM:
    return LLM(str(folder), dtype="float32", kv_cache_memory=2**22, max_model_len=kw.pop("max_model_len", 256), **kw)


def check_output(out, ids, tokens, logprobs, where):
    assert out.prompt_token_ids == ids, where
    got = out.outputs[0]
    assert list(got.token_ids) == tokens, where
    for j, (tok, entry) in enumerate(zip(got.token_ids, got.logprobs)):
        assert math.isclose(entry[tok].logprob, logprobs[j], abs_tol=2e-4), (where, j)


def greedy_params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
