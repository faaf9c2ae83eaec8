"""The operations surface: tokenizer routes, liveness routes, vLLM's metrics (names,
types, labels, counts) and the server's logs, TLS and root path."""

from __future__ import annotations

import json
import random
import shutil
import ssl
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.platforms.cpu.platform import CpuPlatform
from tests.server.conftest import STARTUP_TIMEOUT_S, TINY_SERVER_ARGS, ServerProcess, free_port

HISTOGRAMS = [
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "iteration_tokens_total",
    "time_per_output_token_seconds",
]


def _families(url: str, **kw) -> dict:
    text = httpx.get(url + "/metrics", timeout=10, **kw).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _samples(families: dict) -> dict[str, float]:
    return {
        s.name: s.value
        for f in families.values()
        for s in f.samples
        if "le" not in s.labels and "finished_reason" not in s.labels
    }


# -- tokenizer routes -------------------------------------------------------------------------


def test_tokenize_prompt_and_detokenize_round_trip(http, offline_tiny):
    tok = offline_tiny.get_tokenizer()
    text = "Hello there, tokenizer"
    r = http.post("/tokenize", json={"model": "tiny", "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode(text)
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == offline_tiny.llm_engine.max_model_len
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode(text, add_special_tokens=False) and plain["token_strs"] is None
    back = http.post("/detokenize", json={"model": "tiny", "tokens": plain["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_tokenize_chat_messages_uses_the_served_template(http, offline_tiny, chat_template):
    tok = offline_tiny.get_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    body = http.post("/tokenize", json={"messages": messages}).json()
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, chat_template=chat_template)
    assert body["tokens"] == tok.encode(expected, add_special_tokens=False)
    # continue_final_message ends the prompt inside the last message instead of closing it.
    partial = [*messages, {"role": "assistant", "content": "The answer"}]
    cont = http.post(
        "/tokenize", json={"messages": partial, "add_generation_prompt": False, "continue_final_message": True}
    ).json()
    assert tok.decode(cont["tokens"], skip_special_tokens=False).endswith("[assistant] The answer")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "a", "model": "other"}, "model"),
        ({"prompt": 3}, "prompt"),
        ({"prompt": "a", "not_a_field": 1}, "not_a_field"),
    ],
)
def test_tokenize_bad_requests(http, body, param):
    r = http.post("/tokenize", json=body)
    assert 400 <= r.status_code < 500
    assert r.json()["error"]["param"] == param


def test_detokenize_refuses_ids_outside_the_vocabulary(http, offline_tiny):
    vocab = offline_tiny.get_tokenizer().vocab_size
    for bad in (vocab, -1, 2**63):
        r = http.post("/detokenize", json={"tokens": [1, bad]})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == "tokens[1]"


def test_version_ping_ready(http):
    import pagedserve

    assert http.get("/version").json() == {"version": pagedserve.__version__}
    assert http.get("/ping").status_code == 200
    assert http.post("/ping").status_code == 200
    assert http.get("/ready").status_code == 200  # the start-up probe has come back


# -- metrics ------------------------------------------------------------------------------------


def test_every_vllm_histogram_counts_a_streamed_request(tiny_server, http):
    before = _families(tiny_server.url)
    for name in HISTOGRAMS:
        assert before[f"pagedserve:{name}"].type == "histogram", name
    info = before["pagedserve:cache_config_info"].samples[0]
    # No --block-size: the label is the block size the engine resolved from the CPU platform.
    block = str(CpuPlatform.default_block_size)
    assert info.value == 1.0 and info.labels["block_size"] == block and info.labels["engine"] == "0"

    prompt = [random.Random(11).randrange(3, 250) for _ in range(29)]
    with http.stream(
        "POST",
        "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 6, "ignore_eos": True, "stream": True},
    ) as r:
        assert r.status_code == 200
        chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks
    after = _families(tiny_server.url)
    b, a = _samples(before), _samples(after)

    def delta(name: str) -> float:
        return a[f"pagedserve:{name}"] - b.get(f"pagedserve:{name}", 0.0)

    for name in HISTOGRAMS:
        if name != "iteration_tokens_total":
            assert delta(f"{name}_count") == (5 if name == "inter_token_latency_seconds" else 1), name
    assert delta("iteration_tokens_total_count") >= 6  # one prefill step (or chunks) and five decodes
    assert delta("iteration_tokens_total_sum") >= 29 + 5
    assert delta("request_prompt_tokens_sum") == 29
    assert delta("request_generation_tokens_sum") == 6
    # The phases add up: queue + prefill = time to first token; prefill + decode = inference.
    ttft, queue, prefill = (
        delta(f"{n}_sum")
        for n in ("time_to_first_token_seconds", "request_queue_time_seconds", "request_prefill_time_seconds")
    )
    assert queue + prefill == pytest.approx(ttft, abs=1e-3)
    decode, inference = delta("request_decode_time_seconds_sum"), delta("request_inference_time_seconds_sum")
    assert prefill + decode == pytest.approx(inference, abs=1e-3)
    assert delta("inter_token_latency_seconds_sum") == pytest.approx(decode, rel=1e-3, abs=1e-4)


