"""Gemma 4 pieces outside the end-to-end comparison of test_models_vs_hf: the text
decoder of a ``Gemma4ForConditionalGeneration`` checkpoint (vision tower beside it)
against transformers' multimodal model on text prompts, and the refusals by name."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.models.arch_config import ArchConfig

transformers = pytest.importorskip("transformers")

TEXT = dict(
    vocab_size=259,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    sliding_window=5,
    layer_types=["sliding_attention", "full_attention", "full_attention"],
    hidden_size_per_layer_input=0,
    max_position_embeddings=256,
    final_logit_softcapping=5.0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def test_text_part_of_a_conditional_generation_checkpoint_matches_transformers(tmp_path):
    from test_models_vs_hf import MAX_NEW, _init_weights, _prompts, hf_reference

    from pagedserve import LLM, SamplingParams
    from pagedserve.testing.tiny_model import write_byte_tokenizer

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = transformers.Gemma4Config(text_config=TEXT, vision_config=vision, audio_config=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.Gemma4ForConditionalGeneration(config)
    _init_weights(model, gemma_norms=False)
    model.eval().save_pretrained(tmp_path, safe_serialization=True)
    write_byte_tokenizer(tmp_path)
    prompts = _prompts(4)[1:4]
    expected = [hf_reference(model, p, n) for p, n in zip(prompts, MAX_NEW)]
    llm = LLM(
        model=str(tmp_path),
        dtype="float32",
        kv_cache_memory="16MiB",
        enable_prefix_caching=True,
        block_size=4,
        limit_mm_per_prompt={"image": 0},  # its images are not supported: the text decoder alone
    )
    assert type(llm.llm_engine.runner.model).__name__ == "Gemma4ForCausalLM"
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_NEW[:3]]
    for out, (tokens, logprobs) in zip(llm.generate(prompts, params, use_tqdm=False), expected):
        got = out.outputs[0]
        assert got.token_ids == tokens
        for tok, entry, ref in zip(got.token_ids, got.logprobs, logprobs):
            assert math.isclose(entry[tok].logprob, ref, abs_tol=2e-4)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"hidden_size_per_layer_input": 16}, "per-layer input embeddings"),
        ({"num_kv_shared_layers": 1}, "num_kv_shared_layers"),
        ({"enable_moe_block": True}, "enable_moe_block"),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}}, "yarn"),
    ],
)
def test_unimplemented_config_values_are_refused_by_name(change, named):
    cfg = {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", **TEXT, **change}
    with pytest.raises(ValueError, match=named):
        ArchConfig.from_hf(cfg)
