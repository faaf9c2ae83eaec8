"""The field walk: every field of vLLM's completions and chat requests is sent with a
non-default value and is either honoured (a behaviour check, mostly against the offline
LLM on the same checkpoint) or refused with a 400 naming it.  The field lists live in
pagedserve.entrypoints.openai.request_fields; a field added there without a check here
fails this module, and a field missing there is refused generically (or ignored if
it is in no list at all).  Also the HTTP regressions of seed / token id / NaN checks."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from pagedserve import SamplingParams, StructuredOutputsParams
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.entrypoints.openai.request_fields import CHAT_FIELDS, COMPLETION_FIELDS

PROMPT = "Hello world"
MESSAGES = [{"role": "user", "content": PROMPT}]
CONTINUED = [*MESSAGES, {"role": "assistant", "content": "Hel"}]
EOS = 2  # the tiny checkpoint's <|im_end|>
D = 70  # byte token "d"
TABLES = {"completions": COMPLETION_FIELDS, "chat/completions": CHAT_FIELDS}


@pytest.fixture(scope="module")
def server(server_factory, tiny_llama, tmp_path_factory, tiny_server_args, chat_template):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(chat_template)
    return server_factory(
        str(tiny_llama),
        [
            *tiny_server_args,
            "--served-model-name",
            "tiny",
            "tiny-alias",
            "--chat-template",
            str(template),
            "--scheduling-policy",
            "priority",
        ],
    )


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


class Ctx:
    """What a behaviour check needs: the endpoint, the response and the offline reference."""

    def __init__(self, endpoint: str, body: dict, resp: httpx.Response, offline, client) -> None:
        self.endpoint, self.body, self.resp, self.offline, self.client = endpoint, body, resp, offline, client
        self.chat = endpoint.startswith("chat")

    @property
    def json(self) -> dict:
        assert self.resp.status_code == 200, self.resp.text
        return self.resp.json()

    def text(self, i: int = 0) -> str:
        c = self.json["choices"][i]
        return c["message"]["content"] if self.chat else c["text"]

    def usage(self, key: str) -> int:
        return self.json["usage"][key]

    def reference(self, prompt: Any = None, messages: list | None = None, **kw):
        """The offline LLM's output for the same prompt and sampling settings."""
        kw.setdefault("temperature", 0.0)
        kw.setdefault("max_tokens", 4)
        params = SamplingParams(**kw)
        if self.chat:
            return self.offline.chat(messages or MESSAGES, params, use_tqdm=False)[0]
        return self.offline.generate(prompt if prompt is not None else PROMPT, params, use_tqdm=False)[0]

    def same_as_reference(self, **kw) -> None:
        ref = self.reference(**kw)
        assert [self.text(i) for i in range(len(ref.outputs))] == [c.text for c in ref.outputs]

    def base(self) -> str:
        return self.reference().outputs[0].text

    def tokens(self, text: str, special: bool = False) -> int:
        return len(self.offline.get_tokenizer().encode(text, add_special_tokens=special))

    def rendered(self, messages: list, add_generation_prompt: bool = True, **kw) -> str:
        template = self.offline.llm_engine.config.model.chat_template  # the server's --chat-template
        return self.offline.get_tokenizer().apply_chat_template(messages, add_generation_prompt, template, **kw)


