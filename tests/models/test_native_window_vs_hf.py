"""Windowed and soft-capped families through the native CPU attention kernel against
transformers (float32 greedy tokens and logprobs, chunked prefill and prefix caching).

The cases of test_models_vs_hf.py use head sizes the native kernel has no variant for
(16, 24), so their attention runs the reference; here the same families get head size
64, and the reference is made unusable, so a pass means the native kernel computed
every windowed and soft-capped layer.
"""

from __future__ import annotations

import math

import pytest

from pagedserve import LLM, SamplingParams
from tests.models.test_models_vs_hf import ENGINES, MAX_NEW, _prompts, build_checkpoint, hf_reference

pytest.importorskip("transformers")

CASES = {
    "gemma2-window-softcap": dict(head_dim=64),
    "mistral-window": dict(head_dim=64),
    "gemma3-window-local-rope": dict(head_dim=64),
}


@pytest.mark.parametrize("case", list(CASES))
def test_native_window_kernel_matches_transformers(case, tmp_path, monkeypatch):
    from pagedserve.kernels.cpu import native

    model = build_checkpoint(tmp_path, case, **CASES[case])
    prompts = _prompts(len(case))
    expected = [hf_reference(model, p, n) for p, n in zip(prompts, MAX_NEW)]
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="16MiB", **ENGINES["chunked+prefix"])
    if not llm.llm_engine.ops.source("paged_attention").startswith("cpu-native"):
        pytest.skip("the native CPU kernels are not in use here")

    def refuse(*_a, **_k):
        raise AssertionError("paged_attention fell back to the reference")

    monkeypatch.setattr(native.reference, "paged_attention", refuse)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_NEW]
    for round_ in range(2):  # the second round hits the prefix cache
        outs = llm.generate(prompts, params, use_tqdm=False)
        for i, (out, (tokens, logprobs)) in enumerate(zip(outs, expected)):
            got = out.outputs[0]
            assert got.token_ids == tokens, f"prompt {i}, round {round_}"
            for j, (tok, entry) in enumerate(zip(got.token_ids, got.logprobs)):
                assert math.isclose(entry[tok].logprob, logprobs[j], abs_tol=2e-4), (i, j, round_)
    assert llm.llm_engine.kv.pool.num_in_use == 0
