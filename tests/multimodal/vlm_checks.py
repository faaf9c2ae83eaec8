"""What the vision-language tests share: the engine they build, how they compare its
outputs with transformers' (greedy tokens equal, logprobs within 2e-4), and the checks
every image model goes through (its prompts under each engine, a follow-up turn that hits
the image's cached blocks, chat content parts); each takes the model's own
``hf_greedy(model, folder, prompt, images, n) -> (ids, tokens, logprobs)``."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.kernels import reference
from pagedserve.models.layers import MRotaryEmbedding
from pagedserve.testing.tiny_vlm import png_data_uri, random_image

__all__ = [
    "IMAGE_PROMPTS_MAX_NEW",
    "QWEN_ENGINES",
    "QWEN_IMAGE",
    "check_chat_with_a_data_uri",
    "check_engine_matches",
    "check_image_prefix_caching",
    "check_mrope_positions",
    "check_mrope_rotation",
    "check_output",
    "expected_greedy",
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


def expected_greedy(hf_greedy, model, folder, prompts, max_new, images=None):
    """The images of each of ``prompts`` (``(prompt, spec)``: ``make_images(spec)`` unless
    ``images`` gives them) and transformers' greedy ``max_new`` tokens for each."""
    images = images or {p: make_images(spec) for p, spec in prompts}
    return images, [hf_greedy(model, folder, p, images[p], n) for (p, _), n in zip(prompts, max_new, strict=True)]


def check_engine_matches(folder, engine_kind: str, engine: dict, prompts, images, expected, max_new, mrope=False):
    """The engine built with ``engine`` generates ``prompts`` together (each with its
    ``images``, greedy ``max_new``): transformers' tokens and logprobs (``expected``);
    preemptions where ``engine_kind`` is "preempting"; once the requests finish, nothing
    held in the encoder cache (nor in the M-RoPE position tables where ``mrope``)."""
    llm = make_llm(folder, **engine)
    try:
        inputs = [
            {"prompt": p, "multi_modal_data": {"image": images[p]}} if images[p] else {"prompt": p} for p, _ in prompts
        ]
        outs = llm.generate(inputs, [greedy_params(n) for n in max_new], use_tqdm=False)
        for i, (out, exp) in enumerate(zip(outs, expected, strict=True)):
            check_output(out, *exp, (engine_kind, i))
        if engine_kind == "preempting":
            assert llm.llm_engine.scheduler.num_preemptions > 0
        runner = llm.llm_engine.runner
        assert len(runner.encoder_cache) == 0
        if mrope:
            assert not runner._mrope
    finally:
        llm.shutdown()


def check_image_prefix_caching(folder, model, hf_greedy, image: str, max_num_batched_tokens: int) -> None:
    """A first turn with an image (the encoder runs once however the chunks cut it), then a
    follow-up turn with the same image hits the image's cached blocks (the encoder does
    not run again) and another image behind the same tokens misses; each turn
    transformers' tokens and logprobs."""
    llm = make_llm(folder, max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=True, block_size=4)
    cache = llm.llm_engine.runner.encoder_cache
    try:
        a, b = random_image(11, (40, 52)), random_image(12, (40, 52))
        first = f"Here {image} is a picture."
        out = llm.generate({"prompt": first, "multi_modal_data": {"image": a}}, greedy_params(4), use_tqdm=False)[0]
        check_output(out, *hf_greedy(model, folder, first, [a], 4), "first turn")
        assert cache.encoder_runs == 1
        image_id = llm.llm_engine.runner.vision.image_token_id
        image_end = len(out.prompt_token_ids) - out.prompt_token_ids[::-1].index(image_id)
        follow = first + " And now more text after it."
        again = llm.generate({"prompt": follow, "multi_modal_data": {"image": a}}, greedy_params(5), use_tqdm=False)[0]
        check_output(again, *hf_greedy(model, folder, follow, [a], 5), "same image")
        assert again.num_cached_tokens >= image_end
        assert cache.encoder_runs == 1
        other = llm.generate({"prompt": follow, "multi_modal_data": {"image": b}}, greedy_params(5), use_tqdm=False)[0]
        check_output(other, *hf_greedy(model, folder, follow, [b], 5), "other image")
        assert cache.encoder_runs == 2
    finally:
        llm.shutdown()


def check_chat_with_a_data_uri(folder, model, hf_greedy, image: str) -> None:
    """``LLM.chat`` with a text part and an ``image_url`` part (a PNG data URI) answers as
    transformers does on the chat template's prompt, ``image`` standing for the image."""
    llm = make_llm(folder)
    try:
        img = random_image(21, (40, 52))
        parts = [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": png_data_uri(img)}},
        ]
        out = llm.chat([{"role": "user", "content": parts}], greedy_params(5), use_tqdm=False)[0]
        prompt = f"<|im_start|>user\nWhat is this?\n{image}<|im_end|>\n<|im_start|>assistant\n"
        check_output(out, *hf_greedy(model, folder, prompt, [img], 5), "chat data uri")
    finally:
        llm.shutdown()


def check_mrope_positions(folder, model) -> None:
    """The prompt's 3-D positions and the delta of later tokens, as transformers'
    get_rope_index computes them, for images of different grids with text around."""
    llm = make_llm(folder)
    try:
        vision = llm.llm_engine.runner.vision
        prompt = f"x {QWEN_IMAGE} yy {QWEN_IMAGE} and {QWEN_IMAGE} z"
        images = make_images([(5, (40, 52)), (6, (24, 56)), (7, (36, 28))])
        enc = vision.load_processor(str(folder))(text=[prompt], images=images, return_tensors="pt")
        want, delta = model.model.get_rope_index(
            enc["input_ids"], mm_token_type_ids=enc["mm_token_type_ids"], image_grid_thw=enc["image_grid_thw"]
        )
        ids, items = llm.llm_engine.input_processor.mm_processor.process(prompt, images)
        assert ids == enc["input_ids"][0].tolist()
        table, got_delta = vision.mrope_positions(len(ids), items)
        assert table.tolist() == want[:, 0].tolist()
        assert got_delta == int(delta) < 0
    finally:
        llm.shutdown()


def check_mrope_rotation(rotary, apply_rotary_pos_emb, theta: float, section: list[int], interleaved: bool = False):
    """``MRotaryEmbedding`` (head size 32, 11 tokens of random 3-D positions, 2 query heads
    and 1 key head) against transformers' rotary embedding ``rotary`` and its
    ``apply_rotary_pos_emb`` (1e-5), and the plain-torch reference (1e-6).  Returns the
    embedding, its ops, the positions, q, k and the rotated q."""
    head_dim, n = 32, 11
    gen = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 40, (3, n), generator=gen)
    q = torch.randn(n, 2, head_dim, generator=gen)
    k = torch.randn(n, 1, head_dim, generator=gen)
    cos, sin = rotary(q, positions.unsqueeze(1))  # [3, 1, n, d] -> [1, n, d]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    rope = MRotaryEmbedding(head_dim, 64, theta, None, [torch.device("cpu")], section, interleaved=interleaved)
    ops = SimpleNamespace(rotary_embedding=reference.rotary_embedding)
    got_q, got_k = rope(ops, 0, positions, q, k)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    ref_q, ref_k = reference.mrope_rotary_embedding(positions, q, k, rope.tables[0], section, interleaved=interleaved)
    torch.testing.assert_close(got_q, ref_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, ref_k, atol=1e-6, rtol=1e-6)
    return rope, ops, positions, q, k, got_q