def _sse_data(resp: httpx.Response) -> list[dict]:
    lines = [ln[6:] for ln in resp.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def _stream_text(ctx: Ctx) -> str:
    key = "delta" if ctx.chat else None
    return "".join(
        (c[key].get("content") or "") if key else c["text"] for d in _sse_data(ctx.resp) for c in d["choices"]
    )


def _check_prompt_logprobs(ctx: Ctx) -> None:
    got = ctx.json["prompt_logprobs"] if ctx.chat else ctx.json["choices"][0]["prompt_logprobs"]
    ref = ctx.reference(prompt_logprobs=1).prompt_logprobs
    assert got[0] is None and len(got) == len(ref) == ctx.usage("prompt_tokens")
    for g, r in zip(got[1:], ref[1:]):
        assert {int(k): round(v["logprob"], 4) for k, v in g.items()} == {k: round(v.logprob, 4) for k, v in r.items()}


def _check_logprob_tokens_as_ids(ctx: Ctx) -> None:
    if ctx.chat:
        tokens = [e["token"] for e in ctx.json["choices"][0]["logprobs"]["content"]]
    else:
        tokens = ctx.json["choices"][0]["logprobs"]["tokens"]
    ids = ctx.reference().outputs[0].token_ids
    assert tokens == [f"token_id:{t}" for t in ids]


def _check_beam_search(ctx: Ctx, length_penalty: float = 1.0) -> None:
    from pagedserve.beam_search import BeamSearchParams

    tok = ctx.offline.get_tokenizer()
    ids = tok.encode(ctx.rendered(MESSAGES), add_special_tokens=False) if ctx.chat else tok.encode(PROMPT)
    ref = ctx.offline.beam_search(
        {"prompt_token_ids": ids}, BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=length_penalty)
    )
    assert [ctx.text(i) for i in range(2)] == [s.text for s in ref[0].sequences]
    assert ctx.usage("completion_tokens") == sum(len(s.tokens) - len(ids) for s in ref[0].sequences)


def _check_stream_usage(ctx: Ctx) -> None:
    chunks = _sse_data(ctx.resp)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    running = [d["usage"]["completion_tokens"] for d in chunks[:-1] if d["choices"] and d["usage"]]
    assert running and running == sorted(running) and running[-1] == 4  # usage so far on every chunk


def _check_cache_salt(ctx: Ctx) -> None:
    """Same long prompt: unsalted, then salted twice; only the second salted one hits the cache."""
    assert ctx.resp.status_code == 200, ctx.resp.text
    long_prompt = "a prompt long enough to fill two blocks of sixteen tokens each, " * 2
    body = {
        **base_body(ctx.endpoint),
        **({"messages": [{"role": "user", "content": long_prompt}]} if ctx.chat else {"prompt": long_prompt}),
    }
    hits = []
    for salt in (None, f"s-{ctx.endpoint}", f"s-{ctx.endpoint}"):
        before = _prefix_hits(ctx.client)
        r = ctx.client.post(f"/v1/{ctx.endpoint}", json={**body, **({"cache_salt": salt} if salt else {})})
        assert r.status_code == 200, r.text
        hits.append(_prefix_hits(ctx.client) - before)
    assert hits[1] == 0 and hits[2] > 0, hits


def _prefix_hits(client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("pagedserve:prefix_cache_hits_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no prefix_cache_hits_total in /metrics")


def _check_completion_logprobs(ctx: Ctx) -> None:
    lp = ctx.json["choices"][0]["logprobs"]
    ref = ctx.reference(logprobs=2).outputs[0]
    assert [round(x, 4) for x in lp["token_logprobs"]] == [
        round(e[t].logprob, 4) for t, e in zip(ref.token_ids, ref.logprobs)
    ]
    assert all(len(top) <= 2 for top in lp["top_logprobs"])


# Structured outputs: each constraint's answer is in its language and equals the offline
# LLM's under the same constraint (greedy).  Small languages, so the tiny model ends them.
CHOICES = ["yes", "no", "maybe"]
SCHEMA = {"type": "string", "enum": ["ab", "cd"]}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_xyz",
        "parameters": {
            "type": "object",
            "properties": {"a": {"enum": [1, 2]}},
            "required": ["a"],
            "additionalProperties": False,
        },
    },
}


def _check_constrained(ctx: Ctx, allowed: Callable[[str], bool], **constraint) -> None:
    text = ctx.text()
    assert allowed(text), text
    ctx.same_as_reference(structured_outputs=StructuredOutputsParams(**constraint), max_tokens=12)


def _constrained(field: str, value: Any, allowed: Callable[[str], bool], **constraint) -> tuple[dict, Check]:
    return {field: value, "max_tokens": 12}, lambda c: _check_constrained(c, allowed, **constraint)


def _check_tool_calls(ctx: Ctx, most: int | None = None) -> None:
    message = ctx.json["choices"][0]["message"]
    calls = message["tool_calls"]
    assert calls and (most is None or len(calls) <= most), message
    for call in calls:
        assert call["function"]["name"] == "get_xyz" and json.loads(call["function"]["arguments"]) in (
            {"a": 1},
            {"a": 2},
        ), call


