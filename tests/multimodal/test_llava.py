"""LLaVA through ``LLM`` against transformers' ``LlavaForConditionalGeneration``, float32:
greedy tokens and their logprobs for one image, two images (apart and adjacent) and no
image, with chunked prefill splitting image-token spans, prefix caching and forced
preemption; the encoder cache (each image encoded once, a follow-up turn with the same
image a prefix-cache hit that skips the encoder, a different image behind the same
placeholder tokens a miss); chat content parts; text-only loading (image=0)."""

from __future__ import annotations

import pytest
from vlm_checks import check_engine_matches, check_output, expected_greedy, greedy_params, make_llm

from pagedserve.testing.tiny_vlm import hf_greedy, png_data_uri, random_image

ENGINES = {
    # Chunks of 8 tokens over 16-token images: every image span is split across steps.
    "chunked+prefix": dict(max_num_batched_tokens=8, enable_prefix_caching=True, block_size=4),
    # ~9 blocks of 8 tokens for 4 requests of ~30-55 tokens: preemption is forced.
    "preempting": dict(
        max_num_batched_tokens=64, enable_prefix_caching=True, block_size=8, num_gpu_blocks_override=9, max_model_len=72
    ),
}

PROMPTS = [
    ("Look: <image> what is it?", [1]),
    ("<image> and <image>, compare.", [2, 3]),
    ("Two at once <image><image> ok", [4, 5]),
    ("no picture here, just text", []),
]
MAX_NEW = [8, 6, 7, 5]


@pytest.mark.parametrize("engine_kind", list(ENGINES))
def test_llava_matches_transformers(engine_kind, llava_dir):
    folder, model = llava_dir
    images = {p: [random_image(s) for s in seeds] for p, seeds in PROMPTS}
    _, expected = expected_greedy(hf_greedy, model, folder, PROMPTS, MAX_NEW, images)
    # The image matters: another image behind the same prompt changes the logprobs.
    other = hf_greedy(model, folder, PROMPTS[0][0], [random_image(99)], 1)
    assert abs(other[2][0] - expected[0][2][0]) > 1e-3
    check_engine_matches(folder, engine_kind, ENGINES[engine_kind], PROMPTS, images, expected, MAX_NEW)


def test_encoder_cache_and_image_prefix_caching(llava_dir):
    folder, model = llava_dir
    llm = make_llm(folder, max_num_batched_tokens=8, enable_prefix_caching=True, block_size=4)
    cache = llm.llm_engine.runner.encoder_cache
    try:
        a, b = random_image(11), random_image(12)
        first = "Here <image> is a picture."
        out = llm.generate({"prompt": first, "multi_modal_data": {"image": a}}, greedy_params(4), use_tqdm=False)[0]
        # 16 image tokens over chunks of 8: encoded once, read by each chunk.
        assert cache.encoder_runs == 1
        image_end = out.prompt_token_ids.index(llm.llm_engine.runner.vision.image_token_id) + 16
        follow = first + " And now more text after it."
        ids, tokens, logprobs = hf_greedy(model, folder, follow, [a], 5)
        again = llm.generate({"prompt": follow, "multi_modal_data": {"image": a}}, greedy_params(5), use_tqdm=False)[0]
        check_output(again, ids, tokens, logprobs, "same image")
        assert again.num_cached_tokens >= image_end  # the image's blocks were a hit
        assert cache.encoder_runs == 1  # ... so the encoder did not run
        ids, tokens, logprobs = hf_greedy(model, folder, follow, [b], 5)
        other = llm.generate({"prompt": follow, "multi_modal_data": {"image": b}}, greedy_params(5), use_tqdm=False)[0]
        check_output(other, ids, tokens, logprobs, "other image")
        assert other.num_cached_tokens <= image_end - 16  # same placeholder tokens, another image: a miss
        assert cache.encoder_runs == 2
    finally:
        llm.shutdown()


def test_chat_content_parts(llava_dir):
    folder, model = llava_dir
    llm = make_llm(folder)
    try:
        img = random_image(21)
        parts = [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": png_data_uri(img)}},
        ]
        out = llm.chat([{"role": "user", "content": parts}], greedy_params(5), use_tqdm=False)[0]
        prompt = "<|im_start|>user\nWhat is this?\n<image><|im_end|>\n<|im_start|>assistant\n"
        check_output(out, *hf_greedy(model, folder, prompt, [img], 5), "chat data uri")
        pil = [{"type": "image_pil", "image_pil": img}, {"type": "text", "text": "What is this?"}]
        out = llm.chat([{"role": "user", "content": pil}], greedy_params(5), use_tqdm=False)[0]
        prompt = "<|im_start|>user\n<image>\nWhat is this?<|im_end|>\n<|im_start|>assistant\n"
        check_output(out, *hf_greedy(model, folder, prompt, [img], 5), "chat pil")
        with pytest.raises(ValueError, match="remote image URLs are not fetched"):
            llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}])
    finally:
        llm.shutdown()


def test_bad_image_requests_are_refused(llava_dir):
    folder, _ = llava_dir
    llm = make_llm(folder, limit_mm_per_prompt='{"image": 1}')
    try:
        img = random_image(31)
        with pytest.raises(ValueError, match="at most 1"):
            llm.generate({"prompt": "<image><image>", "multi_modal_data": {"image": [img, img]}}, use_tqdm=False)
        with pytest.raises(ValueError, match="image token"):
            llm.generate("a bare <image> token", use_tqdm=False)
        with pytest.raises(ValueError, match="placeholder|do not match|image tokens"):
            llm.generate({"prompt": "no placeholder", "multi_modal_data": {"image": img}}, use_tqdm=False)
        with pytest.raises(ValueError, match="PIL"):
            llm.generate({"prompt": "<image>", "multi_modal_data": {"image": b"png?"}}, use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    finally:
        llm.shutdown()


def test_text_only_loading(llava_dir):
    """image=0: the language model alone (no vision weights), equal to transformers on text."""
    folder, model = llava_dir
    llm = make_llm(folder, limit_mm_per_prompt="image=0")
    try:
        assert llm.llm_engine.runner.vision is None
        prompt = "just some text"
        out = llm.generate(prompt, greedy_params(6), use_tqdm=False)[0]
        check_output(out, *hf_greedy(model, folder, prompt, [], 6), "text only")
        with pytest.raises(ValueError, match="takes no images"):
            llm.generate({"prompt": "<image>", "multi_modal_data": {"image": random_image(1)}}, use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "setting, message",
    [
        (dict(tensor_parallel_size=2), "tensor_parallel_size=2"),
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative_config"),
        (dict(quantization="int8"), "quantization='int8'"),
        (dict(device_map="cpu"), "device_map"),
    ],
)
def test_images_refused_with_what_they_do_not_support(llava_dir, setting, message):
    folder, _ = llava_dir
    with pytest.raises(ValueError, match=rf"images of LlavaForConditionalGeneration .*{message}.*image=0"):
        make_llm(folder, **setting)


def test_token_id_prompts_with_images_are_refused(llava_dir):
    folder, _ = llava_dir
    llm = make_llm(folder)
    try:
        with pytest.raises(ValueError, match="must be text"):
            llm.generate({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": random_image(1)}}, use_tqdm=False)
    finally:
        llm.shutdown()
