"""Hybrid models (recurrent-state layers beside attention) with an 8-bit KV cache, and
under a device map, on the tiny random float32 checkpoints of test_models_hybrid_vs_hf.py.

With ``kv_cache_dtype`` int8 or fp8 the attention layers' keys and values are 8-bit
rows with their scales, while the recurrent layers' state stays in the model's dtype,
laid over their state pages as bytes (``models.recurrent.StateLayout``): so the state
pages per request follow from bytes, and the engine stays within the bounds of the
quantized-KV engine tests of the model-dtype cache (prompt logprob distributions, top-1
and greedy agreement).  Prefix-cache hits, chunked prefill, preemption (recompute, and
swap through a host tier) and ``n=2`` give the tokens and logprobs of the same 8-bit
engine run plainly.  ``device_map="cpu:2,cpu"`` (each segment its own slot tensors and
state pages) gives one device's tokens and logprobs.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_models_hybrid_vs_hf import VOCAB, build_checkpoint

from pagedserve import LLM, SamplingParams
from pagedserve.models.recurrent import StateLayout

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(900)

QWEN = "qwen3_5-deltanet-gated-attn"
MAMBA2 = "nemotronh-mamba2-mlp-attn"
KV8 = ["int8", "fp8_e4m3", "fp8_e5m2"]
BASE = dict(dtype="float32", kv_cache_memory="16MiB")

#: The bounds of tests/kv_cache/test_kv_cache_dtype_engine.py (rows with their scales) on
#: the logprob distributions of the prompts' positions against the model-dtype cache.
BOUNDS = {
    "int8": dict(max_abs=0.04, kl=3e-5),
    "fp8_e4m3": dict(max_abs=0.18, kl=0.001),
    "fp8_e5m2": dict(max_abs=0.35, kl=0.0035),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cache: dict[str, object] = {}

    def get(case: str):
        if case not in cache:
            path = tmp_path_factory.mktemp(case)
            build_checkpoint(path, case)
            cache[case] = path
        return cache[case]

    return get


def _prompts(seed: int, lengths=(1, 19, 31, 70, 5)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def _prompt_rows(llm: LLM, prompts) -> list[torch.Tensor]:
    """Each prompt's full next-token log-distributions ([len - 1, vocab] float32)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=-1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.prompt_logprob_rows for o in outs]


MAX_NEW = [20, 24, 16, 24, 20]  # long enough to preempt in the 30-page pools below


def _params(n: int = 1) -> list[SamplingParams]:
    return [SamplingParams(n=n, temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=0) for m in MAX_NEW]


def _greedy(llm: LLM, prompts, n: int = 1):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(n)[: len(prompts)], use_tqdm=False)
    return outs


def _same(outs, want, what: str, tol: float = 2e-4) -> float:
    """Every sample of ``outs`` has the tokens of ``want``'s first and their logprobs;
    the largest logprob difference."""
    worst = 0.0
    for i, (out, ref) in enumerate(zip(outs, want)):
        ref = ref.outputs[0]
        for got in out.outputs:
            assert got.token_ids == ref.token_ids, f"{what}: prompt {i}"
            for j, tok in enumerate(got.token_ids):
                a, b = got.logprobs[j][tok].logprob, ref.logprobs[j][tok].logprob
                assert math.isclose(a, b, abs_tol=tol), (what, i, j, a, b)
                worst = max(worst, abs(a - b))
    return worst


#: Logprob tolerance of the same 8-bit engine run another way: a key computed in another
#: batch shape may differ in its last float32 bit and round to the neighbouring 8-bit
#: value (measured: up to 2.1e-4 with e5m2's 2 mantissa bits in the preempting engines).
SAME_TOL = {"int8": 2e-4, "fp8_e4m3": 1e-3, "fp8_e5m2": 1e-3}


def _no_leaks(llm: LLM) -> None:
    kv = llm.llm_engine.kv
    assert kv.pool.num_in_use == 0
    kv.check_invariants()


# ---- the state over 8-bit pages ----------------------------------------------------------