Check = Callable[[Ctx], None]
# field -> (extra body fields, behaviour check); both endpoints unless overridden below.
SHARED_CASES: dict[str, tuple[dict, Check]] = {
    "model": ({"model": "tiny-alias"}, lambda c: c.json["model"] == "tiny-alias" or pytest.fail("model")),
    "frequency_penalty": (
        {"frequency_penalty": 1.5, "max_tokens": 8},
        lambda c: c.same_as_reference(frequency_penalty=1.5, max_tokens=8),
    ),
    "presence_penalty": (
        {"presence_penalty": 1.5, "max_tokens": 8},
        lambda c: c.same_as_reference(presence_penalty=1.5, max_tokens=8),
    ),
    "repetition_penalty": (
        {"repetition_penalty": 1.8, "max_tokens": 8},
        lambda c: c.same_as_reference(repetition_penalty=1.8, max_tokens=8),
    ),
    "logit_bias": ({"logit_bias": {str(D): 100}}, lambda c: c.text() == "dddd" or pytest.fail(c.text())),
    "max_tokens": ({"max_tokens": 2}, lambda c: c.usage("completion_tokens") == 2 or pytest.fail("max_tokens")),
    "n": ({"n": 2, "temperature": 1.0, "seed": 4}, lambda c: c.same_as_reference(n=2, temperature=1.0, seed=4)),
    "seed": ({"temperature": 1.0, "seed": 123}, lambda c: c.same_as_reference(temperature=1.0, seed=123)),
    "temperature": ({"temperature": 0.7, "seed": 1}, lambda c: c.same_as_reference(temperature=0.7, seed=1)),
    "top_p": (
        {"temperature": 1.0, "top_p": 0.3, "seed": 2},
        lambda c: c.same_as_reference(temperature=1.0, top_p=0.3, seed=2),
    ),
    "top_k": ({"temperature": 1.0, "top_k": 1, "seed": 2}, lambda c: c.text() == c.base() or pytest.fail("top_k")),
    "min_p": ({"temperature": 1.0, "min_p": 1.0, "seed": 2}, lambda c: c.text() == c.base() or pytest.fail("min_p")),
    "stop": (
        {"logit_bias": {str(D): 100}, "stop": ["dd"]},
        lambda c: (c.text(), c.json["choices"][0]["stop_reason"]) == ("", "dd") or pytest.fail("stop"),
    ),
    "include_stop_str_in_output": (
        {"logit_bias": {str(D): 100}, "stop": ["dd"], "include_stop_str_in_output": True},
        lambda c: c.text() == "dd" or pytest.fail(c.text()),
    ),
    "stop_token_ids": (
        {"logit_bias": {str(D): 100}, "stop_token_ids": [D]},
        lambda c: (
            (c.usage("completion_tokens"), c.json["choices"][0]["stop_reason"]) == (1, D)
            or pytest.fail("stop_token_ids")
        ),
    ),
    "ignore_eos": (
        {"logit_bias": {str(EOS): 100}, "ignore_eos": True, "max_tokens": 3},
        lambda c: c.usage("completion_tokens") == 3 or pytest.fail("ignore_eos"),
    ),
    "min_tokens": (
        {"logit_bias": {str(EOS): 100}, "min_tokens": 3, "max_tokens": 6},
        lambda c: c.usage("completion_tokens") == 4 or pytest.fail("min_tokens"),
    ),
    "skip_special_tokens": (
        {"logit_bias": {str(EOS): 100}, "ignore_eos": True, "max_tokens": 2, "skip_special_tokens": False},
        lambda c: c.text() == "<|im_end|><|im_end|>" or pytest.fail(c.text()),
    ),
    "spaces_between_special_tokens": (
        {
            "logit_bias": {str(EOS): 100},
            "ignore_eos": True,
            "max_tokens": 2,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
        },
        lambda c: c.text() == "<|im_end|><|im_end|>" or pytest.fail(c.text()),
    ),
    "stream": ({"stream": True}, lambda c: _stream_text(c) == c.base() or pytest.fail("stream")),
    "stream_options": (
        {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        _check_stream_usage,
    ),
    "cache_salt": ({"cache_salt": "salt-1"}, _check_cache_salt),
    "user": ({"user": "someone"}, lambda c: c.text() == c.base() or pytest.fail("user")),
    "best_of": (
        {"best_of": 3, "temperature": 1.0, "seed": 7},
        lambda c: c.same_as_reference(best_of=3, temperature=1.0, seed=7),
    ),
    "allowed_token_ids": (
        {"allowed_token_ids": [68, 69]},
        lambda c: (
            (set(c.text()) <= set("bc") or pytest.fail(c.text())) and c.same_as_reference(allowed_token_ids=[68, 69])
        ),
    ),
    "bad_words": (
        {"allowed_token_ids": [67, 68, 69], "bad_words": ["b"], "max_tokens": 8},
        lambda c: (
            ("b" not in c.text() or pytest.fail(c.text()))
            and c.same_as_reference(allowed_token_ids=[67, 68, 69], bad_words=["b"], max_tokens=8)
        ),
    ),
    "prompt_logprobs": ({"prompt_logprobs": 1}, _check_prompt_logprobs),
    "truncate_prompt_tokens": (
        {"truncate_prompt_tokens": 3},
        lambda c: c.usage("prompt_tokens") == 3 or pytest.fail("truncate"),
    ),
    "priority": ({"priority": 5}, lambda c: c.text() == c.base() or pytest.fail("priority")),
    "request_id": ({"request_id": "walk-1"}, lambda c: c.json["id"].endswith("-walk-1") or pytest.fail(c.json["id"])),
    "return_tokens_as_token_ids": ({"return_tokens_as_token_ids": True, "logprobs": 0}, _check_logprob_tokens_as_ids),
    "use_beam_search": ({"use_beam_search": True, "n": 2}, _check_beam_search),
    "length_penalty": ({"use_beam_search": True, "n": 2, "length_penalty": 0.0}, lambda c: _check_beam_search(c, 0.0)),
    "structured_outputs": _constrained(
        "structured_outputs", {"choice": CHOICES}, lambda t: t in CHOICES, choice=CHOICES
    ),
    "guided_choice": _constrained("guided_choice", CHOICES, lambda t: t in CHOICES, choice=CHOICES),
    "guided_regex": _constrained(
        "guided_regex", "[a-c]{2}x", lambda t: re.fullmatch("[a-c]{2}x", t) is not None, regex="[a-c]{2}x"
    ),
    "guided_grammar": _constrained(
        "guided_grammar",
        'root ::= "n=" [0-9]',
        lambda t: re.fullmatch("n=[0-9]", t) is not None,
        grammar='root ::= "n=" [0-9]',
    ),
    "guided_json": _constrained("guided_json", SCHEMA, lambda t: json.loads(t) in SCHEMA["enum"], json=SCHEMA),
    "response_format": _constrained(
        "response_format",
        {"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA}},
        lambda t: json.loads(t) in SCHEMA["enum"],
        json=SCHEMA,
    ),
    "guided_decoding_backend": (
        {"guided_decoding_backend": "xgrammar", "guided_choice": CHOICES, "max_tokens": 12},
        lambda c: _check_constrained(c, lambda t: t in CHOICES, choice=CHOICES),
    ),
}

COMPLETION_CASES: dict[str, tuple[dict, Check]] = {
    **SHARED_CASES,
    "prompt": (
        {"prompt": [65, 66, 67]},
        lambda c: (
            c.usage("prompt_tokens") == 3
            and c.text() == c.reference(prompt=[65, 66, 67]).outputs[0].text
            or pytest.fail("prompt")
        ),
    ),
    "logprobs": ({"logprobs": 2}, _check_completion_logprobs),
    "echo": ({"echo": True}, lambda c: c.text() == PROMPT + c.base() or pytest.fail(c.text())),
    "add_special_tokens": (
        {"add_special_tokens": False},
        lambda c: c.usage("prompt_tokens") == c.tokens(PROMPT) or pytest.fail("add_special"),
    ),
    # The tiny vocabulary has no fill-in-the-middle tokens: a 400 that says so.
    "suffix": (
        {"suffix": " end"},
        lambda c: (
            (
                c.resp.status_code == 400
                and c.resp.json()["error"]["param"] == "suffix"
                and "fill-in-the-middle" in c.resp.text
            )
            or pytest.fail(c.resp.text)
        ),
    ),
}

CHAT_CASES: dict[str, tuple[dict, Check]] = {
    **SHARED_CASES,
    "return_tokens_as_token_ids": (
        {"return_tokens_as_token_ids": True, "logprobs": True},
        _check_logprob_tokens_as_ids,
    ),
    "messages": ({"messages": CONTINUED}, lambda c: c.same_as_reference(messages=CONTINUED)),
    "logprobs": (
        {"logprobs": True},
        lambda c: len(c.json["choices"][0]["logprobs"]["content"]) == 4 or pytest.fail("logprobs"),
    ),
    "top_logprobs": (
        {"logprobs": True, "top_logprobs": 2},
        lambda c: (
            all(len(e["top_logprobs"]) == 2 for e in c.json["choices"][0]["logprobs"]["content"])
            or pytest.fail("top_logprobs")
        ),
    ),
    "max_completion_tokens": (
        {"max_completion_tokens": 2},
        lambda c: c.usage("completion_tokens") == 2 or pytest.fail("max_completion_tokens"),
    ),
    "echo": (
        {"echo": True, "messages": CONTINUED, "add_generation_prompt": False, "continue_final_message": True},
        lambda c: c.text().startswith("Hel") and len(c.text()) > 3 or pytest.fail(c.text()),
    ),
    "add_special_tokens": (
        {"add_special_tokens": True},
        lambda c: (
            c.usage("prompt_tokens") == c.tokens(c.rendered(MESSAGES), special=True)
            or pytest.fail("add_special_tokens")
        ),
    ),
    "add_generation_prompt": (
        {"add_generation_prompt": False},
        lambda c: (
            c.usage("prompt_tokens") == c.tokens(c.rendered(MESSAGES, False)) < c.tokens(c.rendered(MESSAGES))
            or pytest.fail("add_generation_prompt")
        ),
    ),
    "continue_final_message": (
        {"messages": CONTINUED, "add_generation_prompt": False, "continue_final_message": True},
        lambda c: (
            c.usage("prompt_tokens") == c.tokens(f"[user] {PROMPT}\n[assistant] Hel")
            or pytest.fail("continue_final_message")
        ),
    ),
    "documents": (
        {"documents": [{"title": "t", "text": "DOCTEXT"}], "chat_template": "{{ documents[0].text }}"},
        lambda c: c.usage("prompt_tokens") == c.tokens("DOCTEXT") or pytest.fail("documents"),
    ),
    "chat_template": (
        {"chat_template": "{{ messages[0].content }}!"},
        lambda c: c.usage("prompt_tokens") == c.tokens(PROMPT + "!") or pytest.fail("chat_template"),
    ),
    "chat_template_kwargs": (
        {"chat_template": "<{{ flag }}>", "chat_template_kwargs": {"flag": "XYZ"}},
        lambda c: c.usage("prompt_tokens") == c.tokens("<XYZ>") or pytest.fail("chat_template_kwargs"),
    ),
    # tool_choice "none": the tools only reach the template.
    "tools": (
        {"tools": [TOOL], "tool_choice": "none", "chat_template": "{{ tools[0].function.name }}"},
        lambda c: c.usage("prompt_tokens") == c.tokens("get_xyz") or pytest.fail("tools"),
    ),
    "tool_choice": (
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_xyz"}}, "max_tokens": 16},
        _check_tool_calls,
    ),
    "parallel_tool_calls": (
        {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 48},
        lambda c: _check_tool_calls(c, most=1),
    ),
}

# Non-default values for fields that are refused.
REFUSED_VALUES: dict[str, Any] = {
    "logits_processors": ["mod.Proc"],
    "kv_transfer_params": {"do_remote_decode": True},
    "vllm_xargs": {"k": 1},
    "mm_processor_kwargs": {"k": 1},
    "prompt_embeds": "AAAA",
    "multi_modal_data": {"image": "data:image/png;base64,AAAA"},
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "modalities": ["audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {"search_context_size": "low"},
    "guided_whitespace_pattern": " ",
    "reasoning_effort": "low",
    "include_reasoning": False,
    "structural_tag": '{"structures": [], "triggers": []}',
}
CASES = {"completions": COMPLETION_CASES, "chat/completions": CHAT_CASES}
WALK = [(e, f) for e, table in TABLES.items() for f in table]


def base_body(endpoint: str) -> dict:
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0}
    return {**body, "messages": MESSAGES} if endpoint.startswith("chat") else {**body, "prompt": PROMPT}


@pytest.mark.parametrize("endpoint,field", WALK, ids=[f"{e.split('/')[0]}-{f}" for e, f in WALK])
def test_field_is_honoured_or_refused(client, offline_tiny, endpoint, field):
    status = TABLES[endpoint][field].status
    if status == "honoured":
        extra, check = CASES[endpoint][field]
    else:
        extra, check = {field: REFUSED_VALUES[field]}, None
    body = {**base_body(endpoint), **extra}
    resp = client.post(f"/v1/{endpoint}", json=body)
    if check is not None:
        check(Ctx(endpoint, body, resp, offline_tiny, client))
        return
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == field and f"'{field}'" in err["message"]


def test_every_honoured_field_has_a_check_and_a_model_field():
    for endpoint, table in TABLES.items():
        model = ChatCompletionRequest if endpoint.startswith("chat") else CompletionRequest
        for name, f in table.items():
            if f.status == "honoured":
                assert name in CASES[endpoint], f"{endpoint}: honoured field {name!r} has no behaviour check"
                assert name in model.model_fields, f"{endpoint}: honoured field {name!r} is not declared"
            else:
                assert name in REFUSED_VALUES, f"{endpoint}: {name!r} has no value to send"


def test_unlisted_unknown_fields_are_ignored(client):
    r = client.post("/v1/completions", json={**base_body("completions"), "x_custom_field": {"a": 1}})
    assert r.status_code == 200, r.text


# -- validation regressions (HTTP) ------------------------------------------------------------------
BAD = [
    ("completions", '{"seed": 18446744073709551616, "temperature": 1}', "seed"),
    ("completions", '{"seed": -9223372036854775809}', "seed"),
    ("completions", '{"temperature": NaN}', "temperature"),
    ("chat/completions", '{"top_p": Infinity}', "top_p"),
    ("completions", '{"presence_penalty": -Infinity}', "presence_penalty"),
    ("completions", '{"stop_token_ids": [-100000000000000000000], "min_tokens": 2}', "stop_token_ids"),
    ("completions", '{"stop_token_ids": [-1]}', "stop_token_ids"),
    ("chat/completions", '{"stop_token_ids": [259], "min_tokens": 1}', "stop_token_ids"),
    ("completions", '{"allowed_token_ids": [5, 1000000]}', "allowed_token_ids"),
    ("chat/completions", '{"logit_bias": {"99999": 3}}', "logit_bias"),
    ("completions", '{"logit_bias": {"5": NaN}}', "logit_bias"),
    ("completions", '{"prompt": [5, -1]}', "prompt"),
    ("completions", '{"prompt_logprobs": 2, "stream": true}', "prompt_logprobs"),
    ("completions", '{"prompt_logprobs": -1}', "prompt_logprobs"),
    ("chat/completions", '{"prompt_logprobs": 21}', "prompt_logprobs"),
    ("chat/completions", '{"continue_final_message": true}', "continue_final_message"),
    ("chat/completions", '{"priority": "high"}', "priority"),
    ("completions", '{"length_penalty": 0.5}', "length_penalty"),
    ("completions", '{"best_of": 1000000}', "best_of"),
    ("completions", '{"n": 3, "best_of": 2}', "best_of"),
    ("completions", '{"use_beam_search": true, "stream": true}', "stream"),
    ("chat/completions", '{"use_beam_search": true, "logprobs": true}', "logprobs"),
    ("completions", '{"use_beam_search": true, "n": 11}', "n"),
    ("completions", '{"use_beam_search": true, "top_k": 3}', "top_k"),
    ("completions", '{"use_beam_search": true, "n": 2, "guided_choice": ["a", "b"]}', "guided_choice"),
    (
        "chat/completions",
        '{"use_beam_search": true, "n": 2, "tool_choice": "required", "tools": [{"type": '
        '"function", "function": {"name": "f"}}]}',
        "tool_choice",
    ),
    (
        "chat/completions",
        '{"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}}',
        "response_format.json_schema",
    ),
    ("completions", '{"guided_json": {"properties": []}}', "guided_json"),
]


@pytest.mark.parametrize(
    "endpoint,fields,param", BAD, ids=[f"{e.split('/')[0]}-{p}-{i}" for i, (e, _, p) in enumerate(BAD)]
)
def test_bad_values_are_400_naming_the_field(client, endpoint, fields, param):
    body = json.dumps(base_body(endpoint))[:-1] + ", " + fields[1:]  # NaN is not JSON: splice the text
    r = client.post(f"/v1/{endpoint}", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert client.get("/health").status_code == 200


def test_int64_seed_limits_with_n_are_served(client):
    for seed in (2**63 - 1, -(2**63)):
        r = client.post("/v1/completions", json={**base_body("completions"), "seed": seed, "n": 3, "temperature": 1.0})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 3


def test_priority_is_refused_by_a_fcfs_server(http):
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "priority": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert "--scheduling-policy" in r.json()["error"]["message"]


def test_docs_table_lists_every_field():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    missing = [n for table in TABLES.values() for n in table if f"| `{n}` |" not in text]
    assert not missing, f"docs/serving.md's field table lacks {missing}"


def test_generation_config_defaults_on_the_server(
    server_factory, tiny_llama, tiny_server_args, offline_tiny, tmp_path_factory
):
    folder = tmp_path_factory.mktemp("genconfig")
    (folder / "generation_config.json").write_text(json.dumps({"top_k": 1, "temperature": 1.0, "max_new_tokens": 3}))
    server = server_factory(
        str(tiny_llama), [*tiny_server_args, "--served-model-name", "tiny", "--generation-config", str(folder)]
    )
    with httpx.Client(base_url=server.url, timeout=120) as c:
        # No temperature: the file's top_k=1 makes it greedy; no max_tokens: its max_new_tokens.
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES})
        assert r.status_code == 200, r.text
        ref = offline_tiny.chat(
            MESSAGES,
            SamplingParams(temperature=0, max_tokens=3),
            use_tqdm=False,
            chat_template=offline_tiny.get_tokenizer().chat_template,
        )[0]  # no --chat-template
        assert r.json()["usage"]["completion_tokens"] == 3
        assert r.json()["choices"][0]["message"]["content"] == ref.outputs[0].text
        # A request's own value wins over the file's.
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "top_k": 0, "seed": 3})
        ref = offline_tiny.generate(PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=5), use_tqdm=False)[0]
        assert r.json()["choices"][0]["text"] == ref.outputs[0].text


def test_generation_defaults_reach_a_data_parallel_router(tiny_llama, tmp_path):
    """A router has no LLMEngine: the defaults come from its engine config's model folder."""
    import shutil

    from pagedserve.config import EngineConfig, ModelConfig
    from pagedserve.entrypoints.openai.serving_fields import generation_defaults
    from pagedserve.serving.router import DataParallelRouter

    model = tmp_path / "m"
    shutil.copytree(tiny_llama, model)
    (model / "generation_config.json").write_text(json.dumps({"top_p": 0.5, "max_new_tokens": 9}))
    router = object.__new__(DataParallelRouter)  # its config only: no replicas started
    router.config = EngineConfig(model=ModelConfig(model=str(model)))
    assert generation_defaults(router) == {"top_p": 0.5, "max_tokens": 9}
    router.config.model.generation_config = "ignore"
    assert generation_defaults(router) == {}


def test_message_name_reaches_the_chat_template(client, offline_tiny):
    body = {
        **base_body("chat/completions"),
        "chat_template": "{{ messages[0].name }}",
        "messages": [{"role": "user", "content": "Hi", "name": "Alice"}],
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(offline_tiny.get_tokenizer().encode("Alice"))
