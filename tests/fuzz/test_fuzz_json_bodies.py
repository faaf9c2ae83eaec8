"""A hypothesis fuzzer of raw request bodies: arbitrary JSON (mostly objects mixing the
real field names with any JSON value), broken JSON and raw bytes, sent to both
generation routes.  Pass: no 5xx, OpenAI's error shape on every 4xx, and the server
healthy, answering and holding no KV block afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from fuzz_helpers import EXAMPLES, check_answer, check_server_still_serves, fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(600)

FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "echo",
    "logit_bias",
    "user",
    "role",
    "content",
    "include_usage",
    "type",
    "text",
]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.integers(-3, 300)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30)
    | st.sampled_from(["tiny", "user", "assistant", "system", "text", "hi", ""])
)
keys = st.sampled_from(FIELDS) | st.text(max_size=8)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(keys, inner, max_size=5), max_leaves=20
)
# Bodies that look like requests: a few short, greedy generations among the noise.
plausible = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 6), "temperature": st.just(0)},
    optional={k: json_values for k in FIELDS[:12] if k not in ("max_tokens", "temperature")}
    | {
        "prompt": st.text(min_size=1, max_size=20) | st.lists(st.integers(0, 300), min_size=1, max_size=8),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "robot"]), "content": st.text(max_size=20) | json_values}
            ),
            max_size=3,
        ),
        "model": st.sampled_from(["tiny", "other", ""]) | st.none(),
    },
)
bodies = (
    st.dictionaries(keys, json_values, max_size=8).map(json.dumps)
    | plausible.map(json.dumps)
    | json_values.map(json.dumps)
    | st.text(max_size=40)
    | st.binary(max_size=40)
)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_raw_json_bodies(fuzz_server, route):
    statuses: list[int] = []

    with httpx.Client(base_url=fuzz_server.url, timeout=120) as client:

        @fuzz_settings(EXAMPLES * 2)
        @given(body=bodies)
        def run(body):
            content = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
            r = client.post(route, content=content, headers={"content-type": "application/json"})
            check_answer(r.status_code, r.headers, r.content, f"{route} {content[:300]!r}")
            statuses.append(r.status_code)

        run()
    assert any(s >= 400 for s in statuses)
    check_server_still_serves(fuzz_server)
