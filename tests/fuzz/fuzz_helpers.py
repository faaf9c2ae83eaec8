"""The fuzz suite's server flags, size, and the checks every fuzzed answer must pass.

Size: PAGEDSERVE_FUZZ_EXAMPLES examples per strategy (default: a short, derandomized CI
run; `make fuzz` runs a long random one).
"""

from __future__ import annotations

import os

import httpx
from live_server import TINY_ARGS, LiveServer, kv_cache_usage

EXAMPLES = int(os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES", "40"))
# The short CI run is the same every time; a long run explores anew (hypothesis prints
# the seed of a failure so it can be replayed).
DERANDOMIZE = "PAGEDSERVE_FUZZ_EXAMPLES" not in os.environ
# A short context keeps every generated answer short (chat defaults max_tokens to the
# rest of the context), so hundreds of cases stay quick.
FUZZ_ARGS = [*TINY_ARGS, "--max-model-len", "48", "--max-body-size", "64KiB", "--max-queue-len", "512"]
ERROR_FIELDS = {"message", "type", "param", "code"}


def check_answer(status: int, headers, body: bytes, what: str) -> None:
    """No 5xx; a 4xx carries OpenAI's error JSON."""
    assert status < 500, f"{what} -> {status}: {body[:500]!r}"
    if status >= 400 and status != 499:
        import json

        doc = json.loads(body)
        assert set(doc) == {"error"} and set(doc["error"]) == ERROR_FIELDS, f"{what} -> {status}: {doc}"
        assert isinstance(doc["error"]["message"], str) and doc["error"]["message"]


def check_server_still_serves(server: LiveServer) -> None:
    """Health, a normal request, and no KV block held once everything is done."""
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = httpx.post(
        server.url + "/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": "hello", "max_tokens": 4, "ignore_eos": True},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert kv_cache_usage(server.url) == 0.0
