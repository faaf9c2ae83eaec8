"""Qwen2.5-VL through ``LLM`` against transformers' ``Qwen2_5_VLForConditionalGeneration``,
float32: greedy tokens and their logprobs for one image, two images of different sizes
and no image, with chunked prefill splitting image spans, prefix caching (a follow-up
turn reads the image's cached blocks, so their M-RoPE positions come from the table) and
forced preemption (recomputed positions); the vision tower's windows, full-attention
layer and patch merger; M-RoPE against transformers' rotary embedding and the plain-torch
reference; chat content parts."""

from __future__ import annotations

import pytest
import torch
from vlm_checks import (
    IMAGE_PROMPTS_MAX_NEW,
    QWEN_ENGINES,
    QWEN_IMAGE,
    check_chat_with_a_data_uri,
    check_engine_matches,
    check_image_prefix_caching,
    check_mrope_positions,
    check_mrope_rotation,
    expected_greedy,
    image_prompts,
    make_llm,
)

from pagedserve.testing.tiny_vlm import hf_greedy_qwen, random_image

transformers = pytest.importorskip("transformers")

IMAGE = QWEN_IMAGE
ENGINES = QWEN_ENGINES
PROMPTS = image_prompts(IMAGE)
MAX_NEW = IMAGE_PROMPTS_MAX_NEW


def test_mrope_matches_transformers_and_reference():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding, apply_rotary_pos_emb

    section = [4, 6, 6]
    cfg = transformers.Qwen2_5_VLTextConfig(
        hidden_size=64,
        num_attention_heads=2,
        head_dim=32,
        rope_scaling={"rope_type": "default", "mrope_section": section},
    )
    theta = cfg.rope_parameters["rope_theta"]
    rope, ops, positions, q, k, _ = check_mrope_rotation(
        Qwen2_5_VLRotaryEmbedding(cfg), apply_rotary_pos_emb, theta, section
    )
    # Three equal positions are plain RoPE.
    same = positions[:1].expand(3, q.shape[0])
    plain = rope(ops, 0, positions[0], q, k)
    torch.testing.assert_close(rope(ops, 0, same, q, k)[0], plain[0])


def test_vision_tower_matches_transformers(qwen_vl_dir):
    """The tower alone, for a grid with several windows (some cut by the border)."""
    folder, model = qwen_vl_dir
    llm = make_llm(folder)
    try:
        vision = llm.llm_engine.runner.vision
        proc = vision.load_processor(str(folder))
        enc = proc(text=[IMAGE], images=[random_image(7, (44, 60))], return_tensors="pt")
        t, h, w = enc["image_grid_thw"][0].tolist()
        # Windows of 2x2 merged units: several, some cut by the border.
        assert h // 2 > 2 and w // 2 > 2 and ((h // 2) % 2 or (w // 2) % 2)
        with torch.inference_mode():
            want = model.model.visual(enc["pixel_values"], grid_thw=enc["image_grid_thw"]).pooler_output
            got = vision.embed_image({"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]})
        assert got.shape == (t * h * w // 4, 64)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        llm.shutdown()


def test_mrope_positions_match_transformers(qwen_vl_dir):
    check_mrope_positions(*qwen_vl_dir)


@pytest.mark.parametrize("engine_kind", list(ENGINES))
def test_qwen2_5_vl_matches_transformers(engine_kind, qwen_vl_dir):
    folder, model = qwen_vl_dir
    images, expected = expected_greedy(hf_greedy_qwen, model, folder, PROMPTS, MAX_NEW)
    # The image matters: another image behind the same prompt changes the logprobs.
    other = hf_greedy_qwen(model, folder, PROMPTS[2][0], [random_image(99, (40, 52))], 1)
    assert abs(other[2][0] - expected[2][2][0]) > 1e-3
    check_engine_matches(folder, engine_kind, ENGINES[engine_kind], PROMPTS, images, expected, MAX_NEW, mrope=True)


def test_image_prefix_caching_positions(qwen_vl_dir):
    """A follow-up turn with the same image hits the image's cached blocks (the encoder
    does not run) and its later tokens still get the positions after the image."""
    folder, model = qwen_vl_dir
    check_image_prefix_caching(folder, model, hf_greedy_qwen, IMAGE, max_num_batched_tokens=8)


def test_chat_content_parts(qwen_vl_dir):
    folder, model = qwen_vl_dir
    check_chat_with_a_data_uri(folder, model, hf_greedy_qwen, "<|image_pad|>")
