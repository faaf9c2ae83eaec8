"""Gemma 3 images through ``LLM`` against transformers' ``Gemma3ForConditionalGeneration``,
float32: greedy tokens and their logprobs for no image, one image and two images, the
image tokens attending to each other both ways (transformers' token-type mask) in a
decoder with a sliding-window layer shorter than an image and a full-attention layer;
with chunked prefill (chunks end before or after an image, never inside), prefix caching
(a follow-up turn reads the image's cached blocks and skips the encoder; a hit that ends
inside an image), forced preemption; the vision tower and projector alone; refusals."""

from __future__ import annotations

import json

import pytest
import torch
from vlm_checks import (
    IMAGE_PROMPTS_MAX_NEW,
    check_chat_with_a_data_uri,
    check_engine_matches,
    check_image_prefix_caching,
    check_output,
    expected_greedy,
    greedy_params,
    image_prompts,
    make_images,
    make_llm,
)

from pagedserve.testing.tiny_vlm import GEMMA3_IMAGE, build_gemma3, hf_greedy_gemma3, random_image

transformers = pytest.importorskip("transformers")

IMAGE = GEMMA3_IMAGE
ENGINES = {
    "whole": dict(),
    # Chunks of 20 tokens over prompts of 30-70 with 16-token images: cut before images.
    "chunked+prefix": dict(max_num_batched_tokens=20, enable_prefix_caching=True, block_size=4),
    # 12 blocks of 8 tokens for 4 requests of 10-70 tokens: preemption is forced.
    "preempting": dict(
        max_num_batched_tokens=80,
        enable_prefix_caching=True,
        block_size=8,
        num_gpu_blocks_override=12,
        max_model_len=88,
    ),
}
PROMPTS = image_prompts(IMAGE)
MAX_NEW = IMAGE_PROMPTS_MAX_NEW


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")
    return folder, build_gemma3(folder)


def test_vision_matches_transformers(gemma3_dir):
    folder, model = gemma3_dir
    llm = make_llm(folder)
    try:
        vision = llm.llm_engine.runner.vision
        enc = vision.load_processor(str(folder))(text=[IMAGE], images=[random_image(7, (44, 60))], return_tensors="pt")
        with torch.inference_mode():
            want = model.model.get_image_features(enc["pixel_values"]).pooler_output[0]
            got = vision.embed_image({"pixel_values": enc["pixel_values"]})
        assert got.shape == (16, 64)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        llm.shutdown()


def test_bidirectional_mask_matters(gemma3_dir):
    """transformers without the token types (causal image tokens) answers otherwise: the
    comparisons below would catch a causal implementation."""
    folder, model = gemma3_dir
    prompt, spec = PROMPTS[2]
    ids, _, logprobs = hf_greedy_gemma3(model, folder, prompt, make_images(spec), 1)
    proc = llm_processor(folder)
    enc = proc(text=[prompt], images=make_images(spec), return_tensors="pt")
    with torch.inference_mode():
        logits = model(input_ids=enc["input_ids"], pixel_values=enc["pixel_values"]).logits[0, -1]
    causal = torch.log_softmax(logits.float(), -1).max().item()
    assert abs(causal - logprobs[0]) > 1e-3


def llm_processor(folder):
    from pagedserve.models.gemma3_vision import load_gemma3_processor

    return load_gemma3_processor(str(folder))


@pytest.mark.parametrize("engine_kind", list(ENGINES))
def test_gemma3_matches_transformers(engine_kind, gemma3_dir):
    folder, model = gemma3_dir
    images, expected = expected_greedy(hf_greedy_gemma3, model, folder, PROMPTS, MAX_NEW)
    check_engine_matches(folder, engine_kind, ENGINES[engine_kind], PROMPTS, images, expected, MAX_NEW)


def test_image_prefix_caching(gemma3_dir):
    """A follow-up turn with the same image hits the image's cached blocks (the encoder
    does not run again); another image behind the same tokens misses."""
    folder, model = gemma3_dir
    check_image_prefix_caching(folder, model, hf_greedy_gemma3, IMAGE, max_num_batched_tokens=20)


def test_prefix_hit_ending_inside_an_image(gemma3_dir):
    """Blocks evicted tail first can leave a cached chain that ends inside an image: the
    hit is kept (those tokens were computed with the whole image in one step) and the
    image's remaining tokens are computed together, seeing the cached ones."""
    folder, model = gemma3_dir
    llm = make_llm(
        folder,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
        block_size=4,
        num_gpu_blocks_override=16,
        max_model_len=64,
    )
    try:
        img = random_image(13, (40, 52))
        prompt = f"Here {IMAGE} is a picture."
        first = llm.generate({"prompt": prompt, "multi_modal_data": {"image": img}}, greedy_params(2), use_tqdm=False)[
            0
        ]
        ids = first.prompt_token_ids
        image_id = llm.llm_engine.runner.vision.image_token_id
        start, end = ids.index(image_id), len(ids) - ids[::-1].index(image_id)
        # A text request of 44 tokens (11 of the 16 blocks, then its output's) evicts the
        # first prompt's blocks from its tail: the cached chain left ends inside the image.
        llm.generate("z" * 44, greedy_params(1), use_tqdm=False)
        again = llm.generate({"prompt": prompt, "multi_modal_data": {"image": img}}, greedy_params(4), use_tqdm=False)[
            0
        ]
        assert start < again.num_cached_tokens < end, (start, again.num_cached_tokens, end)
        check_output(again, *hf_greedy_gemma3(model, folder, prompt, [img], 4), "hit inside the image")
    finally:
        llm.shutdown()


def test_chat_with_a_data_uri(gemma3_dir):
    folder, model = gemma3_dir
    check_chat_with_a_data_uri(folder, model, hf_greedy_gemma3, IMAGE)


def test_refusals(gemma3_dir, tmp_path):
    folder, _ = gemma3_dir
    with pytest.raises(ValueError, match="max_num_batched_tokens >= 16"):
        make_llm(folder, max_num_batched_tokens=12)
    # Pan-and-scan crops are not implemented: refused at start-up.
    copy = tmp_path / "pan"
    copy.mkdir()
    for f in folder.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    name = "processor_config.json" if (copy / "processor_config.json").is_file() else "preprocessor_config.json"
    cfg = json.loads((copy / name).read_text())
    target = cfg["image_processor"] if isinstance(cfg.get("image_processor"), dict) else cfg
    target["do_pan_and_scan"] = True
    (copy / name).write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="pan-and-scan"):
        make_llm(copy)
    # Text alone still loads.
    llm = make_llm(copy, limit_mm_per_prompt={"image": 0})
    llm.shutdown()


def test_attention_op_without_key_ends_is_refused(gemma3_dir):
    from types import SimpleNamespace

    from pagedserve.loader import open_model
    from pagedserve.models.arch_config import ArchConfig
    from pagedserve.models.gemma3_vision import Gemma3Vision

    folder, _ = gemma3_dir
    arch = ArchConfig.from_hf(open_model(str(folder)).hf_config)

    def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out=None):
        raise AssertionError("not called")

    ops = SimpleNamespace(paged_attention=paged_attention, source=lambda name: "a plugin")
    engine = SimpleNamespace(scheduler=SimpleNamespace(max_num_batched_tokens=64))
    with pytest.raises(ValueError, match="key_ends"):
        Gemma3Vision.check_engine(engine, arch, ops)
