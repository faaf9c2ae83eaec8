"""Nemotron-H's MoE layers (``E``, Nemotron 3: sigmoid routing over expert groups with a
score-correction bias, squared-ReLU experts, an optional latent projection, a shared
MLP) against transformers, float32, on tiny random checkpoints built from
``NemotronHConfig``: greedy tokens and logprobs through ``LLM`` beside Mamba 2 and
attention layers, whole and in chunks, under preemption, with prefix hits, and over two
ranks (experts and shared MLP split by intermediate rows)."""

from __future__ import annotations

import pytest
import torch
from test_models_hybrid_prefix_cache import COMMON as PREFIX_COMMON
from test_models_hybrid_prefix_cache import _hit_then_check, cached_references
from test_models_hybrid_vs_hf import BASE, COMMON, ENGINES, MAX_NEW, _check, _init_weights, hf_reference

from pagedserve import LLM, SamplingParams
from pagedserve.testing.tiny_model import write_byte_tokenizer

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "NemotronHConfig"):
    pytest.skip("this transformers has no Nemotron-H", allow_module_level=True)

MOE = dict(
    layers_block_type=["linear_attention", "moe", "full_attention", "moe"],
    mamba_num_heads=4,
    mamba_head_dim=16,
    ssm_state_size=8,
    n_groups=2,
    conv_kernel=4,
    chunk_size=32,
    layer_norm_epsilon=1e-5,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)
CASES = {
    "moe-groups": MOE,
    "moe-latent-unnormalised": dict(MOE, moe_latent_size=24, norm_topk_prob=False, n_group=1, topk_group=1),
}


def build_nemotron_moe(path, case: str):
    path.mkdir(parents=True, exist_ok=True)
    write_byte_tokenizer(path)
    config = transformers.NemotronHConfig(**{**BASE, **CASES[case]})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.NemotronHForCausalLM(config)
    _init_weights(model, zero_centered=False)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a bias that changes the choice of experts
                buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))
    model.to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    return cached_references(tmp_path_factory, build_nemotron_moe)


def _cases() -> list:
    out = []
    for case in CASES:
        for kind in ENGINES:
            quick = kind in ("chunked-small", "preempting") and (case == "moe-groups" or kind == "preempting")
            out.append(pytest.param(case, kind, marks=() if quick else pytest.mark.slow, id=f"{case}-{kind}"))
    return out


@pytest.mark.parametrize(("case", "engine_kind"), _cases())
def test_nemotron_h_moe_matches_transformers(case, engine_kind, nemotron):
    path, prompts, expected = nemotron(case)
    llm = LLM(model=str(path), **COMMON, **ENGINES[engine_kind])
    eng = llm.llm_engine
    assert [layer.kind for layer in eng.runner.model.layers] == CASES[case]["layers_block_type"]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_NEW]
    _check(llm.generate(prompts, params, use_tqdm=False), expected, engine_kind)
    assert eng.kv.pool.num_in_use == 0
    if engine_kind == "preempting":
        assert eng.scheduler.num_preemptions > 0


def test_nemotron_h_moe_prefix_hits(nemotron):
    path, prompts, expected = nemotron("moe-groups", prefix=True)
    eng = LLM(model=str(path), **PREFIX_COMMON, max_num_batched_tokens=20).llm_engine
    _hit_then_check(eng, prompts, expected, "nemotron-h moe")


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=() if c == "moe-groups" else pytest.mark.slow, id=c) for c in CASES]
)
def test_moe_tp2_matches_one_process_and_transformers(case, tmp_path):
    """Two ranks (mp executor, gloo): each keeps its intermediate rows of every expert and
    of the shared MLP, routes from the whole input, and keeps the latent projections whole;
    the layer's one all-reduce sums the partials.  Chunks cross state checkpoints and a
    second round hits them."""
    import torch.distributed as dist
    from test_models_hybrid_tp import MAX_NEW as TP_NEW
    from test_models_hybrid_tp import _prompts as tp_prompts
    from test_models_hybrid_tp import _run, _same

    model = build_nemotron_moe(tmp_path, case)
    expected = [hf_reference(model, p, TP_NEW) for p in tp_prompts(7)]
    one, one_facts = _run(tmp_path)
    _same(one, expected, 2e-4, "one process vs transformers")
    two, two_facts = _run(tmp_path, tensor_parallel_size=2, distributed_executor_backend="mp")
    _same(two, expected, 2e-4, "TP=2 vs transformers")
    _same(two, one, 1e-4, "TP=2 vs one process")
    assert two_facts["hits"] > 0 and one_facts["hits"] > 0 and two_facts["in_use"] == 0
    assert two_facts["state_numel"] * 2 == one_facts["state_numel"]
    assert not dist.is_initialized()


@pytest.mark.parametrize(("key", "size"), [("moe_intermediate_size", 33), ("moe_shared_expert_intermediate_size", 45)])
def test_moe_sizes_the_ranks_cannot_split_are_refused_before_weights_load(key, size):
    from pagedserve.config import EngineConfig
    from pagedserve.config_rules import check_parallel_fits_model
    from pagedserve.models.arch_config import ArchConfig

    hf = transformers.NemotronHConfig(**{**BASE, **MOE, key: size}).to_dict()
    arch = ArchConfig.from_hf(
        {"num_hidden_layers": len(MOE["layers_block_type"]), **hf, "architectures": ["NemotronHForCausalLM"]}
    )
    cfg = EngineConfig()
    cfg.parallel.tensor_parallel_size = 2
    with pytest.raises(ValueError, match="tensor_parallel_size=2 cannot split NemotronHForCausalLM") as err:
        check_parallel_fits_model(cfg, arch)
    assert f"{key} ({size})" in str(err.value)
    cfg.parallel.tensor_parallel_size = 1
    check_parallel_fits_model(cfg, arch)
