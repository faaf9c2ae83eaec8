"""Pathological text for the tokenizer: megabytes without a space, deep Unicode
combining sequences.  A prompt longer than can fit in max_model_len tokens is refused
by its character count before it is tokenized; one within that bound is tokenized in a
worker thread, so that the other requests go on meanwhile; either way the answer comes
in bounded time."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from chaos_helpers import InProcessServer, run

pytestmark = pytest.mark.timeout(300)

PLAIN = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}


CONTEXT = 32768


@pytest.fixture
def long_context_server(tiny_checkpoint_factory):
    # A long context makes the longest allowed prompt long: hundreds of thousands of characters.
    path = tiny_checkpoint_factory(max_position_embeddings=CONTEXT)
    server = InProcessServer(str(path))
    try:
        yield server, path
    finally:
        server.stop()


def _limit(path) -> int:
    """max_model_len times the longest vocabulary entry: no longer text fits."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.normalizer is None
    return CONTEXT * max(len(t) for t in tok.get_vocab(with_added_tokens=True))


def test_a_prompt_too_long_to_fit_is_refused_before_tokenizing(long_context_server):
    server, path = long_context_server
    limit = _limit(path)
    assert CONTEXT <= limit < 4_000_000
    for field, body in [
        ("prompt", {**PLAIN, "prompt": "x" * (limit + 1)}),
        ("prompt", {**PLAIN, "prompt": "x" * 4_000_000}),
        ("messages", {"model": "tiny", "messages": [{"role": "user", "content": "\u0301" * 4_000_000}]}),
    ]:
        path = "/v1/completions" if field == "prompt" else "/v1/chat/completions"
        start = time.monotonic()
        r = httpx.post(server.url + path, json=body, timeout=120)
        took = time.monotonic() - start
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text[:300]
        assert "characters" in r.json()["error"]["message"]
        # Parsing 4 MB of JSON, not tokenizing it (which takes tens of seconds here).
        assert took < 5, took
    server.assert_no_leak()


def test_pathological_prompts_within_the_limit_do_not_stall_other_requests(long_context_server):
    # The longest prompts the limit lets through take seconds to tokenize (many more on a
    # loaded machine); meanwhile plain requests keep being answered.  With tokenization
    # on the event loop, the first plain request would wait for the whole of it.
    server, path = long_context_server
    limit = _limit(path)
    texts = {"no spaces": "q" * limit, "combining": "e" + "\u0301" * (limit - 1)}

    async def main():
        results = {}
        # A fresh connection per plain request: no race with the server's keep-alive timeout.
        fresh = httpx.Limits(max_keepalive_connections=0)
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=300) as c,
            httpx.AsyncClient(base_url=server.url, timeout=300, limits=fresh) as p,
        ):
            assert (await p.post("/v1/completions", json=PLAIN)).status_code == 200  # warm
            for name, text in texts.items():
                start = time.monotonic()
                bomb = asyncio.ensure_future(c.post("/v1/completions", json={**PLAIN, "prompt": text}))
                await asyncio.sleep(0.1)
                plain = []
                while not bomb.done():
                    t = time.monotonic()
                    r = await p.post("/v1/completions", json=PLAIN)
                    assert r.status_code == 200, r.text
                    plain.append(time.monotonic() - t)
                results[name] = (await bomb, time.monotonic() - start, plain)
        return results

    for name, (r, took, plain) in run(main()).items():
        # Far more than max_model_len tokens: refused after tokenizing, naming the field.
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (name, r.text[:300])
        assert took < 120, (name, took)
        # A tokenizer that finished within a second (a fast machine) had nothing to stall.
        if took > 1.0:
            assert len(plain) >= 2 and max(plain) < took * 0.75, (name, took, plain)
    server.assert_no_leak()
