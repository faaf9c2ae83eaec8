"""`serve --speculative-config`: completions (plain and streamed) equal greedy decoding
without speculation, and /metrics carries the spec_decode counters."""

from __future__ import annotations

import json

import pytest

from pagedserve import SamplingParams

PROMPT = "abcabcabcabcabcabc"
SPEC = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def spec_server(server_factory, tiny_llama, tiny_server_args):
    return server_factory(
        str(tiny_llama), [*tiny_server_args, "--served-model-name", "tiny", "--speculative-config", json.dumps(SPEC)]
    )


def test_completions_equal_greedy_and_metrics_count(spec_server, offline_tiny):
    want = (
        offline_tiny.generate(
            [PROMPT], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    client = spec_server.openai()
    got = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=24, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].text == want
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=24, temperature=0.0, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].text for c in stream) == want
    m = spec_server.metrics()
    drafted = m["pagedserve:spec_decode_num_draft_tokens_total"]
    accepted = m["pagedserve:spec_decode_num_accepted_tokens_total"]
    assert drafted > 0 and 0 <= accepted <= drafted
    assert m["pagedserve:spec_decode_num_accepted_tokens_per_pos_total{position=0}"] <= drafted
