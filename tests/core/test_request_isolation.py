"""One request's own failure fails that request only (finish_reason "error", blocks
freed); its neighbours in the same batches get exactly their solo answers."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory="16MiB")


def _solo(llm, prompt, params):
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("seed", [2**64, -2**63 - 1])
def test_a_request_failing_in_the_sampler_fails_alone(llm, seed):
    poison = SamplingParams(temperature=1.0, seed=seed, max_tokens=12, n=2)  # a seed torch refuses
    good = [([5, 6, 7], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
            ([8, 9], SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True)),
            ([10, 11, 12, 13], SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True))]
    solo = [_solo(llm, p, sp) for p, sp in good]
    prompts = [good[0][0], [3, 4], good[1][0], good[2][0]]
    params = [good[0][1], poison, good[1][1], good[2][1]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    bad = outs[1]
    assert bad.finished and bad.error is not None and "sampling failed" in bad.error
    assert bad.outputs[0].finish_reason == "error"
    for out, ref in zip([outs[0], outs[2], outs[3]], solo):
        assert out.error is None and out.outputs[0].token_ids == ref.token_ids
        assert out.outputs[0].text == ref.text
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine.kv.usage() == 0
    engine.kv.pool.check_invariants()
