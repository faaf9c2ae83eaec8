"""Falcon-H1 (attention and Mamba 2 side by side in every layer, muP multipliers) against
transformers, float32, on tiny random checkpoints built from ``FalconH1Config``: the same
greedy tokens and logprobs through ``LLM`` for prompts of different lengths, run whole,
in chunks smaller and larger than the Mamba chunk (32 tokens), under preemption
(recompute), with ``n=2`` and with prefix caching (hits on state checkpoints).  Each
checkpoint layer runs as two engine layers: its attention in a KV cache group of token
blocks, its Mamba 2 in a group of state pages.  Two tensor-parallel ranks give the same
tokens and logprobs, and counts the ranks cannot split are refused when the config is
read."""

from __future__ import annotations

import pytest
import torch
from test_models_hybrid_prefix_cache import COMMON as PREFIX_COMMON
from test_models_hybrid_prefix_cache import _hit_then_check, cached_references
from test_models_hybrid_vs_hf import (
    BASE,
    COMMON,
    ENGINES,
    MAX_NEW,
    SWAPPING,
    _check,
    _init_weights,
    hf_reference,
)

from pagedserve import LLM, SamplingParams
from pagedserve.config_rules import RECURRENT_STATE
from pagedserve.models.layers import engine_layer_count, layer_windows
from pagedserve.testing.tiny_model import write_byte_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.falcon_h1")

#: Every multiplier away from 1, so that a missing or misplaced one shows.
MUP = dict(
    embedding_multiplier=1.7,
    lm_head_multiplier=0.6,
    mlp_multipliers=[1.3, 0.7],
    key_multiplier=0.8,
    attention_in_multiplier=1.2,
    attention_out_multiplier=0.9,
    ssm_multipliers=[0.9, 1.1, 1.25, 0.8, 1.3],
    ssm_in_multiplier=1.15,
    ssm_out_multiplier=0.75,
)
MAMBA = dict(
    num_hidden_layers=3,
    mamba_d_ssm=64,  # not mamba_expand * hidden_size (128)
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_n_groups=2,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_chunk_size=32,
)
CASES: dict[str, dict] = {
    # The gated output norm, normalising before the gate (Falcon-H1's own layout).
    "norm-before-gate": dict(MAMBA, **MUP, mamba_rms_norm=True, mamba_norm_before_gate=True),
    # No output norm (y * silu(z)), every bias on, tied embeddings.
    "no-norm-biases-tied": dict(
        MAMBA,
        **MUP,
        mamba_rms_norm=False,
        attention_bias=True,
        mlp_bias=True,
        mamba_proj_bias=True,
        projectors_bias=True,
        mamba_conv_bias=False,
        tie_word_embeddings=True,
    ),
    # The gated norm after the gate (Mamba 2's order), grouped.
    "norm-after-gate": dict(MAMBA, **MUP, mamba_rms_norm=True, mamba_norm_before_gate=False),
}


def build_falcon_h1(path, case: str, **extra):
    path.mkdir(parents=True, exist_ok=True)
    write_byte_tokenizer(path)
    config = transformers.FalconH1Config(**{**BASE, **CASES[case], **extra})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.FalconH1ForCausalLM(config)
    _init_weights(model, zero_centered=False)
    model.to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def falcon(tmp_path_factory):
    return cached_references(tmp_path_factory, build_falcon_h1)


def test_each_layer_is_an_attention_and_a_state_engine_layer():
    hf = {"model_type": "falcon_h1", "num_hidden_layers": 3}
    assert engine_layer_count(hf) == 6
    assert layer_windows(hf, 6) == [None, RECURRENT_STATE] * 3
    with pytest.raises(ValueError, match="6 engine layers"):
        layer_windows(hf, 3)


def _cases() -> list:
    out = []
    for case in CASES:
        for kind in ENGINES:
            quick = case == "norm-before-gate" or (case == "no-norm-biases-tied" and kind == "preempting")
            out.append(pytest.param(case, kind, marks=() if quick else pytest.mark.slow, id=f"{case}-{kind}"))
    return out


