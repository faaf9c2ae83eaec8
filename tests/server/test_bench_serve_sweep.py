"""`pagedserve bench serve`: latency statistics, saturation, stream parsing and a rate sweep."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random

import httpx
import pytest

from pagedserve.entrypoints.cli import bench_serve, build_parser
from pagedserve.entrypoints.cli.bench_stats import (
    RequestResult,
    arrival_offsets,
    parse_rates,
    percentile,
    saturation_rate,
    summarize_rate,
)


def _args(*argv: str) -> argparse.Namespace:
    full = ["bench", "serve", *argv]
    return build_parser(full).parse_args(full)


def test_percentile_is_nearest_rank():
    values = [float(v) for v in random.Random(0).sample(range(1, 101), 100)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))


def test_latencies_from_known_timestamps():
    r = RequestResult(True, start=10.0, end=10.75, chunk_times=[10.2, 10.3, 10.45, 10.75], output_tokens=4)
    assert r.ttft == pytest.approx(0.2)
    assert r.itls == pytest.approx([0.1, 0.15, 0.3])
    assert r.latency == pytest.approx(0.75)
    assert r.tpot == pytest.approx(0.55 / 3)
    other = RequestResult(True, start=11.0, end=11.5, chunk_times=[11.1, 11.5], output_tokens=2)
    failed = RequestResult(False, start=11.0, error="HTTP 500")
    s = summarize_rate(2.0, [r, other, failed], [10.0, 11.0, 11.0], t0=10.0)
    assert (s["completed"], s["failed"], s["output_tokens"]) == (2, 1, 6)
    # ITL pools every gap of every request: 0.1, 0.15, 0.3, 0.4.
    assert s["itl_s"]["p50"] == pytest.approx(0.15)
    assert s["itl_s"]["p99"] == pytest.approx(0.4)
    assert s["itl_s"]["mean"] == pytest.approx(0.2375)
    assert s["ttft_s"]["p99"] == pytest.approx(0.2)
    assert s["e2e_s"]["p50"] == pytest.approx(0.5)
    assert s["elapsed_s"] == pytest.approx(1.5)
    assert s["output_tokens_per_s"] == pytest.approx(4.0)
    assert s["keeps_up"] is False  # a failed request never keeps up


def test_a_chunk_of_several_tokens_spreads_its_gap():
    r = RequestResult(True, 0.0, 1.0, chunk_times=[0.2, 0.3, 0.9], output_tokens=6, chunk_tokens=[1, 2, 3])
    assert r.itls == pytest.approx([0.05, 0.05, 0.2, 0.2, 0.2])
    assert len(r.itls) == r.output_tokens - 1


def _synthetic_rate(rate: float, capacity: float, n: int = 200, seed: int = 0) -> dict:
    """A single-server queue: requests arrive at `rate` (Poisson) and take 1/capacity s each."""
    sends = [10.0 + t for t in arrival_offsets(n, rate, random.Random(seed))]
    results, free_at = [], 0.0
    for t in sends:
        end = max(t, free_at) + 1.0 / capacity
        free_at = end
        results.append(RequestResult(True, start=t, end=end, chunk_times=[end - 0.5 / capacity, end], output_tokens=2))
    return summarize_rate(rate, results, sends, t0=10.0)


def test_saturation_detection_on_a_queue():
    rows = [_synthetic_rate(r, capacity=3.0) for r in (0.5, 1.0, 2.0, 4.0, 8.0)]
    assert [row["keeps_up"] for row in rows] == [True, True, True, False, False]
    assert saturation_rate(rows) == 2.0
    assert rows[-1]["achieved_rate"] == pytest.approx(3.0, rel=0.02)  # the service rate
    assert rows[-1]["ttft_s"]["p99"] > 10 * rows[0]["ttft_s"]["p99"]  # the queue grows


def test_saturation_edge_cases():
    kept, lost = _synthetic_rate(1.0, capacity=5.0), _synthetic_rate(9.0, capacity=5.0)
    assert saturation_rate([lost, kept]) is None  # the lowest rate already falls behind
    assert saturation_rate([kept]) == 1.0
    everything = summarize_rate(math.inf, [RequestResult(True, 0.0, 1.0, [0.5, 1.0], 2)] * 3, [0.0] * 3, 0.0)
    assert everything["keeps_up"] is False  # all at once is no rate to keep up with
    few = summarize_rate(1.0, [RequestResult(True, t, t + 0.1, [t + 0.1], 1) for t in (0, 1, 2)], [0, 1, 2], 0.0)
    assert few["keeps_up"] is False and math.isnan(few["offered_rate"])  # 3 requests prove nothing


def test_a_batch_finishing_together_is_not_keeping_up():
    # Continuous batching admits every request and slows all of them down: fixed-length
    # requests then finish together after the last arrival, however short their span.
    sends = [float(i) for i in range(40)]
    ends = [60.0 + 0.01 * i for i in range(40)]
    results = [RequestResult(True, s, e, [s + 1, e], 2) for s, e in zip(sends, ends)]
    row = summarize_rate(1.0, results, sends, 0.0)
    assert row["offered_rate"] == pytest.approx(1.0) and row["achieved_rate"] == 0.0
    assert not row["keeps_up"]
    # The same requests finishing 5 s after they came keep up, drain after the last arrival included.
    results = [RequestResult(True, s, s + 5, [s + 1, s + 5], 2) for s in sends]
    row = summarize_rate(1.0, results, sends, 0.0)
    assert row["keeps_up"] and row["achieved_rate"] == pytest.approx(20 / 19)  # ends 20..39, in [20, 39]


def test_arrivals_are_seeded_poisson():
    a = arrival_offsets(2000, 4.0, random.Random(3))
    assert a == arrival_offsets(2000, 4.0, random.Random(3))
    assert a[0] == 0.0 and all(y > x for x, y in zip(a, a[1:]))
    assert (a[-1] - a[0]) / (len(a) - 1) == pytest.approx(0.25, rel=0.08)
    assert arrival_offsets(5, math.inf, random.Random(3)) == [0.0] * 5


def test_rate_arguments():
    assert parse_rates("0.5,1,2,inf") == [0.5, 1.0, 2.0, math.inf]
    for bad in ("1,x", "", "0,1", "-1", "2,1", "1,1", "nan"):
        with pytest.raises(ValueError):
            parse_rates(bad)
    args = _args("--request-rates", "0.5,1", "--dataset", "mixed", "--backend", "llamacpp")
    assert (args.request_rates, args.dataset, args.backend) == ([0.5, 1.0], "mixed", "llamacpp")
    with pytest.raises(SystemExit):
        _args("--request-rates", "2,1")
    with pytest.raises(SystemExit):
        _args("--backend", "tgi")
    with pytest.raises(SystemExit, match="num-prompts"):
        bench_serve.run(_args("--request-rates", "1,2", "--num-prompts", "3"))
    with pytest.raises(SystemExit, match="127.0.0.1"):
        bench_serve.run(_args("--url", "http://example.com:8000"))


def _sse(chunks: list[dict], done: bool) -> bytes:
    lines = [f"data: {json.dumps(c)}\n\n" for c in chunks] + (["data: [DONE]\n\n"] if done else [])
    return "".join(lines).encode()


def _stream_one(backend: str, payload: bytes, status: int = 200) -> tuple[RequestResult, dict]:
    seen: dict = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["path"], seen["body"] = request.url.path, json.loads(request.content)
        return httpx.Response(status, content=payload, headers={"content-type": "text/event-stream"})

    async def go() -> RequestResult:
        path, body = bench_serve._request(backend, "m", [101, 102, 103], 4)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await bench_serve._one(client, "http://127.0.0.1:1", backend, path, body, {}, 10.0)

    return asyncio.run(go()), seen


def test_llamacpp_stream_counts_tokens():
    # The third chunk carries two tokens (llama-server holds back an incomplete UTF-8 character).
    chunks = [
        {"content": "a", "stop": False, "tokens_predicted": 1},
        {"content": "b", "stop": False, "tokens_predicted": 2},
        {"content": "cd", "stop": False, "tokens_predicted": 4},
        {"content": "", "stop": True, "tokens_predicted": 4, "timings": {}},
    ]
    r, seen = _stream_one("llamacpp", _sse(chunks, done=False))
    assert r.ok and r.output_tokens == 4 and len(r.chunk_times) == 3 and r.chunk_tokens == [1, 1, 2]
    assert len(r.itls) == 3  # the two-token chunk's gap counts for both of its tokens
    assert seen["path"] == "/completion"
    body = seen["body"]
    assert body["prompt"] == [101, 102, 103] and body["n_predict"] == 4
    assert body["ignore_eos"] is True and body["cache_prompt"] is False and body["temperature"] == 0.0


def test_openai_stream_counts_chunks_and_usage():
    chunks = [{"choices": [{"text": t, "index": 0}]} for t in ("a", "", "c", "d")]
    chunks.append({"choices": [], "usage": {"completion_tokens": 4, "prompt_tokens": 3}})
    r, seen = _stream_one("openai", _sse(chunks, done=True))
    assert r.ok and r.output_tokens == 4 and len(r.chunk_times) == 4
    assert seen["path"] == "/v1/completions" and seen["body"]["max_tokens"] == 4
    assert seen["body"]["ignore_eos"] is True and seen["body"]["model"] == "m"


def test_errors_are_results():
    r, _ = _stream_one("openai", b'{"error": {"message": "bad"}}', status=400)
    assert not r.ok and "HTTP 400" in r.error
    r, _ = _stream_one("llamacpp", _sse([{"error": {"message": "context full"}}], done=False))
    assert not r.ok and r.error == "context full"


def test_sweep_against_a_server(tiny_server, tiny_llama, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    argv = ["--url", tiny_server.url, "--served-model-name", "tiny", "--num-prompts", "4", "--input-len", "8"]
    argv += ["--output-len", "5", "--request-rates", "50,inf", "--probe-interval", "0", "--json-out", str(out)]
    assert bench_serve.run(_args(str(tiny_llama), *argv)) == 0
    result = json.loads(out.read_text())
    assert [row["request_rate"] for row in result["rates"]] == [50.0, "inf"]
    for row in result["rates"]:
        assert (row["completed"], row["failed"], row["output_tokens"]) == (4, 0, 20)
        assert 0 < row["ttft_s"]["p50"] <= row["e2e_s"]["p50"]
        assert 0 < row["itl_s"]["p50"] <= row["e2e_s"]["p99"]
    assert result["rates"][1]["keeps_up"] is False
    assert result["saturation_rate"] in (50.0, None)
    assert "saturation rate:" in capsys.readouterr().out
