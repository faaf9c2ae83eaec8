"""Every registered family against transformers, float32: tiny random-weight checkpoints
built from transformers' own config and model classes (no download) give the same greedy
tokens and the same logprobs through ``LLM``, with prefix caching and chunked prefill on,
and when a small KV budget forces preemption.

Shapes stress each family's features: sliding windows shorter than the prompts (and
than a prefill chunk's context), odd head sizes, GQA, biases, per-head norms.
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
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

#: name -> (transformers config class, model class, config overrides)
CASES: dict[str, tuple[str, str, dict]] = {
    "llama-head24": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=24)),
    "qwen2-bias-yarn": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            num_key_value_heads=1,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        ),
    ),
    "qwen2-window-upper-layers": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=7, max_window_layers=1),
    ),
    "qwen3-qknorm-head40": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=40)),
    "qwen3-tied-mha": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(num_key_value_heads=4, head_dim=16, tie_word_embeddings=True),
    ),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=6, head_dim=16)),
    "granite-multipliers": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.5),
    ),
    "smollm3-nope": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(no_rope_layer_interval=2, head_dim=16, pad_token_id=0),
    ),
    "phi3-partial-rotary-window": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(partial_rotary_factor=0.5, sliding_window=9, pad_token_id=0),
    ),
    "olmo2-postnorm": ("Olmo2Config", "Olmo2ForCausalLM", dict(pad_token_id=0)),
    "olmo3-window-per-type-rope": (
        "Olmo3Config",
        "Olmo3ForCausalLM",
        dict(
            pad_token_id=0,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                    "rope_theta": 20000.0,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
            },
        ),
    ),
    "glm4-interleaved-partial-rope": ("Glm4Config", "Glm4ForCausalLM", dict(head_dim=24, pad_token_id=0)),
    "starcoder2-layernorm-window": (
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        dict(sliding_window=8, norm_epsilon=1e-5, pad_token_id=0),
    ),
    "mixtral-top2-window": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=10),
    ),
    "qwen2moe-shared-dense-layer": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            shared_expert_intermediate_size=72,
            mlp_only_layers=[1],
        ),
    ),
    "qwen3moe-qknorm": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=24, norm_topk_prob=True),
    ),
    "deepseekv2-lite-mla": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=24,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
        ),
    ),
    "deepseekv2-qlora-grouped-yarn": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            num_key_value_heads=4,
            q_lora_rank=20,
            kv_lora_rank=16,
            qk_nope_head_dim=12,
            qk_rope_head_dim=12,
            v_head_dim=32,
            n_routed_experts=6,
            num_experts_per_tok=2,
            n_group=3,
            topk_group=2,
            topk_method="group_limited_greedy",
            n_shared_experts=1,
            moe_intermediate_size=24,
            first_k_dense_replace=0,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
        ),
    ),
    "deepseekv3-groups-yarn": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_key_value_heads=4,
            q_lora_rank=20,
            kv_lora_rank=16,
            qk_nope_head_dim=12,
            qk_rope_head_dim=8,
            v_head_dim=20,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            moe_intermediate_size=24,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
                "rope_theta": 10000.0,
            },
        ),
    ),
    "deepseekv3-rotate-half-unnormalised": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=24,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=6,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=2,
            moe_intermediate_size=32,
            first_k_dense_replace=0,
            norm_topk_prob=False,
            rope_interleave=False,
        ),
    ),
    "gptoss-sinks-window-moe": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            head_dim=64,
            intermediate_size=36,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            num_local_experts=4,
            num_experts_per_tok=2,
            swiglu_limit=1.0,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
                "rope_theta": 150000.0,
            },
        ),
    ),
    "gemma-head24": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=24, hidden_act="gelu_pytorch_tanh")),
    "gemma2-window-softcap": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=24,
            sliding_window=5,
            query_pre_attn_scalar=20,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
        ),
    ),
    "gemma3-window-local-rope": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=24,
            sliding_window=6,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
    ),
    "gemma4-global-heads-proportional-rope": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            head_dim=16,
            global_head_dim=32,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            num_hidden_layers=4,
            hidden_size_per_layer_input=0,
            final_logit_softcapping=5.0,
        ),
    ),
    "gemma4-k-eq-v-global-kv-heads": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            head_dim=24,
            global_head_dim=40,
            attention_k_eq_v=True,
            num_global_key_value_heads=1,
            sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            hidden_size_per_layer_input=0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 20000.0},
            },
        ),
    ),
}

ENGINES = {
    # Chunks of 8 tokens: windows end inside earlier chunks and inside cached blocks.
    "chunked+prefix": dict(max_num_batched_tokens=8, enable_prefix_caching=True, block_size=4),
    # ~10 blocks of 8 tokens for 5 requests of up to ~45 tokens: preemption is forced.
    "preempting": dict(
        max_num_batched_tokens=64,
        enable_prefix_caching=True,
        block_size=8,
        num_gpu_blocks_override=10,
        max_model_len=80,
    ),
}

MAX_NEW = [9, 14, 6, 12, 10]


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(11)]
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 19, 31)]
    return prompts + [shared + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 8)]


def _init_weights(model, gemma_norms: bool) -> None:
    """Wider-than-default weights spread the logits, so greedy choices are not near-ties."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if "embed" in name else 0.08))
            elif "sinks" in name:  # GPT-OSS's per-head sink logits: some heads mostly attend to the sink
                p.copy_(torch.randn(p.shape, generator=gen) * 2.0)
            elif "bias" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:  # norm weights, applied as (1 + w) by Gemma, as w elsewhere
                p.copy_((0.0 if gemma_norms else 1.0) + 0.1 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:  # DeepSeek-V3's routing biases (zeros when built)
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
            elif name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale (ones when built)
                b.copy_(0.6 + 0.8 * torch.rand(b.shape, generator=gen))


def build_checkpoint(path, case: str, **extra):
    config_cls, model_cls, overrides = CASES[case]
    path.mkdir(parents=True, exist_ok=True)
    write_byte_tokenizer(path)
    config = getattr(transformers, config_cls)(**{**BASE, **overrides, **extra})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(config)
    # Gemma 1-3 norms multiply by (1 + w); Gemma 4's by w, as everyone else's.
    _init_weights(model, config_cls.startswith("Gemma") and not config_cls.startswith("Gemma4"))
    model.to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


@torch.inference_mode()
def hf_reference(model, prompt: list[int], max_new: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs, one full forward per step (no KV cache, so the
    reference does not depend on transformers' cache for windowed layers)."""
    ids = list(prompt)
    tokens, logprobs = [], []
    for _ in range(max_new):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        lp = torch.log_softmax(logits, dim=-1)
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


@pytest.mark.parametrize("engine_kind", list(ENGINES))
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_and_logprobs_match_transformers(case, engine_kind, checkpoints):
    path, prompts, expected = checkpoints(case)
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", **ENGINES[engine_kind])
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_NEW]
    eng = llm.llm_engine
    for round_ in range(2):  # the second round hits the prefix cache
        outs = llm.generate(prompts, params, use_tqdm=False)
        for i, (out, (tokens, logprobs)) in enumerate(zip(outs, expected)):
            got = out.outputs[0]
            assert got.token_ids == tokens, f"prompt {i}, round {round_}"
            for j, (tok, entry) in enumerate(zip(got.token_ids, got.logprobs)):
                assert math.isclose(entry[tok].logprob, logprobs[j], abs_tol=2e-4), (i, j, round_)
        assert eng.kv.pool.num_in_use == 0
    eng.kv.pool.check_invariants()
    assert eng.kv.prefix_hits > 0
    if engine_kind == "preempting":
        assert eng.scheduler.num_preemptions > 0
