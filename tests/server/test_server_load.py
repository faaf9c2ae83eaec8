"""Many concurrent clients, clients that disconnect, and /metrics."""

from __future__ import annotations

import asyncio
import random
import socket
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedserve import SamplingParams

NUM_CLIENTS = 32


def _wait_for(pred, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_concurrent_clients_all_get_the_offline_answer(tiny_server, offline_tiny):
    rng = random.Random(0)
    shared = [rng.randrange(3, 250) for _ in range(20)]  # some prompts share a cached prefix
    prompts = [
        (shared if i % 3 == 0 else []) + [rng.randrange(3, 250) for _ in range(rng.randint(1, 40))]
        for i in range(NUM_CLIENTS)
    ]
    lengths = [rng.randint(4, 24) for _ in range(NUM_CLIENTS)]
    refs = offline_tiny.generate(
        prompts, [SamplingParams(temperature=0, max_tokens=n) for n in lengths], use_tqdm=False
    )

    async def one(client, i: int) -> str:
        if i % 2:  # half stream, half do not
            stream = await client.completions.create(
                model="tiny", prompt=prompts[i], max_tokens=lengths[i], temperature=0, stream=True
            )
            return "".join([c.choices[0].text async for c in stream if c.choices])
        resp = await client.completions.create(model="tiny", prompt=prompts[i], max_tokens=lengths[i], temperature=0)
        return resp.choices[0].text

    async def main() -> list[str]:
        async with tiny_server.async_openai() as client:
            return await asyncio.gather(*(one(client, i) for i in range(NUM_CLIENTS)))

    texts = asyncio.run(main())
    assert texts == [r.outputs[0].text for r in refs]


def _generated(server) -> float:
    return server.metrics()["pagedserve:generation_tokens_total"]


def _idle(server) -> bool:
    m = server.metrics()
    return (
        m["pagedserve:num_requests_running"] == 0
        and m["pagedserve:num_requests_waiting"] == 0
        and m["pagedserve:kv_cache_usage_perc"] == 0
    )


def test_stream_closed_early_is_aborted_and_frees_its_blocks(tiny_server):
    _wait_for(lambda: _idle(tiny_server))
    before = _generated(tiny_server)
    body = {
        "model": "tiny",
        "prompt": list(range(3, 200)),
        "max_tokens": 800,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert tiny_server.metrics()["pagedserve:kv_cache_usage_perc"] > 0
    # The connection is closed: the engine must drop the request long before 800 tokens.
    _wait_for(lambda: _idle(tiny_server), timeout=30)
    assert _generated(tiny_server) - before < 800


def test_non_streamed_request_is_aborted_when_its_client_leaves(tiny_server):
    _wait_for(lambda: _idle(tiny_server))
    before = _generated(tiny_server)
    body = b'{"model": "tiny", "prompt": [5, 6], "max_tokens": 1000, "ignore_eos": true}'
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    with socket.create_connection(("127.0.0.1", tiny_server.port)) as s:
        s.sendall(request)
        _wait_for(lambda: tiny_server.metrics()["pagedserve:num_requests_running"] == 1)
    _wait_for(lambda: _idle(tiny_server), timeout=30)
    assert _generated(tiny_server) - before < 1000


def test_metrics_parse_and_count_a_request(tiny_server):
    _wait_for(lambda: _idle(tiny_server))
    text = httpx.get(tiny_server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = {
        "pagedserve:num_requests_running": "gauge",
        "pagedserve:num_requests_waiting": "gauge",
        "pagedserve:kv_cache_usage_perc": "gauge",
        "pagedserve:prefix_cache_queries": "counter",
        "pagedserve:prefix_cache_hits": "counter",
        "pagedserve:num_preemptions": "counter",
        "pagedserve:prompt_tokens": "counter",
        "pagedserve:generation_tokens": "counter",
        "pagedserve:time_to_first_token_seconds": "histogram",
        "pagedserve:time_per_output_token_seconds": "histogram",
        "pagedserve:e2e_request_latency_seconds": "histogram",
        "pagedserve:request_success": "counter",
    }
    assert {name: families[name].type for name in expected} == expected
    assert all(
        s.labels.get("model_name") == "tiny"
        for f in families.values()
        if f.name.startswith("pagedserve:")
        for s in f.samples
    )

    before = tiny_server.metrics()
    prompt = [random.Random(7).randrange(3, 250) for _ in range(37)]  # fresh: no prefix-cache hit
    r = httpx.post(
        tiny_server.url + "/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": prompt, "max_tokens": 7, "ignore_eos": True},
    )
    assert r.json()["usage"]["completion_tokens"] == 7
    after = tiny_server.metrics()

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("pagedserve:generation_tokens_total") == 7
    assert delta("pagedserve:prompt_tokens_total") == 37
    assert delta("pagedserve:prefix_cache_queries_total") == 37
    assert delta("pagedserve:time_to_first_token_seconds_count") == 1
    assert delta("pagedserve:e2e_request_latency_seconds_count") == 1
    assert delta("pagedserve:time_per_output_token_seconds_count") == 1
    assert delta("pagedserve:request_success_total{finished_reason=length}") == 1
    assert after["pagedserve:e2e_request_latency_seconds_sum"] >= after["pagedserve:time_to_first_token_seconds_sum"]
