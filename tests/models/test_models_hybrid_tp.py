"""Tensor and pipeline parallelism for hybrid families (Gated DeltaNet, Mamba 1 and 2 or
short-convolution layers beside attention), float32, on the tiny random checkpoints of
test_models_hybrid_vs_hf.py: two ranks (mp executor, gloo) give transformers' greedy
tokens and logprobs, and the one-process engine's, with chunked prefill (chunks that
cross state checkpoints) and prefix caching (a second round hits the checkpoints every
rank wrote into its own shard of the state pages).  Each rank's state pages hold only
its share of the state.  Counts the ranks cannot split are refused when the config is
read, naming the count.
"""

from __future__ import annotations

import math
import random

import pytest
import test_models_hybrid_vs_hf as vs_hf
import torch.distributed as dist
from test_models_hybrid_vs_hf import BASE, CASES, DELTANET, VOCAB, build_checkpoint, hf_reference

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.config_rules import check_kv_cache_groups, check_parallel_fits_model
from pagedserve.models.arch_config import ArchConfig
from pagedserve.models.layers import layer_windows

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(180)

#: Families sharded over two ranks here; the first runs in the quick suite (about 30 s
#: on 2 busy cores: a one-process engine, then two ranks), the others are slow.
TP_CASES = [
    "qwen3_5-deltanet-gated-attn",
    "granite4-mamba2-moe-nope",
    "jamba-mamba1-moe-attn",
    "lfm2-shortconv-bias-attn",
    "nemotronh-mamba2-mlp-attn",
    "qwen3_5moe-experts-every-layer",
    "qwen3next-moe-shared-expert",
]
QUICK = ("qwen3_5-deltanet-gated-attn",)
#: More shapes: one Mamba 2 group for two ranks (each keeps it; the gated norm's group
#: spans both ranks, as in Granite 4.0-H); a KV head and a DeltaNet key head per rank.
EXTRA = {
    "granite4-one-group": ("granite4-mamba2-moe-nope", dict(mamba_n_groups=1)),
    "nemotronh-one-group": ("nemotronh-mamba2-mlp-attn", dict(n_groups=1)),
    "qwen3_5-kv1": ("qwen3_5-deltanet-gated-attn", dict(num_key_value_heads=1)),
}

#: Blocks of 4 tokens, a state checkpoint every 2 blocks (8 tokens), chunks of 20 tokens
#: (checkpoints inside chunks and chunk ends between them).
ENGINE = dict(
    dtype="float32",
    kv_cache_memory="16MiB",
    block_size=4,
    state_checkpoint_interval=2,
    max_num_batched_tokens=20,
    enable_prefix_caching=True,
)
MAX_NEW = 6


def _prompts(seed: int) -> list[list[int]]:
    """A (37 tokens), a short one, a one-token one; then B sharing A's first 29 tokens
    (a hit at 24) and A again (a hit at 32)."""
    rng = random.Random(seed)
    a = [rng.randrange(3, VOCAB) for _ in range(37)]
    b = a[:29] + [rng.randrange(3, VOCAB) for _ in range(8)]
    return [a, [rng.randrange(3, VOCAB) for _ in range(5)], [rng.randrange(3, VOCAB)], b, a]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs: the first three prompts, then the last two (hits)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    out = []
    for part in (prompts[:3], prompts[3:]):
        for o in llm.generate(part, params, use_tqdm=False):
            got = o.outputs[0]
            out.append((list(got.token_ids), [entry[tok].logprob for tok, entry in zip(got.token_ids, got.logprobs)]))
    return out


def _same(got, want, tol: float, what: str) -> None:
    for i, ((tokens, lps), (ref_tokens, ref_lps)) in enumerate(zip(got, want)):
        assert tokens == ref_tokens, f"{what}: prompt {i}"
        for j, (a, b) in enumerate(zip(lps, ref_lps)):
            assert math.isclose(a, b, abs_tol=tol), (what, i, j, a, b)


