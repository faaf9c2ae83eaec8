"""KV cache groups (hybrid-window models) end to end against transformers.

Tiny random Gemma 2 (window / full alternating), Gemma 3 (5 local : 1 global) and Qwen2
(``max_window_layers``) checkpoints, windows of 8 tokens and blocks of 4, generate far
past the window in a pool too small to hold every request's tokens: the windowed
groups free their slid-out blocks, which other requests and groups reuse, while their
table entries point at the null block (NaN here: a kernel that read it would turn the
logprobs into NaN).  Greedy tokens and logprobs must equal transformers' float32 ones
with prefix caching, prefill chunks longer and shorter than the window, preemption,
n-gram drafts (trim) and n > 1; each windowed group of a request holds a bounded number
of blocks and the pool is whole at the end.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.kv_cache.kv_groups import GroupedKVCacheManager
from pagedserve.kv_cache.sliding_window import max_blocks_held

transformers = pytest.importorskip("transformers")

from tests.models.test_models_vs_hf import BASE, VOCAB, _init_weights, hf_reference  # noqa: E402

WINDOW = 8
BS = 4
MAX_LEN = 80
MAX_NEW = [44, 30, 50, 36]

#: name -> (config class, model class, overrides, KV cache groups, KV tensors (slots))
MODELS = {
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(num_hidden_layers=4, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16),
        2,
        2,
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=6,
            head_dim=16,
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
        ),
        6,
        1,
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
        2,
        2,
    ),
}

#: Per engine kind: max_num_batched_tokens and spare pool blocks past one max-length request.
ENGINES = {
    "chunk-over-window": dict(max_num_batched_tokens=13, spare=6),
    "chunk-under-window": dict(max_num_batched_tokens=5, spare=6),
    "ngram-drafts": dict(
        max_num_batched_tokens=16,
        spare=8,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2},
    ),
    # Every preemption swaps every group's blocks to a host tier and back.
    "swap-preemption": dict(max_num_batched_tokens=13, spare=6, preemption_mode="swap", kv_offload_memory="4MiB"),
}


def _prompts() -> list[list[int]]:
    rng = random.Random(23)
    shared = [rng.randrange(3, VOCAB) for _ in range(14)]
    own = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 23, 9, 3)]
    return [own[0], own[1], shared + own[2], shared + own[3]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from pagedserve.testing.tiny_model import write_byte_tokenizer

    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            config_cls, model_cls, overrides, _, _ = MODELS[name]
            path = tmp_path_factory.mktemp(name)
            write_byte_tokenizer(path)
            config = getattr(transformers, config_cls)(**{**BASE, **overrides})
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                model = getattr(transformers, model_cls)(config)
            _init_weights(model, config_cls.startswith("Gemma"))
            model.to(torch.float32).eval()
            model.save_pretrained(path, safe_serialization=True)
            prompts = _prompts()
            cache[name] = (path, prompts, [hf_reference(model, p, n) for p, n in zip(prompts, MAX_NEW)])
        return cache[name]

    return get


def _poison_null_block(llm: LLM) -> None:
    eng = llm.llm_engine
    for k, v in eng.runner.kv_caches:
        for t in (k, v):
            t[eng.kv.null_block.block_id] = float("nan")


def _check(outs, expected, n: int = 1) -> None:
    for i, (out, (tokens, logprobs)) in enumerate(zip(outs, expected)):
        assert len(out.outputs) == n
        for got in out.outputs:
            assert got.token_ids == tokens, f"prompt {i}"
            for j, (tok, entry) in enumerate(zip(got.token_ids, got.logprobs)):
                assert math.isclose(entry[tok].logprob, logprobs[j], abs_tol=2e-4), (i, j)


def _pool_for(name: str, step: int, spare: int) -> int:
    """Blocks for one max-length request (the full-attention group: every block; each
    windowed group: a window's worth) plus the null block and ``spare``."""
    windowed = (MODELS[name][3] - 1) * max_blocks_held(MAX_LEN, BS, WINDOW, step)
    return -(-MAX_LEN // BS) + windowed + 1 + spare


#: Each model with one engine kind in the quick suite; every other pairing is slow.
QUICK = {
    ("gemma2", "chunk-over-window"),
    ("gemma3", "chunk-under-window"),
    ("qwen2", "ngram-drafts"),
    ("gemma3", "swap-preemption"),
}


@pytest.mark.compat("kv_groups", "single")
@pytest.mark.parametrize(
    ("name", "engine_kind"),
    [
        pytest.param(m, e, marks=() if (m, e) in QUICK else pytest.mark.slow, id=f"{m}-{e}")
        for m in MODELS
        for e in ENGINES
    ],
)
def test_long_generation_in_a_small_pool_matches_transformers(name, engine_kind, checkpoints):
    path, prompts, expected = checkpoints(name)
    kw = dict(ENGINES[engine_kind])
    spare = kw.pop("spare")
    step = kw["max_num_batched_tokens"]
    pool_blocks = _pool_for(name, step, spare)
    llm = LLM(
        model=str(path),
        dtype="float32",
        block_size=BS,
        max_model_len=MAX_LEN,
        enable_prefix_caching=True,
        num_gpu_blocks_override=pool_blocks,
        **kw,
    )
    eng = llm.llm_engine
    kv = eng.kv
    assert isinstance(kv, GroupedKVCacheManager) and len(kv.groups) == MODELS[name][3]
    # One KV tensor per slot: the layers of one group share none, the groups share them all.
    assert len({id(k) for k, _ in eng.runner.kv_caches}) == eng.runner.num_kv_tensors == MODELS[name][4]
    assert kv.windows[0] is None and all(w == WINDOW for w in kv.windows[1:])
    _poison_null_block(llm)
    # Together the requests' tokens need far more blocks than the pool has.
    assert sum(len(kv.groups) * -(-(len(p) + n) // BS) for p, n in zip(prompts, MAX_NEW)) > 3 * kv.num_blocks
    bound = max_blocks_held(MAX_LEN, BS, WINDOW, step)
    for i, (p, n) in enumerate(zip(prompts, MAX_NEW)):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
        eng.add_request(f"r{i}", p, params)
    outs = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                outs[out.request_id] = out
        for r in eng.scheduler.running:
            held = kv.group_blocks_held(r.request_id)
            for w, h in zip(kv.windows, held):
                if w is not None:
                    assert h <= bound, (r.request_id, held)
        kv.check_invariants()
    _check([outs[f"r{i}"] for i in range(len(prompts))], expected)
    if "speculative_config" in kw:
        assert eng.stats().spec_decode_num_accepted_tokens > 0
    assert kv.num_blocks_in_use == 0 and not kv.req_blocks
    assert eng.scheduler.num_preemptions > 0  # the pool cannot run all four at once
    kv.check_invariants()
    if "kv_offload_memory" in kw:
        stats = eng.stats()
        assert stats.num_swap_outs > 0 and stats.num_swap_ins == stats.num_swap_outs
        assert stats.kv_blocks_swapped_in == stats.kv_blocks_swapped_out > 0
        assert kv.host.num_in_use == 0


@pytest.mark.parametrize("name", [pytest.param(m, marks=() if m == "gemma3" else pytest.mark.slow) for m in MODELS])
def test_prefix_hits_and_n_samples(name, checkpoints):
    """A second round hits the prefix cache in every group (the windowed groups only
    need the blocks still inside the window); n=2 samples share the prompt's blocks."""
    path, prompts, expected = checkpoints(name)
    llm = LLM(
        model=str(path),
        dtype="float32",
        block_size=BS,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=16,
        num_gpu_blocks_override=_pool_for(name, 16, 120),
        enable_prefix_caching=True,
    )
    eng = llm.llm_engine
    _poison_null_block(llm)
    params = [SamplingParams(n=2, temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_NEW]
    hits = []
    for _ in range(2):
        _check(llm.generate(prompts, params, use_tqdm=False), expected, n=2)
        assert eng.kv.num_blocks_in_use == 0
        hits.append(eng.kv.prefix_hits)
    assert hits[1] > hits[0] > 0
    eng.kv.check_invariants()


def test_freeing_off_keeps_one_group(checkpoints):
    path, prompts, expected = checkpoints("gemma2")
    llm = LLM(
        model=str(path),
        dtype="float32",
        block_size=BS,
        max_model_len=MAX_LEN,
        num_gpu_blocks_override=64,
        free_sliding_window_blocks=False,
    )
    eng = llm.llm_engine
    assert not isinstance(eng.kv, GroupedKVCacheManager) and eng.kv.sliding_window is None
    assert eng.runner.layer_groups is None
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW[2], ignore_eos=True, logprobs=0)
    _check(llm.generate([prompts[2]], params, use_tqdm=False), expected[2:3])


@pytest.mark.parametrize(
    "setting",
    [
        dict(kv_offload_memory="1MiB", kv_cache_memory="4MiB", preemption_mode="recompute"),
        dict(speculative_config={"method": "self_quantized", "num_speculative_tokens": 2}),
    ],
)
def test_unsupported_settings_are_refused(setting, checkpoints):
    path, _, _ = checkpoints("gemma2")
    with pytest.raises(ValueError, match="free_sliding_window_blocks"):
        LLM(model=str(path), dtype="float32", **setting)


@pytest.mark.compat("kv_groups", "pp")
@pytest.mark.compat("kv_groups", "tp_mp")
@pytest.mark.parametrize(
    "parallel",
    [
        dict(pipeline_parallel_size=2),
        pytest.param(dict(tensor_parallel_size=2), marks=pytest.mark.slow),
        # Each rank's host tier holds its slots' share; every preemption swaps.
        pytest.param(
            dict(pipeline_parallel_size=2, preemption_mode="swap", kv_offload_memory="1MiB"), marks=pytest.mark.slow
        ),
    ],
    ids=["pp2", "tp2", "pp2-swap"],
)
def test_tensor_and_pipeline_parallel(parallel, checkpoints):
    """Every rank lays its KV out in the same groups; a pipeline stage allocates only the
    slots of its layers (Gemma 2, 4 layers: each stage has one windowed and one full
    layer, so one slot)."""
    path, prompts, expected = checkpoints("gemma2")
    llm = LLM(
        model=str(path),
        dtype="float32",
        block_size=BS,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=16,
        num_gpu_blocks_override=_pool_for("gemma2", 16, 4),
        distributed_executor_backend="mp",
        **parallel,
    )
    try:
        eng = llm.llm_engine
        assert isinstance(eng.kv, GroupedKVCacheManager)
        if "pipeline_parallel_size" in parallel:
            assert eng.runner.num_kv_tensors == 1 and len(eng.runner.kv_caches) == 2
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_NEW[:3]]
        _check(llm.generate(prompts[:3], params, use_tqdm=False), expected[:3])
        assert eng.kv.num_blocks_in_use == 0 and eng.scheduler.num_preemptions > 0
        if "kv_offload_memory" in parallel:
            assert eng.kv.num_swap_outs > 0 and eng.kv.num_swap_ins == eng.kv.num_swap_outs
            eng.kv.check_invariants()
    finally:
        llm.shutdown()


def test_disaggregated_hand_off_is_refused(checkpoints):
    from pagedserve.serving.disagg import DisaggregatedLLM

    path, _, _ = checkpoints("gemma2")
    with pytest.raises(ValueError, match="free_sliding_window_blocks=False"):
        DisaggregatedLLM(model=str(path), dtype="float32", num_gpu_blocks_override=64, max_model_len=MAX_LEN)


def test_async_scheduling(checkpoints):
    """The pipelined engine hands the executor every group's table as well."""
    path, prompts, expected = checkpoints("gemma2")
    llm = LLM(
        model=str(path),
        dtype="float32",
        block_size=BS,
        max_model_len=MAX_LEN,
        num_gpu_blocks_override=64,
        async_scheduling=True,
    )
    assert isinstance(llm.llm_engine.kv, GroupedKVCacheManager)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_NEW[:2]]
    _check(llm.generate(prompts[:2], params, use_tqdm=False), expected[:2])
    assert llm.llm_engine.kv.num_blocks_in_use == 0
