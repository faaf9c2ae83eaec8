"""The OpenAI API through the official `openai` client against the tiny model's server,
checked against the offline `LLM` on the same checkpoint (greedy answers must be equal)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from pagedserve import SamplingParams

PROMPTS = ["Hello world", "The quick brown fox jumps"]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "a story"}]},
]
# The same conversation as the chat template sees it (text parts joined by newlines).
CONVERSATION_FLAT = CONVERSATION[:3] + [{"role": "user", "content": "Tell me\na story"}]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def test_models_lists_every_served_name(tiny_server):
    models = tiny_server.openai().models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-alias"]
    assert models.data[0].model_extra["max_model_len"] == 1024


def test_completion_of_two_prompts_matches_offline(tiny_server, offline_tiny):
    resp = tiny_server.openai().completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0)
    ref = offline_tiny.generate(PROMPTS, greedy(max_tokens=12), use_tqdm=False)
    assert resp.object == "text_completion" and resp.model == "tiny"
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [r.outputs[0].text for r in ref]
    assert [c.finish_reason for c in resp.choices] == [r.outputs[0].finish_reason for r in ref]
    assert resp.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in ref)
    assert resp.usage.completion_tokens == sum(len(r.outputs[0].token_ids) for r in ref)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_alias_name_and_token_id_prompts(tiny_server, offline_tiny):
    ids = [[5, 77, 120, 33], [9, 200, 41]]
    client = tiny_server.openai()
    many = client.completions.create(model="tiny-alias", prompt=ids, max_tokens=8, temperature=0)
    one = client.completions.create(model="tiny", prompt=ids[1], max_tokens=8, temperature=0)
    ref = offline_tiny.generate(ids, greedy(max_tokens=8), use_tqdm=False)
    assert many.model == "tiny-alias"
    assert [c.text for c in many.choices] == [r.outputs[0].text for r in ref]
    assert one.choices[0].text == ref[1].outputs[0].text
    assert one.usage.prompt_tokens == 3


def test_chat_matches_offline_chat(tiny_server, offline_tiny):
    resp = tiny_server.openai().chat.completions.create(
        model="tiny", messages=CONVERSATION, max_tokens=10, temperature=0
    )
    ref = offline_tiny.chat(CONVERSATION_FLAT, greedy(max_tokens=10), use_tqdm=False)[0]
    choice = resp.choices[0]
    assert resp.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    # The server's --chat-template rendered the prompt (one token per byte in this tokenizer).
    rendered = "".join(f"[{m['role']}] {m['content']}\n" for m in CONVERSATION_FLAT) + "[assistant] "
    assert resp.usage.prompt_tokens == len(rendered.encode())


def test_chat_max_tokens_defaults_to_the_rest_of_the_context(tiny_server):
    resp = tiny_server.openai().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "go"}], temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.total_tokens == 1024  # max_model_len


def test_max_completion_tokens_and_completion_default(tiny_server):
    client = tiny_server.openai()
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "go"}],
        max_completion_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage.completion_tokens == 3
    completion = client.completions.create(model="tiny", prompt="go", temperature=0, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 16  # OpenAI's default max_tokens for completions


def test_streamed_completion_equals_whole(tiny_server):
    client = tiny_server.openai()
    kw = dict(model="tiny", prompt=PROMPTS, max_tokens=20, temperature=0)
    whole = client.completions.create(**kw)
    texts = {0: "", 1: ""}
    finish = {}
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_streamed_chat_equals_whole(tiny_server):
    client = tiny_server.openai()
    kw = dict(model="tiny", messages=CONVERSATION, max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert content == whole.choices[0].message.content
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].usage == whole.usage


def test_sse_framing_ends_with_done(tiny_server):
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert [json.loads(e[6:])["object"] for e in events[:-1]] == ["text_completion"] * (len(events) - 1)


def test_n_samples_with_two_prompts_are_indexed_per_prompt(tiny_server, offline_tiny):
    resp = tiny_server.openai().completions.create(model="tiny", prompt=PROMPTS, n=2, max_tokens=8, temperature=0)
    ref = offline_tiny.generate(PROMPTS, greedy(max_tokens=8), use_tqdm=False)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == [ref[0].outputs[0].text] * 2 + [ref[1].outputs[0].text] * 2
    assert resp.usage.completion_tokens == 2 * sum(len(r.outputs[0].token_ids) for r in ref)


def test_seeded_n_samples_differ_and_stream_reproduces_them(tiny_server, offline_tiny):
    client = tiny_server.openai()
    kw = dict(
        model="tiny", prompt="seeded", n=3, max_tokens=12, temperature=1.0, seed=42, extra_body={"ignore_eos": True}
    )
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    texts = [c.text for c in a.choices]
    assert texts == [c.text for c in b.choices]
    assert len(set(texts)) == 3
    streamed = {i: "" for i in range(3)}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[i] for i in range(3)] == texts
    ref = offline_tiny.generate(
        "seeded", SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=42, ignore_eos=True), use_tqdm=False
    )[0]
    assert [o.text for o in ref.outputs] == texts
    other = client.completions.create(**{**kw, "seed": 43})
    assert [c.text for c in other.choices] != texts


def _stop_candidate(text: str) -> tuple[str, int]:
    """A short ASCII substring of `text` past its start, and where it first occurs."""
    m = re.search(r"[!-~]{2}", text[2:])
    assert m, f"no ASCII pair to use as a stop string in {text!r}"
    stop = m.group(0)
    return stop, text.find(stop)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text(tiny_server, stream):
    client = tiny_server.openai()
    kw = dict(model="tiny", prompt="stop here", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    stop, at = _stop_candidate(full)
    if stream:
        text, finish = "", None
        for chunk in client.completions.create(stream=True, stop=[stop, "\x00never"], **kw):
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    else:
        choice = client.completions.create(stop=[stop, "\x00never"], **kw).choices[0]
        text, finish = choice.text, choice.finish_reason
    assert (text, finish) == (full[:at], "stop")


def test_completion_logprobs_match_offline(tiny_server, offline_tiny):
    resp = tiny_server.openai().completions.create(
        model="tiny", prompt=[7, 8, 9], max_tokens=6, temperature=0, logprobs=3
    )
    lp = resp.choices[0].logprobs
    ref = offline_tiny.generate([[7, 8, 9]], greedy(max_tokens=6, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == resp.usage.completion_tokens == 6
    for tid, entry, got, tops in zip(ref.token_ids, ref.logprobs, lp.token_logprobs, lp.top_logprobs):
        assert got == pytest.approx(entry[tid].logprob, abs=1e-4)
        # Greedy: the chosen token is the most likely one.
        assert got == pytest.approx(max(tops.values()), abs=1e-6)
        assert 1 <= len(tops) <= 3
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_shape(tiny_server, stream):
    client = tiny_server.openai()
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    if stream:
        content = []
        for chunk in client.chat.completions.create(stream=True, **kw):
            if chunk.choices and chunk.choices[0].logprobs:
                content += chunk.choices[0].logprobs.content
    else:
        content = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert item.logprob <= 0 and isinstance(item.token, str) and isinstance(item.bytes, list)
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-6)


def test_vllm_sampling_extras_reach_the_sampler(tiny_server):
    client = tiny_server.openai()
    kw = dict(model="tiny", prompt="extras", max_tokens=10)
    greedy_text = client.completions.create(temperature=0, **kw).choices[0].text
    top_k_1 = client.completions.create(temperature=1.0, seed=3, extra_body={"top_k": 1}, **kw).choices[0].text
    min_p_1 = client.completions.create(temperature=1.0, seed=3, extra_body={"min_p": 1.0}, **kw).choices[0].text
    sampled = client.completions.create(temperature=1.0, seed=3, **kw).choices[0].text
    assert top_k_1 == greedy_text and min_p_1 == greedy_text
    assert sampled != greedy_text
    ids = client.completions.create(
        temperature=0,
        max_tokens=10,
        model="tiny",
        prompt="extras",
        extra_body={"min_tokens": 10, "repetition_penalty": 1.3, "ignore_eos": True},
        user="someone",
    )
    assert ids.usage.completion_tokens == 10