@pytest.mark.parametrize(("case", "engine_kind"), _cases())
def test_falcon_h1_greedy_and_logprobs_match_transformers(case, engine_kind, falcon):
    path, prompts, expected = falcon(case)
    llm = LLM(model=str(path), **COMMON, **ENGINES[engine_kind])
    eng = llm.llm_engine
    # Two KV cache groups of three engine layers: attention blocks, then state pages.
    assert eng.runner.layer_groups == [0, 1] * 3 and eng.runner.state_pages >= 1
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_NEW]
    for round_ in range(2):  # the second round reuses pages the first one wrote
        _check(llm.generate(prompts, params, use_tqdm=False), expected, f"{engine_kind} round {round_}")
        assert eng.kv.pool.num_in_use == 0
    eng.kv.pool.check_invariants()
    if engine_kind == "preempting":
        assert eng.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_falcon_h1_swap_preemption_matches_transformers(falcon):
    """Swapped-out requests take both halves' pages to host and back: the attention
    blocks and the Mamba state pages."""
    path, prompts, expected = falcon("norm-before-gate")
    llm = LLM(model=str(path), **COMMON, **SWAPPING)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_NEW]
    _check(llm.generate(prompts, params, use_tqdm=False), expected, "swap")
    stats = llm.llm_engine.stats()
    assert stats.num_swap_outs > 0 and stats.num_swap_ins == stats.num_swap_outs
    assert llm.llm_engine.kv.pool.num_in_use == 0 and llm.llm_engine.kv.host.num_in_use == 0


def test_falcon_h1_n2_samples_each_carry_their_state(falcon):
    path, prompts, expected = falcon("norm-before-gate")
    llm = LLM(model=str(path), **COMMON, **ENGINES["chunked-small"])
    params = [SamplingParams(n=2, temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_NEW]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs) == 2 for o in outs)
    _check(outs, expected, "n=2")


@pytest.mark.parametrize(
    ("case", "chunk"),
    [("norm-before-gate", 20), pytest.param("no-norm-biases-tied", 512, marks=pytest.mark.slow)],
)
def test_falcon_h1_prefix_hits_match_transformers(case, chunk, falcon):
    """A second prompt sharing 45 tokens hits the checkpoint at 40, a short one at 8; the
    attention blocks and the Mamba state both come from the cache."""
    path, prompts, expected = falcon(case, prefix=True)
    eng = LLM(model=str(path), **PREFIX_COMMON, max_num_batched_tokens=chunk).llm_engine
    _hit_then_check(eng, prompts, expected, case)
    assert sum(g.num_checkpoints for g in eng.kv.state_groups) > 0


def test_falcon_h1_refuses_pipeline_stages(falcon):
    path, _, _ = falcon("norm-before-gate")
    with pytest.raises(ValueError, match="cannot split FalconH1ForCausalLM: .*side by side"):
        LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", pipeline_parallel_size=2)


def test_falcon_h1_disaggregated_hand_off_is_refused(falcon):
    """Its engine layers' windows (token blocks and state pages) reach the hand-off's check."""
    from pagedserve.serving.disagg import DisaggregatedLLM

    path, _, _ = falcon("norm-before-gate")
    with pytest.raises(ValueError, match="KV cache groups"):
        DisaggregatedLLM(model=str(path), dtype="float32", kv_cache_memory="16MiB")


def _ngram_prompts() -> tuple[list[list[int]], tuple[int, ...]]:
    """Prompts with a repeated motif (drafts found, some accepted, some rejected) and
    their generation lengths."""
    import random

    rng = random.Random(5)
    motif = [rng.randrange(3, 250) for _ in range(5)]
    noise = [rng.randrange(3, 250) for _ in range(30)]
    return [motif * 4 + noise[:3], noise[:9] + motif * 2, noise[10:30] + motif], (24, 20, 16)


def test_falcon_h1_ngram_speculation_equals_transformers(falcon, tmp_path):
    """n-gram drafts verified through both halves of every layer: the attention blocks of
    rejected drafts are dropped and the Mamba state kept at the last accepted token."""
    from test_models_hybrid_spec import NGRAM, _accepted_and_rejected

    path, _, _ = falcon("norm-before-gate")
    model = transformers.FalconH1ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts, lengths = _ngram_prompts()
    expected = [hf_reference(model, p, n) for p, n in zip(prompts, lengths)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in lengths]
    for budget in (512, 7):
        llm = LLM(model=str(path), **COMMON, max_num_batched_tokens=budget, speculative_config=NGRAM)
        _check(llm.generate(prompts, params, use_tqdm=False), expected, f"ngram, budget {budget}")
        assert llm.llm_engine.kv.pool.num_in_use == 0
        _accepted_and_rejected(llm)