@pytest.mark.parametrize("cache", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
@pytest.mark.parametrize("state", [torch.float32, torch.bfloat16])
def test_state_lies_over_any_cache_as_bytes(cache, state):
    """A state written over pages of an 8-bit (or 16-bit) cache reads back bit for bit in
    its own dtype (fp8 NaN byte patterns included); pages of other requests keep their
    bytes; a row without a state reads zeros."""
    gen = torch.Generator().manual_seed(1)
    # 12 pages of [block 4, 2 heads, 20 bytes (16 values + a 4-byte scale)] per key and value.
    shape = (12, 4, 2, 20 if cache.itemsize == 1 else 16)
    k = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(cache) if cache.itemsize == 1 else None
    if k is None:
        k = torch.randn(shape, generator=gen).to(cache)
    v = k.clone()
    before_k, before_v = k.view(torch.uint8).clone(), v.view(torch.uint8).clone()
    layout = StateLayout([(6, 3), (2, 8, 5)], state)  # 98 values
    page = 2 * shape[1] * shape[2] * shape[3] * cache.itemsize
    pages = -(-layout.nbytes(cache) // page)
    assert pages == (2 if cache.itemsize == 1 and state == torch.float32 else 1)
    tables = torch.tensor([[3, 7][:pages], [10, 1][:pages]], dtype=torch.int32)
    want = [torch.randn(2, 6, 3, generator=gen), torch.randn(2, 2, 8, 5, generator=gen)]
    layout.write((k, v), tables, want)
    got = layout.read((k, v), tables, torch.tensor([True, True]))
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        assert torch.equal(g, w.to(state).float())
    untouched = [p for p in range(12) if p not in tables.flatten().tolist()]
    assert torch.equal(k.view(torch.uint8)[untouched], before_k[untouched])
    assert torch.equal(v.view(torch.uint8)[untouched], before_v[untouched])
    zeros = layout.read((k, v), tables, torch.tensor([False, True]))
    assert all(not z[0].any() for z in zeros) and torch.equal(zeros[1][1], want[1][1].to(state).float())


def test_state_over_pages_of_an_odd_number_of_bytes():
    """Pages of 7 bytes (a row of 7 int8 values, one token, one head): a float32 state of 5
    values over 3 pages (42 bytes of key and value pages, not a whole number of float32
    values) and reads back exactly."""
    k = torch.randint(-128, 128, (6, 1, 1, 7), dtype=torch.int8)
    v = k.clone()
    layout = StateLayout([(5,)], torch.float32)
    for tables in ([[4, 0, 2]], [[4, 0, 2], [1, 3, 5]]):  # one request, two
        tables = torch.tensor(tables, dtype=torch.int32)
        want = torch.randn(len(tables), 5)
        layout.write((k, v), tables, [want])
        (got,) = layout.read((k, v), tables, torch.ones(len(tables), dtype=torch.bool))
        assert torch.equal(got, want)


@pytest.mark.parametrize("case", [QWEN, MAMBA2])
def test_state_pages_under_an_8bit_cache_count_bytes(case, checkpoint):
    """The state stays in the model's dtype: its pages are its bytes over a slot page's
    bytes (rows of head_dim + 4 bytes in an 8-bit cache), rounded up."""
    path = checkpoint(case)
    for dtype, cd in [("float32", "auto"), ("float32", "fp8"), ("bfloat16", "auto"), ("bfloat16", "int8")]:
        runner = LLM(model=str(path), dtype=dtype, kv_cache_memory="16MiB", kv_cache_dtype=cd).llm_engine.runner
        k = runner.kv_caches[0][0]
        assert k.dtype == {"auto": getattr(torch, dtype), "int8": torch.int8, "fp8": torch.float8_e4m3fn}[cd]
        a = runner.local_arch
        row = a.head_dim if cd == "auto" else a.head_dim + 4
        page = 2 * 16 * a.num_kv_heads * row * k.element_size()
        state = runner.model.state.numel * getattr(torch, dtype).itemsize
        assert runner.model.state_bytes(runner.kv_dtype) == state
        assert runner.state_pages == -(-state // page), (dtype, cd)


# ---- accuracy against the model-dtype cache ------------------------------------------------


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _accuracy(path, cd: str, want_rows, want_greedy) -> None:
    llm = LLM(model=str(path), **BASE, kv_cache_dtype=cd)
    rows = _prompt_rows(llm, _prompts(3, (40, 100, 7, 64)))
    diff = max((a - b).abs().max().item() for a, b in zip(want_rows, rows))
    kl = max(
        torch.nn.functional.kl_div(b, a, log_target=True, reduction="none").sum(-1).max().item()
        for a, b in zip(want_rows, rows)
    )
    top1 = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(want_rows, rows))
    top1 /= sum(a.shape[0] for a in rows)
    got = [o.outputs[0].token_ids for o in _greedy(llm, _prompts(4))]
    # Greedy agreement: the generated tokens before each sequence's first difference.
    same = sum(_common_prefix(g, w) for g, w in zip(got, want_greedy)) / sum(map(len, want_greedy))
    print(f"{path.name} {cd}: max |logprob diff| {diff:.4g}, largest KL {kl:.3g}, top-1 {top1:.3f}, greedy {same:.3f}")
    assert 0 < diff < BOUNDS[cd]["max_abs"], diff  # > 0: the cache really is 8-bit
    assert kl < BOUNDS[cd]["kl"], kl
    assert top1 > 0.8
    assert same > 0.5


ACCURACY = [(QWEN, cd) for cd in KV8] + [
    pytest.param(MAMBA2, cd, marks=() if cd == "int8" else pytest.mark.slow) for cd in KV8
]


@pytest.mark.parametrize("case,cd", ACCURACY)
def test_8bit_cache_stays_near_the_model_dtype_cache(case, cd, checkpoint):
    path = checkpoint(case)
    ref = LLM(model=str(path), **BASE)
    want_rows = _prompt_rows(ref, _prompts(3, (40, 100, 7, 64)))
    want_greedy = [o.outputs[0].token_ids for o in _greedy(ref, _prompts(4))]
    _accuracy(path, cd, want_rows, want_greedy)


# ---- features that reuse, move or split the state pages ------------------------------------

#: The same 8-bit engine under a feature, against it plain (whole prompts, no prefix cache).
FEATURES = {
    "chunked": dict(max_num_batched_tokens=8, block_size=4),
    # 30 pages of 8 tokens for five requests of up to 82 tokens and their state pages.
    "recompute": dict(max_num_batched_tokens=64, block_size=8, num_gpu_blocks_override=30, max_model_len=96),
    "swap": dict(
        max_num_batched_tokens=64,
        block_size=8,
        num_gpu_blocks_override=30,
        max_model_len=96,
        preemption_mode="swap",
        kv_offload_memory="4MiB",
    ),
}


FEATURE_CASES = [
    (QWEN, "int8"),
    pytest.param(MAMBA2, "fp8_e4m3", marks=pytest.mark.slow),
    pytest.param(QWEN, "fp8_e5m2", marks=pytest.mark.slow),
    pytest.param(MAMBA2, "int8", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("case,cd", FEATURE_CASES)
def test_features_equal_the_plain_8bit_engine(case, cd, checkpoint):
    path = checkpoint(case)
    prompts = _prompts(5)
    plain = LLM(model=str(path), **BASE, kv_cache_dtype=cd, enable_prefix_caching=False, max_num_batched_tokens=512)
    want = _greedy(plain, prompts)
    for name, kw in FEATURES.items():
        llm = LLM(model=str(path), **BASE, kv_cache_dtype=cd, enable_prefix_caching=False, **kw)
        eng = llm.llm_engine
        assert eng.runner.kv_caches[0][0].element_size() == 1 and eng.runner.state_pages >= 1
        diff = _same(_greedy(llm, prompts), want, f"{cd} {name}", SAME_TOL[cd])
        print(f"{case} {cd} {name}: max |logprob diff| {diff:.3g}")
        _no_leaks(llm)
        if name != "chunked":
            assert eng.scheduler.num_preemptions > 0, name
        if name == "swap":
            stats = eng.stats()
            assert stats.num_swap_outs > 0 and stats.num_swap_ins == stats.num_swap_outs
            assert stats.kv_blocks_swapped_out >= stats.num_swap_outs * eng.kv.state_pages * len(eng.kv.state_groups)
    # n=2 in small chunks: each sample carries its own state.
    llm = LLM(model=str(path), **BASE, kv_cache_dtype=cd, **FEATURES["chunked"])
    outs = _greedy(llm, prompts, n=2)
    assert all(len(o.outputs) == 2 for o in outs)
    _same(outs, want, f"{cd} n=2", SAME_TOL[cd])
    # Prefix caching: a checkpoint every 8 tokens; B shares A's first 45 tokens (hits 40),
    # C shares its first 10 (hits 8).
    rng = random.Random(9)
    a = prompts[3][:61]
    b = a[:45] + [rng.randrange(3, VOCAB) for _ in range(20)]
    c = a[:10] + [rng.randrange(3, VOCAB) for _ in range(2)]
    want = _greedy(plain, [a, b, c])
    llm = LLM(model=str(path), **BASE, kv_cache_dtype=cd, block_size=4, state_checkpoint_interval=2)
    first = _greedy(llm, [a])
    rest = llm.generate([{"prompt_token_ids": p} for p in (b, c)], _params()[1:3], use_tqdm=False)
    assert [o.num_cached_tokens for o in rest] == [40, 8]
    _same(first + rest, want, f"{cd} prefix hits", SAME_TOL[cd])
    assert sum(g.num_checkpoints for g in llm.llm_engine.kv.state_groups) > 0
    _no_leaks(llm)


# ---- device map ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case,cd",
    [
        (QWEN, "int8"),
        pytest.param(QWEN, "auto", marks=pytest.mark.slow),
        pytest.param(MAMBA2, "fp8_e4m3", marks=pytest.mark.slow),
    ],
)
def test_device_map_equals_one_device(case, cd, checkpoint):
    """Two CPU segments (layers 0-1, 2-3): each allocates its own slot tensors, state
    pages included; with swap preemption through a host tier too."""
    path = checkpoint(case)
    prompts = _prompts(6)
    kw = dict(BASE, kv_cache_dtype=cd, **FEATURES["swap"])
    want = _greedy(LLM(model=str(path), **kw), prompts)
    llm = LLM(model=str(path), **kw, device_map="cpu:2,cpu")
    runner = llm.llm_engine.runner
    assert len(runner.segments) == 2 and runner.state_pages >= 1
    owners: dict[int, int] = {}
    layer = 0
    for i, seg in enumerate(runner.segments):
        for k, _ in runner.kv_caches[layer : layer + seg.num_layers]:
            assert owners.setdefault(k.data_ptr(), i) == i, "a KV slot tensor spans two device-map segments"
        layer += seg.num_layers
    _same(_greedy(llm, prompts), want, f"device map {cd}", tol=1e-5)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    _no_leaks(llm)
