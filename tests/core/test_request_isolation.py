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


POISON_SEED = 4242


@pytest.fixture
def failing_generator(monkeypatch):
    """The sampler fails to build the random state of requests seeded with POISON_SEED, as
    torch does for a seed it refuses (out-of-range seeds themselves are now a 400 before
    anything is queued: tests/core/test_request_fields_offline.py)."""
    from pagedserve.executor.sampler import Sampler

    original = Sampler._generator

    def generator(self, request):
        if request.sampling_params.seed is not None and request.sampling_params.seed - POISON_SEED in (0, 1):
            raise RuntimeError(f"Overflow when unpacking long: seed {request.sampling_params.seed}")
        return original(self, request)

    monkeypatch.setattr(Sampler, "_generator", generator)


def test_a_request_failing_in_the_sampler_fails_alone(llm, failing_generator):
    poison = SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=12, n=2)  # samples seeded 4242, 4243
    good = [
        ([5, 6, 7], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
        ([8, 9], SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True)),
        ([10, 11, 12, 13], SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)),
    ]
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
