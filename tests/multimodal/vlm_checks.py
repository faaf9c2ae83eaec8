"""What the vision-language tests share: the engine they build and how they compare its
outputs with transformers' (greedy tokens equal, logprobs within 2e-4)."""

from __future__ import annotations

import math

from pagedserve import LLM, SamplingParams
from pagedserve.testing.tiny_vlm import random_image

__all__ = [
    "IMAGE_PROMPTS_MAX_NEW",
    "QWEN_ENGINES",
    "QWEN_IMAGE",
    "check_output",
    "greedy_params",
    "image_prompts",
    "make_images",
    "make_llm",
]

#: Qwen2.5-VL / Qwen3-VL's image placeholder.
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
#: Qwen2.5-VL / Qwen3-VL engines beside the plain one.
QWEN_ENGINES = {
    # Chunks of 8 tokens over 20-30 token images: every image span is split across steps.
    "chunked+prefix": dict(max_num_batched_tokens=8, enable_prefix_caching=True, block_size=4),
    # 9 blocks of 8 tokens for 4 requests of 33-71 tokens: preemption is forced.
    "preempting": dict(
        max_num_batched_tokens=64,
        enable_prefix_caching=True,
        block_size=8,
        num_gpu_blocks_override=9,
        max_model_len=72,
    ),
}
#: Tokens to generate for each of `image_prompts`.
IMAGE_PROMPTS_MAX_NEW = [7, 9, 8, 6]


def image_prompts(image: str) -> list[tuple[str, list]]:
    """Prompts with no image, one, one and two around the placeholder ``image``, each image
    ``(seed, (width, height))``: images of different sizes give different grids (and so
    different position deltas)."""
    return [
        ("no picture here, just text", []),
        (f"A {image}", [(4, (24, 56))]),
        (f"Look: {image} what is it?", [(1, (40, 52))]),
        (f"{image} and {image}, compare.", [(2, (36, 28)), (3, (52, 40))]),
    ]


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
