"""The fuzz suite's server flags, size, and the checks every fuzzed answer must pass.

Size: PAGEDSERVE_FUZZ_EXAMPLES examples per strategy (default: a short CI run; `make
fuzz` runs a long one).

Seed: every run draws new examples from a fresh seed, printed at the start and the end of
the run (``fuzz seed: N``); PAGEDSERVE_FUZZ_SEED=N replays that run exactly (the same
examples in the same order, given the same server and PAGEDSERVE_FUZZ_EXAMPLES).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Mapping

import httpx
from hypothesis import HealthCheck, seed, settings
from live_server import TINY_ARGS, LiveServer, kv_cache_usage

EXAMPLES = int(os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES", "40"))
SEED_ENV = "PAGEDSERVE_FUZZ_SEED"


def run_seed(env: Mapping[str, str] | None = None) -> int:
    """PAGEDSERVE_FUZZ_SEED if set, else a fresh seed (so each run explores anew)."""
    raw = (os.environ if env is None else env).get(SEED_ENV, "").strip()
    return int(raw) if raw else secrets.randbits(32)


SEED = run_seed()


def fuzz_settings(max_examples: int) -> Callable:
    """The settings of every fuzz test: ``max_examples`` drawn from SEED (no example
    database: a run depends on its seed alone)."""

    def apply(test: Callable) -> Callable:
        test = settings(
            max_examples=max_examples,
            deadline=None,
            database=None,
            derandomize=False,
            suppress_health_check=list(HealthCheck),
        )(test)
        return seed(SEED)(test)

    return apply


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
