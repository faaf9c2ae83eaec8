"""Qwen3-VL through ``LLM`` against transformers' ``Qwen3VLForConditionalGeneration``,
float32: greedy tokens and their logprobs for one image, two images of different sizes
and no image, with chunked prefill splitting image spans (DeepStack features added to
the chunk's rows of each image), prefix caching (a follow-up turn reads the image's
cached blocks; the encoder does not run) and forced preemption; the vision tower
(interpolated position embeddings, DeepStack mergers); interleaved M-RoPE against
transformers' rotary embedding and the plain-torch reference; chat content parts."""

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
    check_output,
    expected_greedy,
    greedy_params,
    image_prompts,
    make_images,
    make_llm,
)

from pagedserve.models.layers import MRotaryEmbedding
from pagedserve.models.rope import mrope_parts
from pagedserve.testing.tiny_vlm import hf_greedy_qwen, random_image

transformers = pytest.importorskip("transformers")

IMAGE = QWEN_IMAGE
ENGINES = QWEN_ENGINES
PROMPTS = image_prompts(IMAGE)
MAX_NEW = IMAGE_PROMPTS_MAX_NEW


def test_interleaved_mrope_matches_transformers_and_reference():
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding, apply_rotary_pos_emb

    # 16 frequencies: height/width alternate up to 15, the last one stays temporal.
    section = [6, 5, 5]
    assert mrope_parts(section, True) == [0, 1, 2] * 5 + [0]
    cfg = transformers.Qwen3VLTextConfig(
        hidden_size=64,
        num_attention_heads=2,
        head_dim=32,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5000.0,
            "mrope_section": section,
            "mrope_interleaved": True,
        },
    )
    _, ops, positions, q, k, got_q = check_mrope_rotation(
        Qwen3VLTextRotaryEmbedding(cfg), apply_rotary_pos_emb, 5000.0, section, interleaved=True
    )
    # The contiguous split (Qwen2.5-VL) is another rotation.
    contiguous = MRotaryEmbedding(32, 64, 5000.0, None, [torch.device("cpu")], section)
    assert not torch.allclose(contiguous(ops, 0, positions, q, k)[0], got_q, atol=1e-3)


def test_vision_tower_matches_transformers(qwen3_vl_dir):
    """The tower alone, images of two sizes: the merged embeddings and each DeepStack feature."""
    folder, model = qwen3_vl_dir
    llm = make_llm(folder)
    try:
        vision = llm.llm_engine.runner.vision
        assert vision.deepstack_layers == 2
        proc = vision.load_processor(str(folder))
        for seed, size in ((7, (44, 60)), (8, (28, 44))):
            enc = proc(text=[IMAGE], images=[random_image(seed, size)], return_tensors="pt")
            t, h, w = enc["image_grid_thw"][0].tolist()
            assert h != w and h != 4  # the 4x4 position grid is resampled
            with torch.inference_mode():
                out = model.model.visual(enc["pixel_values"], grid_thw=enc["image_grid_thw"])
                got = vision.embed_image({"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]})
            assert got.shape == (t * h * w // 4, 3 * 64)
            want = torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        llm.shutdown()


def test_mrope_positions_match_transformers(qwen3_vl_dir):
    check_mrope_positions(*qwen3_vl_dir)


@pytest.mark.parametrize("engine_kind", list(ENGINES))
def test_qwen3_vl_matches_transformers(engine_kind, qwen3_vl_dir):
    folder, model = qwen3_vl_dir
    images, expected = expected_greedy(hf_greedy_qwen, model, folder, PROMPTS, MAX_NEW)
    # The image matters, and so do its DeepStack features.
    prompt, imgs = PROMPTS[2][0], images[PROMPTS[2][0]]
    other = hf_greedy_qwen(model, folder, prompt, [random_image(99, (40, 52))], 1)
    assert abs(other[2][0] - expected[2][2][0]) > 1e-3
    visual = model.model.visual
    kept = visual.deepstack_visual_indexes
    try:
        visual.deepstack_visual_indexes = []
        without = hf_greedy_qwen(model, folder, prompt, imgs, 1)
    finally:
        visual.deepstack_visual_indexes = kept
    assert abs(without[2][0] - expected[2][2][0]) > 1e-3
    check_engine_matches(folder, engine_kind, ENGINES[engine_kind], PROMPTS, images, expected, MAX_NEW, mrope=True)


def test_image_prefix_caching(qwen3_vl_dir):
    """A follow-up turn with the same image hits the image's cached blocks (the encoder
    does not run); another image behind the same tokens misses."""
    folder, model = qwen3_vl_dir
    check_image_prefix_caching(folder, model, hf_greedy_qwen, IMAGE, max_num_batched_tokens=8)


def test_chat_content_parts(qwen3_vl_dir):
    folder, model = qwen3_vl_dir
    check_chat_with_a_data_uri(folder, model, hf_greedy_qwen, "<|image_pad|>")


@pytest.mark.parametrize("layout", ["transformers", "published"])
def test_qwen3_vl_moe_matches_transformers(layout, tmp_path):
    """Qwen3-VL-MoE: the same vision side over a Qwen3-MoE language model whose experts
    are fused in the checkpoint (one dense layer), with images and chunked prefill; the
    fused tensors as transformers saves them and transposed, as Qwen publishes them."""
    from safetensors.torch import load_file, save_file

    from pagedserve.testing.tiny_vlm import build_qwen3_vl

    model = build_qwen3_vl(tmp_path, moe=True)
    if layout == "published":
        path = tmp_path / "model.safetensors"
        tensors = load_file(str(path))
        fused = [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
        assert len(fused) == 4  # two sparse layers
        for k in fused:
            tensors[k] = tensors[k].transpose(1, 2).contiguous()
        save_file(tensors, str(path), metadata={"format": "pt"})
    prompts = PROMPTS[1:]
    images = {p: make_images(spec) for p, spec in prompts}
    expected = [hf_greedy_qwen(model, tmp_path, p, images[p], 5) for p, _ in prompts]
    llm = make_llm(tmp_path, **ENGINES["chunked+prefix"])
    try:
        outs = llm.generate(
            [{"prompt": p, "multi_modal_data": {"image": images[p]}} for p, _ in prompts],
            [greedy_params(5)] * len(prompts),
            use_tqdm=False,
        )
        for i, (out, exp) in enumerate(zip(outs, expected)):
            check_output(out, *exp, (layout, i))
    finally:
        llm.shutdown()
