"""Length-dependent RoPE scalings against transformers: dynamic NTK and longrope (Phi-3).

Tables: pagedserve's cos/sin table for ``max_position`` equals transformers' frequencies
for a sequence of that length (``ROPE_INIT_FUNCTIONS[type](config, seq_len=...)``),
below, at and above the original maximum.

Models (float32, tiny random checkpoints, greedy tokens and logprobs): with
``max_model_len`` at most the original maximum every sequence gets transformers' own
frequencies (unscaled / short factors); with a longer ``max_model_len`` sequences past
the original maximum match transformers' long-sequence frequencies (longrope: the long
factors; dynamic NTK: the base transformers computes once it has seen a sequence of
``max_model_len`` tokens).
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_models_vs_hf import BASE, VOCAB, _init_weights, hf_reference

from pagedserve import LLM, SamplingParams
from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.rope import normalize_rope_scaling, rope_cos_sin_cache
from pagedserve.testing.tiny_model import write_byte_tokenizer

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

ORIGINAL = 32
#: head_dim 16 with partial rotary 0.5: 4 rotary frequencies, so 4 longrope factors each.
LONGROPE = dict(
    rope_type="longrope",
    short_factor=[1.0, 1.3, 1.9, 2.2],
    long_factor=[1.6, 2.5, 3.4, 5.0],
)


def _phi3_config(**extra):
    return transformers.Phi3Config(
        **{**BASE, "max_position_embeddings": 256},
        original_max_position_embeddings=ORIGINAL,
        partial_rotary_factor=0.5,
        rope_scaling=dict(LONGROPE),
        pad_token_id=0,
        **extra,
    )


def _llama_dynamic_config():
    return transformers.LlamaConfig(
        **{**BASE, "max_position_embeddings": ORIGINAL, "num_key_value_heads": 1},
        head_dim=16,
        rope_scaling={"rope_type": "dynamic", "factor": 4.0},
    )


def _reference_table(config, rope_type: str, seq_len: int, rotary_dim: int) -> torch.Tensor:
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)
    assert inv_freq.numel() == rotary_dim // 2
    freqs = torch.outer(torch.arange(seq_len).float(), inv_freq)
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)


@pytest.mark.parametrize("seq_len", [ORIGINAL - 7, ORIGINAL, ORIGINAL + 1, 4 * ORIGINAL])
@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_table_matches_transformers_on_both_sides_of_the_original_length(rope_type, seq_len):
    config = _llama_dynamic_config() if rope_type == "dynamic" else _phi3_config()
    hf = config.to_dict()
    arch = ArchConfig.from_hf({**hf, "architectures": [type(config).__name__.replace("Config", "ForCausalLM")]})
    rotary_dim = 16 if rope_type == "dynamic" else 8
    table = rope_cos_sin_cache(rotary_dim, seq_len, arch.rope_theta, arch.rope_scaling)
    torch.testing.assert_close(table, _reference_table(config, rope_type, seq_len, rotary_dim), rtol=0, atol=1e-6)


def test_dynamic_ntk_extends_the_context_by_its_factor():
    hf = _llama_dynamic_config().to_dict()
    arch = ArchConfig.from_hf({**hf, "architectures": ["LlamaForCausalLM"]})
    assert arch.max_position_embeddings == 4 * ORIGINAL
    assert arch.rope_scaling["original_max_position_embeddings"] == ORIGINAL


@pytest.mark.parametrize(
    "scaling, message",
    [
        ({"rope_type": "dynamic"}, "needs factor >= 1"),
        (
            {"rope_type": "longrope", "short_factor": [1.0], "original_max_position_embeddings": 16},
            "lacks long_factor",
        ),
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, "original_max_position_embeddings"),
    ],
)
def test_incomplete_scaling_fails_at_load_naming_the_field(scaling, message):
    with pytest.raises(ValueError, match=message):
        normalize_rope_scaling(scaling, {"max_position_embeddings": 64})


def test_longrope_factor_count_must_match_the_rotary_dims():
    scaling, _ = normalize_rope_scaling(
        dict(LONGROPE), {"max_position_embeddings": 256, "original_max_position_embeddings": 32}
    )
    with pytest.raises(ValueError, match="4 scaling factors for 8 rotary frequencies"):
        rope_cos_sin_cache(16, 64, 10000.0, scaling)


def _build(path, config, model_cls: str):
    path.mkdir(parents=True, exist_ok=True)
    write_byte_tokenizer(path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(config)
    _init_weights(model, False)
    model.to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def _check(path, prompts, expected, max_new: int, **engine) -> None:
    llm = LLM(
        model=str(path),
        dtype="float32",
        kv_cache_memory="16MiB",
        max_num_batched_tokens=8,
        block_size=4,
        enable_prefix_caching=True,
        **engine,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=0)
    for out, (tokens, logprobs) in zip(llm.generate(prompts, params, use_tqdm=False), expected):
        got = out.outputs[0]
        assert got.token_ids == tokens
        for tok, entry, ref in zip(got.token_ids, got.logprobs, logprobs):
            assert math.isclose(entry[tok].logprob, ref, abs_tol=2e-4)


@pytest.mark.timeout(180)
def test_longrope_phi3_matches_transformers_on_both_sides_of_the_switch(tmp_path):
    model = _build(tmp_path, _phi3_config(), "Phi3ForCausalLM")
    max_new = 5
    # Within the original length: short factors for every sequence, as transformers.
    short = _prompts(1, [1, 13, ORIGINAL - max_new])
    _check(tmp_path, short, [hf_reference(model, p, max_new) for p in short], max_new, max_model_len=ORIGINAL)
    # Past it (max_model_len 256): long factors, as transformers for these lengths.
    long = _prompts(2, [ORIGINAL + 1, 2 * ORIGINAL + 5])
    _check(tmp_path, long, [hf_reference(model, p, max_new) for p in long], max_new)


@pytest.mark.timeout(180)
def test_dynamic_ntk_matches_transformers_on_both_sides_of_the_original_length(tmp_path):
    model = _build(tmp_path, _llama_dynamic_config(), "LlamaForCausalLM")
    max_new = 5
    short = _prompts(3, [1, 17, ORIGINAL - max_new])
    _check(tmp_path, short, [hf_reference(model, p, max_new) for p in short], max_new, max_model_len=ORIGINAL)
    # transformers grows the base to the longest sequence it has run and keeps it for
    # every sequence past the original length: after one forward of max_model_len
    # tokens it uses the table pagedserve builds for max_model_len.
    max_model_len = 2 * ORIGINAL
    with torch.inference_mode():
        model(input_ids=torch.tensor([_prompts(4, [max_model_len])[0]]))
    long = _prompts(5, [ORIGINAL + 1, max_model_len - max_new - 3])
    expected = [hf_reference(model, p, max_new) for p in long]
    _check(tmp_path, long, expected, max_new, max_model_len=max_model_len)
