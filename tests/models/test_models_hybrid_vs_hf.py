"""Hybrid families (Gated DeltaNet, Mamba 1 and 2 or short-convolution layers beside
attention) against transformers,
float32, on tiny random checkpoints built from transformers' own classes: the same
greedy tokens and logprobs through ``LLM`` for a batch of prompts of different lengths,
run whole, in chunks smaller than a DeltaNet chunk (64 tokens) and larger than one,
under preemption (recompute, and swap to the host KV tier), and with ``n=2``.  Their recurrent state lives in state
pages of the KV cache (kv_cache/state_group.py); what cannot work with it is refused.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.testing.tiny_model import write_byte_tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 259  # write_byte_tokenizer: 3 specials + 256 bytes
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
#: Gated DeltaNet shapes (Qwen3.5, Qwen3-Next): 2 key heads of 8, 4 value heads of 12.
DELTANET = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
)

#: name -> (transformers config class, model class, config overrides)
CASES: dict[str, tuple[str, str, dict]] = {
    "qwen3_5-deltanet-gated-attn": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", DELTANET),
    "qwen3_5-tied-mixed-order": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(
            DELTANET,
            tie_word_embeddings=True,
            layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
            linear_num_value_heads=2,
        ),
    ),
    "granite4-mamba2-moe-nope": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(
            layer_types=["mamba", "attention", "mamba", "mamba"],
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_n_groups=2,
            mamba_d_conv=4,
            mamba_expand=1,
            mamba_chunk_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=48,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.3,
            logits_scaling=2.5,
        ),
    ),
    "nemotronh-mamba2-mlp-attn": (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        dict(
            layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention"],
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=8,
            n_groups=2,
            conv_kernel=4,
            chunk_size=32,
            layer_norm_epsilon=1e-5,
        ),
    ),
    "lfm2-shortconv-bias-attn": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(
            layer_types=["conv", "full_attention", "conv", "conv"],
            conv_L_cache=3,
            conv_bias=True,
            norm_eps=1e-5,
            block_multiple_of=32,  # intermediate 96 -> 2/3 of it, rounded up to 32: 64
        ),
    ),
    "lfm2-tied-width4-no-bias": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(
            layer_types=["full_attention", "conv", "conv", "full_attention"],
            conv_L_cache=4,
            norm_eps=1e-5,
            block_auto_adjust_ff_dim=False,
            tie_word_embeddings=True,
        ),
    ),
    "jamba-mamba1-moe-attn": (
        "JambaConfig",
        "JambaForCausalLM",
        dict(
            attn_layer_period=4,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
            num_experts_per_tok=2,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=1,
            mamba_dt_rank=8,
        ),
    ),
    "qwen3_5moe-experts-every-layer": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        dict(
            DELTANET, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=40
        ),
    ),
    "qwen3next-moe-shared-expert": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            DELTANET,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
        ),
    ),
}

COMMON = dict(enable_prefix_caching=False, dtype="float32", kv_cache_memory="16MiB")
ENGINES = {
    # Whole prompts in one step: a batch of different lengths.
    "whole": dict(max_num_batched_tokens=512),
    # Chunks of 8 tokens, smaller than a DeltaNet chunk: the state goes across steps.
    "chunked-small": dict(max_num_batched_tokens=8, block_size=4),
    # Chunks of 80 tokens: the 150-token prompt crosses DeltaNet chunks inside a step too.
    "chunked-large": dict(max_num_batched_tokens=80, block_size=16),
    # 32 pages of 8 tokens, a few of them state pages of each request: preemption is forced.
    "preempting": dict(max_num_batched_tokens=64, block_size=8, num_gpu_blocks_override=32, max_model_len=170),
}

MAX_NEW = [9, 14, 6, 12, 10]


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 19, 31, 150, 5)]


def _init_weights(model, zero_centered: bool) -> None:
    """Wider-than-default weights spread the logits; decays of both signs of A_log and
    dt_bias; norms near 1 (Qwen's ``(1 + w)`` ones: w near 0; its DeltaNet's output norm
    multiplies by w)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if "embed" in name else 0.08))
            elif "A_log" in name or "dt_bias" in name or name.endswith(".D"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.7)
            elif "norm" in name and (not zero_centered or "linear_attn.norm" in name):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:  # biases, (1 + w) norm weights
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def build_checkpoint(path, case: str, **extra):
    config_cls, model_cls, overrides = CASES[case]
    path.mkdir(parents=True, exist_ok=True)
    write_byte_tokenizer(path)
    config = getattr(transformers, config_cls)(**{**BASE, **overrides, **extra})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(config)
    _init_weights(model, config_cls.startswith("Qwen"))
    model.to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