def _run(path, **parallel) -> tuple[list, dict]:
    prompts = _prompts(7)
    llm = LLM(model=str(path), **ENGINE, **parallel)
    try:
        eng = llm.llm_engine
        hits = eng.kv.prefix_hits
        out = _generate(llm, prompts)
        facts = dict(
            hits=eng.kv.prefix_hits - hits,
            state_pages=eng.runner.state_pages,
            state_numel=eng.runner.model.state.numel,
            in_use=eng.kv.pool.num_in_use,
            layers=(eng.runner.model.layer_start, eng.runner.model.layer_end),
        )
    finally:
        llm.shutdown()
    return out, facts


@pytest.mark.parametrize(
    ("case", "extra"),
    [pytest.param(c, {}, marks=() if c in QUICK else pytest.mark.slow, id=c) for c in TP_CASES]
    + [pytest.param(c, x, marks=pytest.mark.slow, id=name)
       for name, (c, x) in EXTRA.items()],
)  # fmt: skip
def test_tp2_matches_one_process_and_transformers(case, extra, tmp_path):
    model = build_checkpoint(tmp_path, case, **extra)
    expected = [hf_reference(model, p, MAX_NEW) for p in _prompts(7)]
    one, one_facts = _run(tmp_path)
    _same(one, expected, 2e-4, "one process vs transformers")
    two, two_facts = _run(tmp_path, tensor_parallel_size=2, distributed_executor_backend="mp")
    _same(two, expected, 2e-4, "TP=2 vs transformers")
    _same(two, one, 1e-4, "TP=2 vs one process")
    assert two_facts["hits"] > 0 and one_facts["hits"] > 0
    assert two_facts["in_use"] == 0 and two_facts["state_pages"] >= 1
    # Each rank's state pages hold its share of a layer's state: half of it, or half plus
    # the B and C channels of the one Mamba 2 group both ranks keep.
    if extra.get("mamba_n_groups") == 1 or extra.get("n_groups") == 1:
        assert one_facts["state_numel"] / 2 < two_facts["state_numel"] < one_facts["state_numel"]
    else:
        assert two_facts["state_numel"] * 2 == one_facts["state_numel"]
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "case",
    [
        pytest.param("qwen3_5-tied-mixed-order", marks=pytest.mark.slow),
        pytest.param("granite4-mamba2-moe-nope", marks=pytest.mark.slow),
        pytest.param("jamba-mamba1-moe-attn", marks=pytest.mark.slow),
    ],
)
def test_pp2_matches_one_process_and_transformers(case, tmp_path):
    """Two stages of two layers each, every stage with attention and recurrent layers or
    only one kind (each allocates the slots of its own layers)."""
    model = build_checkpoint(tmp_path, case)
    expected = [hf_reference(model, p, MAX_NEW) for p in _prompts(7)]
    two, facts = _run(tmp_path, pipeline_parallel_size=2, distributed_executor_backend="mp")
    _same(two, expected, 2e-4, "PP=2 vs transformers")
    assert facts["hits"] > 0 and facts["in_use"] == 0
    assert facts["layers"] == (0, 2)  # rank 0 holds the first stage's two layers
    assert not dist.is_initialized()


