"""Structured outputs through the offline API on the default model (SmolLM2-135M):
every constraint kind, n > 1, preemption, the compile queue, and bad input."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import pytest

from pagedserve import LLM, SamplingParams, StructuredOutputsParams
from pagedserve.loader.model_path import default_model_path

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def llm():
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"the default model is not installed: {e}")
    return LLM(max_model_len=512, kv_cache_memory="64MiB", threads=1)


def _chat(llm, so: StructuredOutputsParams, **kw) -> list:
    params = SamplingParams(**{"max_tokens": 48, "temperature": 0.0, **kw}, structured_outputs=so)
    return llm.chat(ASK, params, use_tqdm=False)[0].outputs


def test_json_schema_output_is_valid_for_every_sample(llm):
    outs = _chat(llm, StructuredOutputsParams(json=PERSON), n=3, temperature=1.0, seed=7)
    assert len(outs) == 3
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)


@pytest.mark.compat("structured_outputs", "single")
def test_regex_choice_and_grammar(llm):
    regex = r"[0-9]{3}-[A-Z]{2}"
    for o in _chat(llm, StructuredOutputsParams(regex=regex), n=2, temperature=1.0, seed=1):
        assert re.fullmatch(regex, o.text), o.text
    choices = ["yes", "no", "maybe so"]
    (o,) = _chat(llm, StructuredOutputsParams(choice=choices))
    assert o.text in choices and o.finish_reason == "stop"
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    (o,) = _chat(llm, StructuredOutputsParams(grammar=grammar), temperature=1.0, seed=3)
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", o.text), o.text


def test_json_object_and_compact_json(llm):
    (o,) = _chat(llm, StructuredOutputsParams(json_object=True), max_tokens=64)
    if o.finish_reason == "stop":
        assert isinstance(json.loads(o.text), dict)
    (o,) = _chat(llm, StructuredOutputsParams(json=PERSON, disable_any_whitespace=True))
    assert json.loads(o.text) and " " not in o.text.replace(json.loads(o.text)["name"], "")


def test_unsatisfiable_within_max_tokens_finishes_with_length(llm):
    (o,) = _chat(llm, StructuredOutputsParams(json=PERSON), max_tokens=3)
    assert o.finish_reason == "length" and len(o.token_ids) == 3


@pytest.mark.parametrize(
    "so, problem",
    [
        (dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "json"),
        (dict(regex="(unclosed"), "regex"),
        (dict(grammar="root ::= undefined_rule"), "grammar"),
        (dict(structural_tag='{"not": "a tag"}'), "structural_tag"),
    ],
)
def test_bad_constraints_are_refused_before_queuing(llm, so, problem):
    with pytest.raises(ValueError, match=problem):
        llm.generate(["hi"], SamplingParams(structured_outputs=StructuredOutputsParams(**so)), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a"))


def test_unknown_backend_is_refused():
    from pagedserve.config import StructuredOutputsConfig

    with pytest.raises(ValueError, match="backend"):
        StructuredOutputsConfig(backend="outlines-ish")


@pytest.mark.parametrize("command", [["serve"], ["generate"], ["bench", "throughput"]])
def test_structured_outputs_settings_from_flags(command):
    from pagedserve.entrypoints import cli
    from pagedserve.entrypoints.engine_args import engine_config_from_args

    def config(*flags):
        argv = [*command, *flags]
        return engine_config_from_args(cli.build_parser(argv).parse_args(argv), model=None).structured_outputs

    assert (config().backend, config().reasoning_parser) == ("auto", None)
    so = config("--structured-outputs-config", '{"backend": "xgrammar", "reasoning_parser": "qwen3"}')
    assert (so.backend, so.reasoning_parser) == ("xgrammar", "qwen3")
    # --reasoning-parser wins over the JSON's.
    so = config("--structured-outputs-config", '{"reasoning_parser": "qwen3"}', "--reasoning-parser", "deepseek_r1")
    assert (so.backend, so.reasoning_parser) == ("auto", "deepseek_r1")
    for bad in ('{"backend": "outlines"}', '{"bakend": "xgrammar"}', "[1]", "{not json"):
        with pytest.raises(SystemExit):
            config("--structured-outputs-config", bad)


def test_structured_outputs_settings_from_keywords():
    from pagedserve.config import StructuredOutputsConfig
    from pagedserve.entrypoints.engine_args import engine_config_from_kwargs

    def config(**kw):
        return engine_config_from_kwargs(**kw).structured_outputs

    assert config(structured_outputs_config={"backend": "xgrammar"}).backend == "xgrammar"
    assert config(structured_outputs_config="xgrammar", reasoning_parser="qwen3").reasoning_parser == "qwen3"
    given = StructuredOutputsConfig(backend="xgrammar", reasoning_parser="deepseek_r1")
    assert config(structured_outputs_config=given) == given
    assert config(structured_outputs_config=None) == StructuredOutputsConfig()
    with pytest.raises(ValueError, match="no setting 'bakend'"):
        config(structured_outputs_config={"bakend": "xgrammar"})
    with pytest.raises(ValueError, match="reasoning_parser"):
        config(reasoning_parser="o1")


def test_compiled_grammars_are_cached_by_schema(llm):
    mgr = llm.llm_engine.structured
    a = mgr.prepare(StructuredOutputsParams(json=dict(PERSON)))
    b = mgr.prepare(StructuredOutputsParams(json=json.dumps(PERSON)))
    assert a is b


def test_waiting_for_a_grammar_does_not_stall_other_requests(llm):
    engine = llm.llm_engine
    pending: Future = Future()
    engine.add_request("free", "Hello", SamplingParams(max_tokens=4, temperature=0))
    engine.add_request(
        "held",
        "Hello",
        SamplingParams(max_tokens=4, temperature=0, structured_outputs=StructuredOutputsParams(choice=["x"])),
    )
    held = engine.scheduler.requests["held"]
    held.structured.compiled = pending  # pretend its compile is slow
    try:
        for _ in range(6):
            engine.step()
        assert "free" not in engine.groups and held.num_computed_tokens == 0
        pending.set_result(engine.structured.prepare(StructuredOutputsParams(choice=["x"])).result())
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = out
        assert done["held"].outputs[0].text == "x"
    finally:
        engine.abort_request(["free", "held"])


def test_preemption_keeps_grammars_consistent():
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"the default model is not installed: {e}")
    # 10 blocks of 16 tokens cannot hold four ~60-token sequences: some are preempted.
    small = LLM(max_model_len=160, num_gpu_blocks_override=12, block_size=16, threads=1, enable_prefix_caching=False)
    prompts = [f"Person number {i} as JSON:" for i in range(4)]
    schema = {
        **PERSON,
        "properties": {**PERSON["properties"], "bio": {"type": "string", "minLength": 60}},
        "required": ["name", "age", "bio"],
    }
    params = SamplingParams(
        max_tokens=100, temperature=0.7, seed=5, structured_outputs=StructuredOutputsParams(json=schema)
    )
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    for out in outs:
        o = out.outputs[0]
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), schema)
        else:
            assert o.finish_reason == "length"
    assert any(out.outputs[0].finish_reason == "stop" for out in outs)
    assert small.llm_engine.kv.usage() == 0.0


def test_constraint_starts_after_the_reasoning_end_token(llm):
    engine = llm.llm_engine
    (end,) = engine.tokenizer.encode(".", add_special_tokens=False)
    saved = engine.structured.reasoning_end_ids
    engine.structured.reasoning_end_ids = frozenset({end})  # "." plays </think>
    try:
        params = SamplingParams(
            max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(choice=["ALPHA", "BETA"])
        )
        ask = [{"role": "user", "content": "Tell me about Paris in two sentences."}]
        out = llm.chat(ask, params, use_tqdm=False)[0].outputs[0]
    finally:
        engine.structured.reasoning_end_ids = saved
    assert end in out.token_ids, out.text
    cut = out.token_ids.index(end) + 1
    free, constrained = out.token_ids[:cut], out.token_ids[cut:]
    assert engine.tokenizer.decode(constrained) in ("ALPHA", "BETA"), out.text
    assert out.finish_reason == "stop" and len(free) >= 1


def test_structural_tag_constrains_the_tagged_part(llm):
    import torch

    engine = llm.llm_engine
    tag = {
        "type": "structural_tag",
        "triggers": ["<person>"],
        "structures": [{"begin": "<person>", "schema": PERSON, "end": "</person>"}],
    }
    mgr = engine.structured
    state = mgr.new_state(mgr.prepare(StructuredOutputsParams(structural_tag=json.dumps(tag))))
    state.compiled.result()
    assert state.ready()
    tok = engine.tokenizer

    def allowed() -> list[str]:
        mask = torch.full((1, mgr.bitmask_width), -1, dtype=torch.int32)
        state.fill_bitmask(mask, 0, mgr.stop_token_ids)
        logits = torch.zeros(1, engine.arch.vocab_size)
        engine.ops.apply_token_bitmask(logits, mask)
        return [tok.decode([i], skip_special_tokens=False) for i in (~logits[0].isneginf()).nonzero().flatten()]

    free = allowed()
    assert len(free) > 1000  # outside the tag: free text
    for t in tok.encode("Here: <person>", add_special_tokens=False):
        assert state.accept(t)
    inside = allowed()
    assert inside and all(s.strip() == "" or s.strip().startswith("{") for s in inside), inside[:20]
    for t in tok.encode('{"name": "Al", "age": 3}</person>', add_special_tokens=False):
        assert state.accept(t)
    assert len(allowed()) > 1000  # free again after the end tag
    for t in tok.encode('{"name": 5', add_special_tokens=False)[:1]:
        assert state.accept(t)  # "{" outside the tag is plain text


def test_rollback_undoes_accepted_tokens(llm):
    import torch

    engine = llm.llm_engine
    mgr, tok = engine.structured, engine.tokenizer
    state = mgr.new_state(mgr.prepare(StructuredOutputsParams(choice=["apple pie", "banana split"])))
    state.compiled.result()
    assert state.ready()

    def allowed() -> torch.Tensor:
        mask = torch.full((1, mgr.bitmask_width), -1, dtype=torch.int32)
        state.fill_bitmask(mask, 0, mgr.stop_token_ids)
        return mask.clone()

    start = allowed()
    ids = tok.encode("apple pie", add_special_tokens=False)
    for t in ids:
        assert state.accept(t)
    assert not torch.equal(allowed(), start)
    state.rollback(len(ids))  # as if speculative tokens were rejected
    assert torch.equal(allowed(), start)
    for t in tok.encode("banana split", add_special_tokens=False):
        assert state.accept(t)
    with pytest.raises(ValueError, match="roll back"):
        state.rollback(100)