@torch.inference_mode()
def hf_reference(model, prompt: list[int], max_new: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs, one full forward per step (no cache)."""
    ids = list(prompt)
    tokens, logprobs = [], []
    for _ in range(max_new):
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), dim=-1)
        tok = int(lp.argmax())
        tokens.append(tok)
        logprobs.append(float(lp[tok]))
        ids.append(tok)
    return tokens, logprobs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache: dict[str, tuple] = {}

    def get(case: str):
        if case not in cache:
            path = tmp_path_factory.mktemp(case)
            model = build_checkpoint(path, case)
            prompts = _prompts(len(case))
            expected = [hf_reference(model, p, n) for p, n in zip(prompts, MAX_NEW)]
            cache[case] = (path, prompts, expected)
        return cache[case]

    return get


def _check(outs, expected, what: str) -> None:
    for i, (out, (tokens, logprobs)) in enumerate(zip(outs, expected)):
        for got in out.outputs:
            assert got.token_ids == tokens, f"{what}: prompt {i}"
            for j, (tok, entry) in enumerate(zip(got.token_ids, got.logprobs)):
                assert math.isclose(entry[tok].logprob, logprobs[j], abs_tol=2e-4), (what, i, j)


def _cases() -> list:
    """Every family under preemption (its 150-token prompt in 64-token chunks: the state
    carried across steps); the first Qwen3.5 and LFM2 cases under every engine; the rest
    are slow."""
    out = []
    for case in CASES:
        for kind in ENGINES:
            quick = kind == "preempting" or case in ("qwen3_5-deltanet-gated-attn", "lfm2-shortconv-bias-attn")
            out.append(pytest.param(case, kind, marks=() if quick else pytest.mark.slow, id=f"{case}-{kind}"))
    return out


@pytest.mark.parametrize(("case", "engine_kind"), _cases())
def test_hybrid_greedy_and_logprobs_match_transformers(case, engine_kind, checkpoints):
    path, prompts, expected = checkpoints(case)
    llm = LLM(model=str(path), **COMMON, **ENGINES[engine_kind])
    eng = llm.llm_engine
    assert eng.runner.state_pages >= 1 and any(eng.runner.layer_groups)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_NEW]
    for round_ in range(2):  # the second round reuses pages the first one wrote (a stale state must not leak)
        _check(llm.generate(prompts, params, use_tqdm=False), expected, f"{engine_kind} round {round_}")
        assert eng.kv.pool.num_in_use == 0
    eng.kv.pool.check_invariants()
    if engine_kind == "preempting":
        assert eng.scheduler.num_preemptions > 0


@pytest.mark.parametrize("case", ["qwen3_5-deltanet-gated-attn", "lfm2-shortconv-bias-attn", "jamba-mamba1-moe-attn"])
def test_hybrid_n2_samples_each_carry_their_state(checkpoints, case):
    path, prompts, expected = checkpoints(case)
    llm = LLM(model=str(path), **COMMON, **ENGINES["chunked-small"])
    params = [SamplingParams(n=2, temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_NEW]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs) == 2 for o in outs)
    _check(outs, expected, "n=2")


#: The "preempting" engine with a host tier that every preemption swaps to.
SWAPPING = dict(ENGINES["preempting"], preemption_mode="swap", kv_offload_memory="4MiB")


@pytest.mark.parametrize(
    ("case", "prefix"),
    [
        ("qwen3_5-deltanet-gated-attn", False),
        ("lfm2-shortconv-bias-attn", True),
        pytest.param("granite4-mamba2-moe-nope", False, marks=pytest.mark.slow),
        pytest.param("jamba-mamba1-moe-attn", True, marks=pytest.mark.slow),
    ],
)
def test_hybrid_swap_preemption_matches_transformers(case, prefix, checkpoints):
    """Preemption by swap moves every group's pages (attention blocks and state pages)
    to host and back: the same tokens and logprobs as transformers, swaps counted in
    the engine's statistics, and no device or host page left held."""
    path, prompts, expected = checkpoints(case)
    llm = LLM(model=str(path), **dict(COMMON, enable_prefix_caching=prefix), **SWAPPING)
    eng = llm.llm_engine
    kv = eng.kv
    assert kv.host is not None and kv.state_groups
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_NEW]
    for round_ in range(2):
        _check(llm.generate(prompts, params, use_tqdm=False), expected, f"swap round {round_} (prefix {prefix})")
        assert kv.pool.num_in_use == 0 and kv.host.num_in_use == 0
        kv.check_invariants()
    stats = eng.stats()
    assert stats.num_swap_outs > 0 and stats.num_swap_ins == stats.num_swap_outs
    assert stats.kv_blocks_swapped_in == stats.kv_blocks_swapped_out > 0
    # Every swap moved state pages too (a state group's pages are live in every request).
    assert stats.kv_blocks_swapped_out >= stats.num_swap_outs * kv.state_pages * len(kv.state_groups)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        (
            dict(enable_prefix_caching=False, kv_offload_memory="4MiB", preemption_mode="recompute"),
            "kv_offload_memory",
        ),
        (
            dict(
                enable_prefix_caching=False,
                speculative_config={"method": "self_quantized", "num_speculative_tokens": 2},
            ),
            "self_quantized",
        ),
    ],
)
def test_hybrid_refuses_what_a_recurrent_state_cannot_do(checkpoints, settings, named):
    path, _, _ = checkpoints("qwen3_5-deltanet-gated-attn")
    with pytest.raises(ValueError, match="recurrent-state layers") as err:
        LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", **settings)
    assert named in str(err.value)
