"""Gemma 4 pieces outside the end-to-end comparison of test_models_vs_hf: the released
checkpoints' per-layer embeddings (PLE), KV sharing and MoE block, each alone and all
together, against transformers (float32, greedy tokens and logprobs) under chunked
prefill, prefix caching, preemption and n=2; the KV cache the sharing layers do not get;
the text decoder of a ``Gemma4ForConditionalGeneration`` checkpoint (vision tower beside
it) against transformers' multimodal model on text prompts; and the refusals by name."""

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

#: Six layers, sliding and full in turn: with two shared layers, layer 4 (sliding) reads
#: layer 2's KV and layer 5 (full) layer 3's.
SIX = dict(
    num_hidden_layers=6,
    layer_types=["sliding_attention", "full_attention"] * 3,
    sliding_window=6,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
PLE = dict(hidden_size_per_layer_input=16, vocab_size_per_layer_input=259)
SHARED = dict(num_kv_shared_layers=2, use_double_wide_mlp=True)
MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
FEATURES = {"ple": PLE, "kv-sharing": SHARED, "moe": MOE}


def _build(path, **overrides):
    from test_models_vs_hf import _init_weights

    from pagedserve.testing.tiny_model import write_byte_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    write_byte_tokenizer(path)
    config = transformers.Gemma4TextConfig(**{**TEXT, **SIX, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.Gemma4ForCausalLM(config)
    _init_weights(model, gemma_norms=False)
    model.to(torch.float32).eval().save_pretrained(path, safe_serialization=True)
    return model


@torch.inference_mode()
def _reference(model, prompt: list[int], max_new: int) -> tuple[list[int], list[float]]:
    """test_models_vs_hf.hf_reference, asking for the hidden states: transformers then
    runs the KV-sharing layers over every position (its shortcut that skips them for all
    but the kept logits fails on a model without PLE), which changes no logit."""
    ids, tokens, logprobs = list(prompt), [], []
    for _ in range(max_new):
        logits = model(input_ids=torch.tensor([ids]), output_hidden_states=True).logits[0, -1].float()
        lp = torch.log_softmax(logits, dim=-1)
        tok = int(lp.argmax())
        tokens.append(tok)
        logprobs.append(float(lp[tok]))
        ids.append(tok)
    return tokens, logprobs


def _expected(model, seed: int):
    from test_models_vs_hf import MAX_NEW, _prompts

    prompts = _prompts(seed)
    return prompts, [_reference(model, p, n) for p, n in zip(prompts, MAX_NEW)]


def _check(llm, prompts, expected, n: int = 1) -> None:
    from test_models_vs_hf import MAX_NEW

    from pagedserve import SamplingParams

    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=0, n=n) for m in MAX_NEW[: len(prompts)]
    ]
    for round_ in range(2):  # the second round hits the prefix cache
        outs = llm.generate(prompts, params, use_tqdm=False)
        for i, (out, (tokens, logprobs)) in enumerate(zip(outs, expected)):
            assert len(out.outputs) == n
            for got in out.outputs:
                assert got.token_ids == tokens, f"prompt {i}, round {round_}"
                for j, (tok, entry) in enumerate(zip(got.token_ids, got.logprobs)):
                    assert math.isclose(entry[tok].logprob, logprobs[j], abs_tol=2e-4), (i, j, round_)
    eng = llm.llm_engine
    assert eng.kv.pool.num_in_use == 0
    eng.kv.pool.check_invariants()
    assert eng.kv.prefix_hits > 0


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_released_feature_matches_transformers(feature, tmp_path):
    """Chunks of 8 tokens over blocks of 4, the prefix cache hit in the second round."""
    from pagedserve import LLM

    model = _build(tmp_path, **FEATURES[feature])
    prompts, expected = _expected(model, len(feature))
    llm = LLM(
        model=str(tmp_path),
        dtype="float32",
        kv_cache_memory="16MiB",
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
        block_size=4,
    )
    _check(llm, prompts, expected)


@pytest.fixture(scope="module")
def all_features(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma4-all")
    model = _build(path, **PLE, **SHARED, **MOE)
    return path, *_expected(model, 7)


def test_all_features_with_preemption_and_n2_match_transformers(all_features):
    """~10 blocks of 8 tokens for 5 requests of up to ~45 tokens (two samples each):
    preemption is forced; each sample is the greedy answer."""
    from pagedserve import LLM

    path, prompts, expected = all_features
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_num_batched_tokens=64,
        enable_prefix_caching=True,
        block_size=8,
        num_gpu_blocks_override=10,
        max_model_len=80,
    )
    _check(llm, prompts, expected, n=2)
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_kv_sharing_layers_get_no_kv_cache(all_features):
    """Layers 4 and 5 read layers 2 and 3's KV: the windowed and the full group hold two
    layers each (slots), not three, so a fixed budget holds 3/2 the blocks."""
    from pagedserve import LLM
    from pagedserve.kv_cache.kv_groups import kv_cache_groups
    from pagedserve.models.layers import layer_windows

    path, prompts, expected = all_features
    budget, block_size = 1 << 20, 4
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory=budget, block_size=block_size)
    eng, runner = llm.llm_engine, llm.llm_engine.runner
    hf = eng.arch.hf_config
    groups = kv_cache_groups(layer_windows(hf, 6))
    assert [g.layers for g in groups] == [(1, 3), (0, 2)]
    unshared = kv_cache_groups(layer_windows({**hf, "num_kv_shared_layers": 0}, 6))
    assert [g.layers for g in unshared] == [(1, 3, 5), (0, 2, 4)]
    # One slot's block: keys and values of the widest heads (2 KV heads of 32).
    per_slot = 2 * block_size * eng.arch.num_kv_heads * eng.arch.head_dim * 4
    assert runner.num_kv_tensors == 2
    assert eng.executor.num_blocks == budget // (2 * per_slot) > budget // (3 * per_slot)
    assert runner.model.kv_sources == [None, None, None, None, 2, 3]
    _check(llm, prompts[:3], expected[:3])


