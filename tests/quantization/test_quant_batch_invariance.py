"""The default model's greedy answer to a prompt does not depend on its batch.

Each target prompt runs alone, then prefilled in one step with many others (hundreds of
rows: where the CPU GGUF kernel used to switch to a dense matmul with other rounding).
"""

from __future__ import annotations

import random

import pytest

from pagedserve import LLM, SamplingParams

WORDS = "the of and to in is was for on that with as by at from his her they which this are be".split()


@pytest.fixture(scope="module")
def llm():
    # Measured dispatch off: on a CPU with AMX it sends steps of a few dozen rows and more
    # to the AMX-BF16 GGUF kernel, which rounds otherwise than the int8 kernel
    # (docs/kernels_cpu.md, "Batch invariance"); without AMX the setting changes nothing.
    # Prefix caching off: a prompt run alone after the batch would hit its cached blocks
    # and compute a shorter chunk, which the register-tile prefill attention (AMX, or
    # AVX-512 BF16 without it) may hand to another kernel: that is chunking, not batch,
    # variance (docs/kernels_cpu.md, "Chunking invariance").
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSERVE_CPU_TUNE", "0")
        # the default model: SmolLM2-135M-Instruct Q4_1 blocks, the CPU's native kernel
        llm = LLM(enable_prefix_caching=False)
    yield llm
    llm.shutdown()


def test_greedy_alone_equals_batched(llm):
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(12, 30))) for _ in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
    batched = llm.generate(prompts, params, use_tqdm=False)
    assert sum(len(o.prompt_token_ids) for o in batched) > 200  # one prefill step of many rows
    for i in (0, 5, 11):
        alone = llm.generate([prompts[i]], params, use_tqdm=False)[0].outputs[0]
        together = batched[i].outputs[0]
        assert alone.token_ids == together.token_ids, prompts[i]
        # Not only the argmax: the same numbers.
        for a, b in zip(alone.logprobs, together.logprobs):
            assert a.keys() == b.keys()
            for t in a:
                assert a[t].logprob == b[t].logprob