# -- a server with every operations flag ------------------------------------------------------


def _tls(cert) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert))


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(d / "key.pem"),
            "-out",
            str(d / "cert.pem"),
        ],
        check=True,
        capture_output=True,
    )
    return d / "key.pem", d / "cert.pem"


@pytest.fixture(scope="module")
def ops_server(tiny_llama, tls_files, tmp_path_factory):
    """The tiny model with every operations flag, over HTTPS (so started here: the shared
    helper polls plain HTTP)."""
    _, cert = tls_files
    args = [
        *TINY_SERVER_ARGS,
        "--served-model-name",
        "tiny",
        "--metrics-prefix",
        "vllm",
        "--log-format",
        "json",
        "--stats-interval",
        "0.3",
        "--enable-log-requests",
        "--max-log-len",
        "5",
        "--ssl-keyfile",
        str(tls_files[0]),
        "--ssl-certfile",
        str(cert),
        "--root-path",
        "/api",
    ]
    server = ServerProcess(str(tiny_llama), args, tmp_path_factory.mktemp("ops") / "server.log")
    server.port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", server.model, "--port", str(server.port), *args]
    with open(server.log_path, "ab") as log:
        server.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server.env)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert server.proc.poll() is None and time.monotonic() < deadline, server.log()[-3000:]
            try:
                if httpx.get(f"https://127.0.0.1:{server.port}/health", verify=_tls(cert), timeout=2).is_success:
                    break
            except httpx.HTTPError:
                time.sleep(0.25)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def ops(ops_server, tls_files):
    _, cert = tls_files
    with httpx.Client(base_url=f"https://127.0.0.1:{ops_server.port}", verify=_tls(cert), timeout=120) as c:
        yield ops_server, c


def test_https_and_root_path(ops):
    server, client = ops
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hello world", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    # --root-path is for a proxy that strips the prefix (as vLLM's and uvicorn's): the
    # routes answer at their own paths, and the app reports the prefix as its root path.
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    with pytest.raises(httpx.HTTPError):  # plain HTTP is not spoken on a TLS port
        httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5)


def test_vllm_prefix_names_every_series(ops):
    server, client = ops
    client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    for name in HISTOGRAMS:
        assert families[f"vllm:{name}"].type == "histogram", name
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "cache_config_info"):
        assert families[f"vllm:{name}"].type == "gauge", name
    for name in (
        "prompt_tokens",
        "generation_tokens",
        "request_success",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_preemptions",
    ):
        assert families[f"vllm:{name}"].type == "counter", name
    assert not [n for n in families if n.startswith("pagedserve:")]


def test_json_logs_stats_lines_and_request_logs(ops):
    server, client = ops
    r = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "A long prompt to cut", "max_tokens": 4, "ignore_eos": True}
    )
    rid = r.json()["id"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        records = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
        stats = [x for x in records if x["logger"] == "pagedserve.stats"]
        requests = [x for x in records if x.get("request_id") == rid]
        if stats and len(requests) == 2:
            break
        time.sleep(0.3)
    assert all({"time", "level", "logger", "message"} <= set(x) for x in records)
    assert any(x["stats"]["generation_throughput"] > 0 for x in stats), stats
    assert "Avg generation throughput" in stats[-1]["message"] and "KV cache usage" in stats[-1]["message"]
    received, finished = requests
    assert "prompt: 'A lon'" in received["message"]  # --max-log-len 5
    assert "generated_tokens=4" in finished["message"]
    non_json = [line for line in server.log().splitlines() if line.strip() and not line.startswith("{")]
    assert not non_json, non_json[:5]


def test_grafana_dashboard_uses_only_exported_series(tiny_server):
    import pathlib
    import re

    dashboard = json.loads((pathlib.Path(__file__).parents[2] / "examples/grafana/pagedserve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\$\{prefix\}:([a-z0-9_]+)", e)}
    assert len(used) >= 12
    # Labelled histograms and counters have no samples before their first observation.
    httpx.post(
        tiny_server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3}, timeout=60
    ).raise_for_status()
    text = httpx.get(tiny_server.url + "/metrics", timeout=10).text
    exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    missing = {m for m in used if f"pagedserve:{m}" not in exported}
    assert not missing, missing