@pytest.mark.slow
def test_tp2_swap_preemption_matches_transformers(tmp_path):
    """Swap preemption under TP=2: every rank copies its shard of the request's attention
    blocks and state pages to its own host pages and back."""
    model = build_checkpoint(tmp_path, "qwen3_5-deltanet-gated-attn")
    prompts = vs_hf._prompts(3)  # lengths 1 to 150 against 32 pages of 8 tokens
    expected = [hf_reference(model, p, n) for p, n in zip(prompts, vs_hf.MAX_NEW)]
    swap = dict(vs_hf.ENGINES["preempting"], preemption_mode="swap", kv_offload_memory="4MiB")
    llm = LLM(
        model=str(tmp_path),
        **dict(vs_hf.COMMON, enable_prefix_caching=False),
        **swap,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
    )
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in vs_hf.MAX_NEW]
        outs = llm.generate(prompts, params, use_tqdm=False)
        got = [
            (
                list(o.outputs[0].token_ids),
                [e[t].logprob for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
            )
            for o in outs
        ]
        _same(got, expected, 2e-4, "TP=2 with swap preemption vs transformers")
        stats = llm.llm_engine.stats()
        assert stats.num_swap_outs > 0 and stats.num_swap_ins == stats.num_swap_outs
        assert llm.llm_engine.kv.pool.num_in_use == 0 and llm.llm_engine.kv.host.num_in_use == 0
    finally:
        llm.shutdown()
    assert not dist.is_initialized()


def _hf(case: str, **extra) -> dict:
    config_cls, model_cls, overrides = CASES[case]
    cfg = getattr(transformers, config_cls)(**{**BASE, **overrides, **extra}).to_dict()
    # NemotronHConfig keeps its layer count in its block pattern (the loader reads it so).
    return {"num_hidden_layers": BASE["num_hidden_layers"], **cfg, "architectures": [model_cls]}


@pytest.mark.parametrize(
    ("case", "extra", "named"),
    [
        (
            "qwen3_5-deltanet-gated-attn",
            dict(linear_num_key_heads=1, linear_num_value_heads=2),
            "linear_num_key_heads=1",
        ),
        ("qwen3next-moe-shared-expert", dict(DELTANET, linear_num_key_heads=3, linear_num_value_heads=6), "key heads"),
        ("granite4-mamba2-moe-nope", dict(shared_intermediate_size=45), "shared_intermediate_size (45)"),
        ("nemotronh-mamba2-mlp-attn", dict(mamba_num_heads=6, n_groups=3), "n_groups=3"),
        ("nemotronh-mamba2-mlp-attn", dict(mamba_num_heads=3, n_groups=1), "mamba_num_heads=3"),
        ("jamba-mamba1-moe-attn", dict(hidden_size=63), "mamba_expand * hidden_size = 63"),
        ("lfm2-shortconv-bias-attn", dict(hidden_size=63), "hidden_size=63"),
    ],
)
def test_counts_the_ranks_cannot_split_are_refused_when_the_config_is_read(case, extra, named):
    cfg = EngineConfig()
    cfg.parallel.tensor_parallel_size = 2
    arch = ArchConfig.from_hf(_hf(case, **extra))
    with pytest.raises(ValueError, match="tensor_parallel_size=2 cannot split") as err:
        check_parallel_fits_model(cfg, arch)
    assert named in str(err.value)
    # The same config splits over ranks that divide its counts; one rank always.
    cfg.parallel.tensor_parallel_size = 1
    check_parallel_fits_model(cfg, arch)
    check_kv_cache_groups(cfg, layer_windows(arch.hf_config, arch.num_layers))


def test_the_recurrent_rule_no_longer_refuses_parallelism():
    arch = ArchConfig.from_hf(_hf("qwen3_5-deltanet-gated-attn"))
    windows = layer_windows(arch.hf_config, arch.num_layers)
    for tp, pp in ((2, 1), (1, 2)):
        cfg = EngineConfig()
        cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size = tp, pp
        check_parallel_fits_model(cfg, arch)
        check_kv_cache_groups(cfg, windows)


def test_tp2_ngram_speculation_matches_transformers(tmp_path):
    """n-gram drafts verified at TP=2: every rank captures its shard of the state after
    each draft position and keeps the one at the last accepted token."""
    import test_models_hybrid_spec as spec

    model = build_checkpoint(tmp_path, "qwen3_5-deltanet-gated-attn")
    prompts = spec._prompts(len("qwen3_5-deltanet-gated-attn"))
    expected = [hf_reference(model, p, n) for p, n in zip(prompts, spec.MAX_NEW)]
    llm = LLM(
        model=str(tmp_path),
        **spec.COMMON,
        max_num_batched_tokens=7,
        speculative_config=spec.NGRAM,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
    )
    try:
        for round_ in range(2):  # the second round hits the checkpoints both ranks wrote
            spec._check(llm.generate(prompts, spec._params(), use_tqdm=False), expected, f"TP=2 round {round_}")
            assert llm.llm_engine.kv.pool.num_in_use == 0
        spec._accepted_and_rejected(llm)
        assert llm.llm_engine.stats().prefix_cache_hits > 0
    finally:
        llm.shutdown()
    assert not dist.is_initialized()
