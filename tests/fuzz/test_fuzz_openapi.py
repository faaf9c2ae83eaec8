"""schemathesis against the served /openapi.json: schema-valid bodies (positive mode) and
schema-invalid ones (negative mode) for every operation.  Pass: no 5xx, OpenAI's error
shape on every 4xx, negative bodies refused with a 4xx, and the server healthy after."""

from __future__ import annotations

import pytest
import schemathesis
from fuzz_helpers import EXAMPLES, check_answer, check_server_still_serves, fuzz_settings
from hypothesis import given
from schemathesis import GenerationMode

pytestmark = pytest.mark.timeout(600)

OPERATIONS = [
    ("/v1/completions", "POST"),
    ("/v1/chat/completions", "POST"),
    ("/v1/embeddings", "POST"),
    ("/v1/models/{model}", "GET"),
    ("/v1/models", "GET"),
    ("/health", "GET"),
]


# JSON Schema counts 1.0 as an integer; the server's strict parsing does not (an integer
# field must be written as one), so schema-valid bodies are written that way.
INT_FIELDS = {
    "max_tokens",
    "max_completion_tokens",
    "n",
    "seed",
    "top_k",
    "min_tokens",
    "logprobs",
    "top_logprobs",
    "best_of",
    "stop_token_ids",
    "prompt",
    "input",
    "dimensions",
    "priority",
}


def integral_floats_as_ints(body, key: str | None = None):
    if isinstance(body, dict):
        return {k: integral_floats_as_ints(v, k) for k, v in body.items()}
    if isinstance(body, list):
        return [integral_floats_as_ints(v, key) for v in body]
    if isinstance(body, float) and key in INT_FIELDS and body.is_integer():
        return int(body)
    return body


@pytest.fixture(scope="module")
def schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


def test_the_document_lists_every_route(schema):
    ops = {(op.path, op.method.upper()) for op in (r.ok() for r in schema.get_all_operations())}
    assert set(OPERATIONS) <= ops


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("path,method", OPERATIONS)
def test_schemathesis(schema, fuzz_server, path, method, mode):
    op = schema[path][method]
    if mode is GenerationMode.NEGATIVE and method == "GET":
        pytest.skip("GET routes take no body; a negative path parameter is just another name")
    n = EXAMPLES if method == "POST" else max(EXAMPLES // 4, 5)
    statuses: list[int] = []

    @fuzz_settings(n)
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case):
        if mode is GenerationMode.POSITIVE:
            case.body = integral_floats_as_ints(case.body)
        r = case.call(base_url=fuzz_server.url, timeout=120)
        check_answer(r.status_code, r.headers, r.content, f"{method} {case.formatted_path} {case.body!r}")
        if mode is GenerationMode.NEGATIVE:
            # Schema-invalid data must never be taken as a request.
            assert 400 <= r.status_code < 500, f"accepted a schema-invalid body: {case.body!r} -> {r.status_code}"
        statuses.append(r.status_code)

    run()
    assert statuses
    if mode is GenerationMode.POSITIVE and method == "POST":
        assert 200 in statuses, "no schema-valid body was answered: the generator never made a real request"
    check_server_still_serves(fuzz_server)