@pytest.mark.parametrize("ple", [0, 16])
def test_text_part_of_a_conditional_generation_checkpoint_matches_transformers(ple, tmp_path):
    from test_models_vs_hf import MAX_NEW, _init_weights, _prompts, hf_reference

    from pagedserve import LLM, SamplingParams
    from pagedserve.testing.tiny_model import write_byte_tokenizer

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    text = {**TEXT, "hidden_size_per_layer_input": ple, "vocab_size_per_layer_input": TEXT["vocab_size"]}
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
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
        ({"num_kv_shared_layers": 3}, "every layer reads keys and values another model computed"),
        ({"num_kv_shared_layers": 2}, r"layer 2 \(full_attention\) shares the KV"),
        ({"enable_moe_block": True, "num_experts": 4, "moe_intermediate_size": 8}, "without top_k_experts"),
        (
            {
                "enable_moe_block": True,
                "num_experts": 4,
                "top_k_experts": 2,
                "moe_intermediate_size": 8,
                "hidden_activation": "gelu",
            },
            "the MoE block with hidden_activation 'gelu'",
        ),  # fmt: skip
        ({"hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 100}, "vocab_size_per_layer_input=100"),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}}, "yarn"),
    ],
)
def test_unimplemented_config_values_are_refused_by_name(change, named):
    types = ["sliding_attention", "full_attention", "full_attention"]
    if change.get("num_kv_shared_layers") == 2:
        types = ["sliding_attention", "sliding_attention", "full_attention"]
    cfg = {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", **TEXT, "layer_types": types, **change}
    with pytest.raises(ValueError, match=named):
        ArchConfig.from_hf(cfg)


def test_pipeline_stages_are_refused_with_per_layer_embeddings(all_features):
    from pagedserve import LLM

    with pytest.raises(ValueError, match="pipeline_parallel_size=2 cannot split Gemma4ForCausalLM: per-layer"):
        LLM(model=str(all_features[0]), pipeline_parallel_size=2)


def test_all_features_with_ngram_drafts_match_transformers(all_features, tmp_path):
    """Prompts that repeat themselves, so that n-gram drafts are proposed (and mostly
    rejected: the KV-sharing layers' sources are rewritten, PLE inputs recomputed)."""
    from pagedserve import LLM

    model = transformers.Gemma4ForCausalLM.from_pretrained(str(all_features[0])).eval()
    prompts = [[5, 6, 7, 8, 9] * 3, [40, 41, 42] * 5 + [40], [100, 101, 102, 103] * 3]
    expected = [_reference(model, p, m) for p, m in zip(prompts, (9, 14, 6))]
    llm = LLM(
        model=str(all_features[0]),
        dtype="float32",
        kv_cache_memory="16MiB",
        block_size=4,
        max_num_batched_tokens=16,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2},
    )
    _check(llm, prompts, expected)
    assert llm.llm_engine.stats().spec_decode_num_draft_tokens > 0


def test_all_features_under_a_device_map(all_features):
    """Two segments: the per-layer inputs move to the second; a sharing layer whose
    source is on another segment is refused before weights load."""
    from pagedserve import LLM

    path, prompts, expected = all_features
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", block_size=4, device_map="cpu:1,cpu")
    _check(llm, prompts[:3], expected[:3])
    with pytest.raises(ValueError, match="layer 4 reads the KV cache of layer 2"):
        LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", device_map="cpu:3,cpu")
