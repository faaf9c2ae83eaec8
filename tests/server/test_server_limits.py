"""A server with an API key (from the environment), one running sequence at most and a
waiting queue of one: 401 without the key, 503 when the queue is full, and a clean exit
on SIGTERM (the last test here: it stops this module's server)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def limited(server_factory, tiny_checkpoint_factory, tiny_server_args):
    # A somewhat larger random model, so that a long request surely outlives the test's
    # few round trips.
    model = tiny_checkpoint_factory(hidden_size=128, num_layers=4, intermediate_size=256)
    return server_factory(
        str(model),
        [*tiny_server_args, "--served-model-name", "limited", "--max-num-seqs", "1", "--max-queue-len", "1"],
        env={"PAGEDSERVE_API_KEY": KEY},
        api_key=KEY,
    )


def small(**kw) -> dict:
    return {"model": "limited", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, **kw}


def test_every_v1_route_needs_the_key(limited):
    url = limited.url
    for method, path in [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models/limited"),
    ]:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": KEY},
            {"Authorization": f"Basic {KEY}"},
        ):
            r = httpx.request(method, url + path, headers=headers, json=small(), timeout=30)
            assert r.status_code == 401, (path, headers)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
    # Refused before the body is read: even an oversized body gets 401, not 413.
    r = httpx.post(url + "/v1/completions", content=b"x" * (20 * 2**20), timeout=60)
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_the_key_opens_v1_and_health_metrics_stay_open(limited):
    client = limited.openai()
    assert [m.id for m in client.models.list().data] == ["limited"]
    assert client.completions.create(**small()).usage.completion_tokens == 3
    assert httpx.get(limited.url + "/health").status_code == 200
    assert httpx.get(limited.url + "/metrics").status_code == 200


def _wait_for(pred, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_full_waiting_queue_answers_503(limited):
    client = limited.openai()
    running = client.completions.create(stream=True, **small(max_tokens=1000, extra_body={"ignore_eos": True}))
    chunks = iter(running)
    next(chunks)  # the long request is now running and holds the only sequence slot
    headers = limited.headers()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(httpx.post, limited.url + "/v1/completions", json=small(), headers=headers, timeout=300)
        _wait_for(lambda: limited.metrics()["pagedserve:num_requests_waiting"] == 1)
        r = httpx.post(limited.url + "/v1/completions", json=small(), headers=headers, timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "queue_full" and "max_queue_len=1" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "1"
        still_running = next(chunks).choices[0].finish_reason is None
        running.close()  # frees the slot: the waiting request runs
        assert waiting.result(timeout=300).status_code == 200
    assert still_running
    assert client.completions.create(**small()).choices[0].finish_reason == "length"


def test_a_request_larger_than_the_queue_is_400_not_503(limited):
    # A request of more sequences than max_queue_len can never be queued: retrying a 503
    # would never succeed, so it is refused as the request's fault, before anything runs.
    headers = limited.headers()
    for body, param in [(small(n=2), "n"), (small(prompt=[[5, 6], [7, 8]]), "prompt")]:
        r = httpx.post(limited.url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "max_queue_len" in err["message"] and "2 sequences" in err["message"]
    assert limited.metrics()["pagedserve:num_requests_waiting"] == 0
    assert httpx.post(limited.url + "/v1/completions", json=small(), headers=headers, timeout=60).status_code == 200


def test_sigterm_finishes_open_streams_then_exits_cleanly(limited):
    client = limited.openai()
    stream = client.completions.create(stream=True, **small(max_tokens=200, extra_body={"ignore_eos": True}))
    chunks = iter(stream)
    first = next(chunks)
    result: dict = {}

    def drain() -> None:
        text, finish = first.choices[0].text, None
        for c in chunks:
            text += c.choices[0].text
            finish = c.choices[0].finish_reason or finish
        result["finish"] = finish

    reader = threading.Thread(target=drain)
    reader.start()
    limited.proc.terminate()
    rc = limited.proc.wait(60)
    reader.join(60)
    log = limited.log()
    assert rc == 0, log[-3000:]
    assert result.get("finish") == "length"  # the open stream was allowed to finish
    assert "engine stopped" in log and "server stopped" in log
    assert "Traceback" not in log