#: TP=2 shapes.  The quick one: every bias, the gated norm before the gate, and one Mamba
#: group for two ranks (each keeps it; the norm's group spans both ranks).
TP_CASES = {
    "biases-one-group": (
        "no-norm-biases-tied",
        dict(mamba_rms_norm=True, mamba_norm_before_gate=True, mamba_n_groups=1, num_key_value_heads=1),
    ),
    "norm-before-gate": ("norm-before-gate", {}),
    "norm-after-gate-one-group": ("norm-after-gate", dict(mamba_n_groups=1)),
    "no-norm-biases-tied": ("no-norm-biases-tied", {}),
}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n == "biases-one-group" else pytest.mark.slow) for n in TP_CASES]
)
def test_falcon_h1_tp2_matches_one_process_and_transformers(name, tmp_path):
    """Two ranks (mp executor, gloo) against transformers and the one-process engine, with
    chunks crossing state checkpoints and prefix hits on them (test_models_hybrid_tp's
    engine and prompts); each rank's state pages hold its share of the state."""
    import test_models_hybrid_tp as tp
    import torch.distributed as dist

    case, extra = TP_CASES[name]
    model = build_falcon_h1(tmp_path, case, **extra)
    expected = [hf_reference(model, p, tp.MAX_NEW) for p in tp._prompts(7)]
    one, one_facts = tp._run(tmp_path)
    tp._same(one, expected, 2e-4, "one process vs transformers")
    two, two_facts = tp._run(tmp_path, tensor_parallel_size=2, distributed_executor_backend="mp")
    tp._same(two, expected, 2e-4, "TP=2 vs transformers")
    tp._same(two, one, 1e-4, "TP=2 vs one process")
    assert two_facts["hits"] > 0 and one_facts["hits"] > 0
    assert two_facts["in_use"] == 0 and two_facts["state_pages"] >= 1
    if extra.get("mamba_n_groups") == 1:  # half the heads, plus the B and C both ranks keep
        assert one_facts["state_numel"] / 2 < two_facts["state_numel"] < one_facts["state_numel"]
    else:
        assert two_facts["state_numel"] * 2 == one_facts["state_numel"]
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (dict(mamba_n_heads=6, mamba_d_head=8, mamba_d_ssm=48, mamba_n_groups=3), "mamba_n_groups=3"),
        (dict(mamba_n_heads=3, mamba_d_head=16, mamba_d_ssm=48, mamba_n_groups=1), "mamba_n_heads=3"),
    ],
)
def test_falcon_h1_counts_the_ranks_cannot_split_are_refused_when_the_config_is_read(extra, named):
    from pagedserve.config import EngineConfig
    from pagedserve.config_rules import check_parallel_fits_model
    from pagedserve.models.arch_config import ArchConfig

    hf = transformers.FalconH1Config(**{**BASE, **CASES["norm-before-gate"], **extra}).to_dict()
    arch = ArchConfig.from_hf({**hf, "architectures": ["FalconH1ForCausalLM"]})
    cfg = EngineConfig()
    cfg.parallel.tensor_parallel_size = 2
    with pytest.raises(ValueError, match="tensor_parallel_size=2 cannot split FalconH1ForCausalLM") as err:
        check_parallel_fits_model(cfg, arch)
    assert named in str(err.value)
    cfg.parallel.tensor_parallel_size = 1  # one rank always
    check_parallel_fits_model(cfg, arch)


@pytest.mark.slow
def test_falcon_h1_tp2_ngram_speculation_matches_transformers(tmp_path):
    """n-gram drafts verified at TP=2: every rank keeps its shard of the Mamba state at the
    last accepted token; a second round hits the checkpoints both ranks wrote."""
    import test_models_hybrid_spec as spec
    import torch.distributed as dist

    model = build_falcon_h1(tmp_path, "no-norm-biases-tied", mamba_rms_norm=True, mamba_n_groups=1)
    prompts, lengths = _ngram_prompts()
    expected = [hf_reference(model, p, n) for p, n in zip(prompts, lengths)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in lengths]
    llm = LLM(
        model=str(tmp_path),
        **spec.COMMON,
        max_num_batched_tokens=7,
        speculative_config=spec.NGRAM,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
    )
    try:
        for round_ in range(2):
            spec._check(llm.generate(prompts, params, use_tqdm=False), expected, f"TP=2 round {round_}")
            assert llm.llm_engine.kv.pool.num_in_use == 0
        spec._accepted_and_rejected(llm)
        assert llm.llm_engine.stats().prefix_cache_hits > 0
    finally:
        llm.shutdown()
    assert not dist.is_initialized()


def test_falcon_h1_through_the_server(falcon, tmp_path):
    """``pagedserve serve`` on a Falcon-H1 checkpoint: concurrent completions with prefix
    caching and 8-token chunks give transformers' logprobs, twice (the second round hits)."""
    from test_models_hybrid_server import MAX_NEW as SERVER_NEW
    from test_models_hybrid_server import check_server_matches

    path, prompts, _ = falcon("norm-before-gate")
    model = transformers.FalconH1ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = prompts[:3]
    check_server_matches(path, prompts, [hf_reference(model, p, SERVER_NEW) for p in prompts], tmp_path)
