"""Vision-language checkpoints load their language model for text (--limit-mm-per-prompt
image=0) and match transformers' own ``*ForConditionalGeneration`` on text prompts; those
whose images are not supported yet are refused without image=0, with a message naming
the way out.  And LLaVA variants: a Qwen2 language model, several
feature layers, the "full" (CLS kept) strategy."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.testing.tiny_model import write_byte_tokenizer
from pagedserve.testing.tiny_vlm import build_llava, hf_greedy, init_weights, random_image

transformers = pytest.importorskip("transformers")

TEXT = dict(
    vocab_size=262,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3]}
CASES = {
    "gemma3": lambda: transformers.Gemma3ForConditionalGeneration(
        transformers.Gemma3Config(
            text_config=dict(TEXT, model_type="gemma3_text", sliding_window=8, query_pre_attn_scalar=16),
            vision_config=dict(
                model_type="siglip_vision_model",
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=2,
                num_attention_heads=4,
                image_size=28,
                patch_size=7,
            ),
            mm_tokens_per_image=4,
            image_token_index=259,
            boi_token_index=260,
            eoi_token_index=261,
        )
    ),
    "qwen2.5-vl": lambda: transformers.Qwen2_5_VLForConditionalGeneration(
        transformers.Qwen2_5_VLConfig(
            text_config=dict(TEXT, rope_scaling=MROPE),
            vision_config=dict(
                depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64, patch_size=7
            ),
            image_token_id=259,
            video_token_id=260,
            vision_start_token_id=261,
        )
    ),
    "qwen3-vl": lambda: transformers.Qwen3VLForConditionalGeneration(
        transformers.Qwen3VLConfig(
            text_config=dict(TEXT, rope_scaling={**MROPE, "mrope_interleaved": True}),
            vision_config=dict(
                depth=2,
                hidden_size=32,
                intermediate_size=48,
                num_heads=4,
                out_hidden_size=64,
                patch_size=7,
                num_position_embeddings=16,
                deepstack_visual_indexes=[0],
            ),
            image_token_id=259,
            video_token_id=260,
            vision_start_token_id=261,
        )
    ),
    "smolvlm": lambda: transformers.SmolVLMForConditionalGeneration(
        transformers.SmolVLMConfig(
            text_config=dict(TEXT, model_type="llama"),
            vision_config=dict(
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=2,
                num_attention_heads=4,
                image_size=28,
                patch_size=7,
            ),
            scale_factor=2,
            image_token_id=259,
        )
    ),
}


#: Cases whose images are supported (tests/multimodal/test_qwen2_5_vl.py, test_qwen3_vl.py,
#: test_gemma3.py, test_smolvlm.py): not refused without image=0.
WITH_IMAGES = {"qwen2.5-vl", "qwen3-vl", "gemma3", "smolvlm"}


@torch.inference_mode()
def _reference(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    cur, tokens, logprobs = list(ids), [], []
    for _ in range(n):
        lp = torch.log_softmax(model(input_ids=torch.tensor([cur])).logits[0, -1].float(), dim=-1)
        tok = int(lp.argmax())
        tokens.append(tok)
        logprobs.append(float(lp[tok]))
        cur.append(tok)
    return tokens, logprobs


@pytest.mark.parametrize("case", list(CASES))
def test_language_model_of_a_vision_checkpoint(case, tmp_path):
    write_byte_tokenizer(tmp_path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = CASES[case]()
    init_weights(model)
    model.to(torch.float32).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    arch = type(model).__name__
    kw = dict(dtype="float32", kv_cache_memory=2**22, max_model_len=128, block_size=4, max_num_batched_tokens=8)
    if case not in WITH_IMAGES:
        with pytest.raises(ValueError, match=rf"images are not supported for {arch} yet.*image=0"):
            LLM(str(tmp_path), **kw)
    llm = LLM(str(tmp_path), limit_mm_per_prompt="image=0", **kw)
    try:
        ids = [5, 17, 9, 33, 60, 7, 8, 90, 11, 12, 140, 3, 44]
        tokens, logprobs = _reference(model, ids, 6)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
        got = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
        assert list(got.token_ids) == tokens
        for j, (tok, entry) in enumerate(zip(got.token_ids, got.logprobs)):
            assert math.isclose(entry[tok].logprob, logprobs[j], abs_tol=2e-4), j
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "text_type, layers, strategy",
    [("qwen2", [-1, -3], "default"), ("mistral", -1, "full")],
)
def test_llava_variants(text_type, layers, strategy, tmp_path):
    model = build_llava(tmp_path, text_type, vision_feature_layer=layers, vision_feature_select_strategy=strategy)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=2**22, max_model_len=256)
    try:
        prompt, images = "a <image> b <image> c", [random_image(51), random_image(52)]
        ids, tokens, logprobs = hf_greedy(model, tmp_path, prompt, images, 6)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, params, use_tqdm=False)[0]
        assert out.prompt_token_ids == ids
        assert ids.count(llm.llm_engine.runner.vision.image_token_id) == 2 * (16 + (strategy == "full"))
        got = out.outputs[0]
        assert list(got.token_ids) == tokens
        for j, (tok, entry) in enumerate(zip(got.token_ids, got.logprobs)):
            assert math.isclose(entry[tok].logprob, logprobs[j], abs_tol=2e-4), j
    finally:
        llm.shutdown()
