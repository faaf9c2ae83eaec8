"""Bad requests through raw HTTP: always a 4xx with OpenAI's error JSON naming the field,
and never a disturbance to the requests around them."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pagedserve import SamplingParams

CHAT_OK = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION_OK = {"model": "tiny", "prompt": "hi", "max_tokens": 4}

# (endpoint, fields merged into a valid body, expected param)
BAD_FIELDS = [
    ("completions", {"temperature": -1}, "temperature"),
    ("completions", {"temperature": 3}, "temperature"),  # OpenAI's range is [0, 2]
    ("chat/completions", {"temperature": 2.5}, "temperature"),
    ("completions", {"temperature": 2.5, "use_beam_search": True, "n": 2}, "temperature"),
    ("completions", {"top_p": 2.0}, "top_p"),
    ("completions", {"top_k": -5}, "top_k"),
    ("completions", {"max_tokens": "5"}, "max_tokens"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"n": 0}, "n"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"prompt": None}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [[1, 2], "mixed"]}, "prompt"),
    ("completions", {"prompt": [1, 2, 100000]}, "prompt"),
    ("completions", {"stop": [1]}, "stop"),
    ("completions", {"stream": "yes"}, "stream"),
    ("completions", {"seed": 1.5}, "seed"),
    ("completions", {"prompt_embeds": "AAAA"}, "prompt_embeds"),
    ("completions", {"min_tokens": 9}, "min_tokens"),
    ("completions", {"stream_options": {"include_usage": "sure"}}, "stream_options.include_usage"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": None}, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0]",
    ),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ("chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat/completions", {"presence_penalty": 5}, "presence_penalty"),
    ("chat/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
]


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize("endpoint,fields,param", BAD_FIELDS, ids=[f"{e}-{p}" for e, _, p in BAD_FIELDS])
def test_bad_field_is_400_naming_it(http, endpoint, fields, param):
    body = {**(CHAT_OK if endpoint.startswith("chat") else COMPLETION_OK), **fields}
    err = assert_openai_error(http.post(f"/v1/{endpoint}", json=body), 400, param)
    assert param.split("[")[0].split(".")[0] in err["message"]


def test_temperature_at_the_ends_of_its_range_is_served(http):
    for endpoint, body in (("completions", COMPLETION_OK), ("chat/completions", CHAT_OK)):
        for temperature in (0, 2):
            r = http.post(f"/v1/{endpoint}", json={**body, "temperature": temperature})
            assert r.status_code == 200, r.text


@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe"])
def test_invalid_json_is_400(http, body):
    for endpoint in ("completions", "chat/completions"):
        r = http.post(f"/v1/{endpoint}", content=body, headers={"content-type": "application/json"})
        assert_openai_error(r, 400)


@pytest.mark.parametrize("endpoint,body", [("completions", COMPLETION_OK), ("chat/completions", CHAT_OK)])
def test_unknown_model_is_404(http, endpoint, body):
    err = assert_openai_error(http.post(f"/v1/{endpoint}", json={**body, "model": "gpt-5"}), 404, "model")
    assert err["code"] == "model_not_found" and "gpt-5" in err["message"]
    assert_openai_error(http.get("/v1/models/gpt-5"), 404, "model")
    assert http.get("/v1/models/tiny").json()["id"] == "tiny"


def test_prompt_over_max_model_len_is_400_naming_the_limit(http):
    long_text = "a" * 1500  # the byte tokenizer makes one token per character
    err = assert_openai_error(http.post("/v1/completions", json={**COMPLETION_OK, "prompt": long_text}), 400, "prompt")
    assert "1024" in err["message"] and "max_model_len" in err["message"]
    messages = [{"role": "user", "content": long_text}]
    err = assert_openai_error(
        http.post("/v1/chat/completions", json={**CHAT_OK, "messages": messages}), 400, "messages"
    )
    assert "1024" in err["message"]
    # A prompt that fits but leaves no room for max_tokens names max_tokens.
    err = assert_openai_error(
        http.post("/v1/completions", json={**COMPLETION_OK, "prompt": "a" * 1000, "max_tokens": 100}), 400, "max_tokens"
    )
    assert "1024" in err["message"]


def test_body_over_the_limit_is_413(http, tiny_server):
    big = json.dumps({**COMPLETION_OK, "prompt": "x" * (2 * 2**20)}).encode()
    r = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert_openai_error(r, 413)

    def chunked():  # no Content-Length: the limit must hold while reading
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    r = httpx.post(
        tiny_server.url + "/v1/chat/completions",
        content=chunked(),
        timeout=60,
        headers={"content-type": "application/json"},
    )
    assert_openai_error(r, 413)
    assert http.post("/v1/completions", json=COMPLETION_OK).status_code == 200


def test_unknown_route_and_method_use_the_error_shape(http):
    assert_openai_error(http.get("/v1/nothing"), 404)
    assert_openai_error(http.get("/v1/completions"), 405)


def test_openai_client_raises_bad_request_with_param(tiny_server):
    with pytest.raises(openai.BadRequestError) as info:
        tiny_server.openai().completions.create(model="tiny", prompt="x", temperature=-2)
    assert info.value.status_code == 400 and info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        tiny_server.openai().chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_bad_requests_do_not_disturb_a_running_one(tiny_server, offline_tiny):
    """A long greedy stream runs while dozens of bad requests (and aborted ones) hit the
    server; its text must equal the offline answer and nothing may answer 5xx."""
    prompt = [11, 22, 33, 44, 55]
    ref = (
        offline_tiny.generate([prompt], SamplingParams(temperature=0, max_tokens=150, ignore_eos=True), use_tqdm=False)[
            0
        ]
        .outputs[0]
        .text
    )
    bad_bodies = [{**COMPLETION_OK, **fields} for e, fields, _ in BAD_FIELDS if e == "completions"]
    bad_bodies += [{**COMPLETION_OK, "prompt": "a" * 1500}, {**COMPLETION_OK, "model": "x"}]

    def good() -> str:
        client = tiny_server.openai()
        stream = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=150, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        return "".join(c.choices[0].text for c in stream if c.choices)

    def bad(i: int) -> int:
        with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
            if i % 4 == 3:  # a client that gives up at once: its request is aborted
                try:
                    c.post("/v1/completions", json={**COMPLETION_OK, "max_tokens": 300}, timeout=0.05)
                except httpx.TimeoutException:
                    return 0
                return 0
            if i % 4 == 2:
                return c.post(
                    "/v1/completions", content=b"{oops", headers={"content-type": "application/json"}
                ).status_code
            return c.post("/v1/completions", json=bad_bodies[i % len(bad_bodies)]).status_code

    with ThreadPoolExecutor(6) as pool:
        running = pool.submit(good)
        statuses = list(pool.map(bad, range(32)))
        text = running.result(timeout=300)
    assert text == ref
    assert all(s < 500 for s in statuses), statuses
    assert httpx.get(tiny_server.url + "/health").status_code == 200
