"""Qwen2.5-VL through ``LLM`` against transformers' ``Qwen2_5_VLForConditionalGeneration``,
float32: greedy tokens and their logprobs for one image, two images of different sizes
and no image, with chunked prefill splitting image spans, prefix caching (a follow-up
turn reads the image's cached blocks, so their M-RoPE positions come from the table) and
forced preemption (recomputed positions); the vision tower's windows, full-attention
layer and patch merger; M-RoPE against transformers' rotary embedding and the plain-torch
reference; chat content parts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vlm_checks import (
    IMAGE_PROMPTS_MAX_NEW,
    QWEN_ENGINES,
    QWEN_IMAGE,
    check_output,
    greedy_params,
    image_prompts,
    make_images,
    make_llm,
)

from pagedserve.kernels import reference
from pagedserve.models.layers import MRotaryEmbedding
from pagedserve.testing.tiny_vlm import hf_greedy_qwen, png_data_uri, random_image

transformers = pytest.importorskip("transformers")

IMAGE = QWEN_IMAGE
ENGINES = QWEN_ENGINES
PROMPTS = image_prompts(IMAGE)
MAX_NEW = IMAGE_PROMPTS_MAX_NEW


def test_mrope_matches_transformers_and_reference():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding, apply_rotary_pos_emb

    section, head_dim, n = [4, 6, 6], 32, 11
    cfg = transformers.Qwen2_5_VLTextConfig(
        hidden_size=64,
        num_attention_heads=2,
        head_dim=head_dim,
        rope_scaling={"rope_type": "default", "mrope_section": section},
    )
    gen = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 40, (3, n), generator=gen)
    q = torch.randn(n, 2, head_dim, generator=gen)
    k = torch.randn(n, 1, head_dim, generator=gen)
    cos, sin = Qwen2_5_VLRotaryEmbedding(cfg)(q, positions.unsqueeze(1))  # [3, 1, n, d] -> [1, n, d]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    rope = MRotaryEmbedding(head_dim, 64, cfg.rope_parameters["rope_theta"], None, [torch.device("cpu")], section)
    ops = SimpleNamespace(rotary_embedding=reference.rotary_embedding)
    got_q, got_k = rope(ops, 0, positions, q, k)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    ref_q, ref_k = reference.mrope_rotary_embedding(positions, q, k, rope.tables[0], section)
    torch.testing.assert_close(got_q, ref_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, ref_k, atol=1e-6, rtol=1e-6)
    # Three equal positions are plain RoPE.
    same = positions[:1].expand(3, n)
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
    """The prompt's 3-D positions and the delta of later tokens, as transformers'
    get_rope_index computes them, for images of different grids with text around."""
    folder, model = qwen_vl_dir
    llm = make_llm(folder)
    try:
        vision = llm.llm_engine.runner.vision
        prompt = f"x {IMAGE} yy {IMAGE} and {IMAGE} z"
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


@pytest.mark.parametrize("engine_kind", list(ENGINES))
def test_qwen2_5_vl_matches_transformers(engine_kind, qwen_vl_dir):
    folder, model = qwen_vl_dir
    images = {p: make_images(spec) for p, spec in PROMPTS}
    expected = [hf_greedy_qwen(model, folder, p, images[p], n) for (p, _), n in zip(PROMPTS, MAX_NEW)]
    # The image matters: another image behind the same prompt changes the logprobs.
    other = hf_greedy_qwen(model, folder, PROMPTS[2][0], [random_image(99, (40, 52))], 1)
    assert abs(other[2][0] - expected[2][2][0]) > 1e-3
    llm = make_llm(folder, **ENGINES[engine_kind])
    try:
        prompts = [
            {"prompt": p, "multi_modal_data": {"image": images[p]}} if images[p] else {"prompt": p} for p, _ in PROMPTS
        ]
        outs = llm.generate(prompts, [greedy_params(n) for n in MAX_NEW], use_tqdm=False)
        for i, (out, exp) in enumerate(zip(outs, expected)):
            check_output(out, *exp, (engine_kind, i))
        if engine_kind == "preempting":
            assert llm.llm_engine.scheduler.num_preemptions > 0
        runner = llm.llm_engine.runner
        assert len(runner.encoder_cache) == 0 and not runner._mrope  # nothing held once requests finish
    finally:
        llm.shutdown()


def test_image_prefix_caching_positions(qwen_vl_dir):
    """A follow-up turn with the same image hits the image's cached blocks (the encoder
    does not run) and its later tokens still get the positions after the image."""
    folder, model = qwen_vl_dir
    llm = make_llm(folder, max_num_batched_tokens=8, enable_prefix_caching=True, block_size=4)
    cache = llm.llm_engine.runner.encoder_cache
    try:
        a, b = random_image(11, (40, 52)), random_image(12, (40, 52))
        first = f"Here {IMAGE} is a picture."
        out = llm.generate({"prompt": first, "multi_modal_data": {"image": a}}, greedy_params(4), use_tqdm=False)[0]
        assert cache.encoder_runs == 1
        image_id = llm.llm_engine.runner.vision.image_token_id
        image_end = len(out.prompt_token_ids) - out.prompt_token_ids[::-1].index(image_id)
        follow = first + " And now more text after it."
        again = llm.generate({"prompt": follow, "multi_modal_data": {"image": a}}, greedy_params(5), use_tqdm=False)[0]
        check_output(again, *hf_greedy_qwen(model, folder, follow, [a], 5), "same image")
        assert again.num_cached_tokens >= image_end
        assert cache.encoder_runs == 1
        other = llm.generate({"prompt": follow, "multi_modal_data": {"image": b}}, greedy_params(5), use_tqdm=False)[0]
        check_output(other, *hf_greedy_qwen(model, folder, follow, [b], 5), "other image")
        assert cache.encoder_runs == 2
    finally:
        llm.shutdown()


def test_chat_content_parts(qwen_vl_dir):
    folder, model = qwen_vl_dir
    llm = make_llm(folder)
    try:
        img = random_image(21, (40, 52))
        parts = [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": png_data_uri(img)}},
        ]
        out = llm.chat([{"role": "user", "content": parts}], greedy_params(5), use_tqdm=False)[0]
        prompt = "<|im_start|>user\nWhat is this?\n<|image_pad|><|im_end|>\n<|im_start|>assistant\n"
        check_output(out, *hf_greedy_qwen(model, folder, prompt, [img], 5), "chat data uri")
    finally:
        llm.shutdown()
