"""`pagedserve serve --data-parallel-size 2`: two engine replicas behind one endpoint.

One server (two replica processes) serves the whole module, checked against the offline
`LLM` on the same tiny checkpoint; the last tests kill a replica and stop the server.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from pagedserve import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)

TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
ENGINE = {"dtype": "float32", "kv_cache_memory": "64MiB"}
SERVER_ARGS = [
    "--dtype",
    "float32",
    "--kv-cache-memory",
    "64MiB",
    "--served-model-name",
    "tiny",
    "--chat-template",
    TEMPLATE,
    "--data-parallel-size",
    "2",
    "--threads",
    "2",
    "--block-size",  # the affinity case counts its prefix in 16-token blocks
    "16",
]
CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DPServer:
    def __init__(self, model: Path, log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        cmd = [
            sys.executable,
            "-m",
            "pagedserve.entrypoints.cli",
            "serve",
            str(model),
            "--port",
            str(self.port),
            *SERVER_ARGS,
        ]
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.log()[-5000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def openai(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def metrics(self) -> dict[str, float]:
        """Every sample as {name{labels}: value}, model_name left out."""
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=10).text):
            for s in family.samples:
                labels = ",".join(
                    f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "platform", "engine")
                )
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def per_replica(self, name: str) -> list[float]:
        m = self.metrics()
        return [m[f"pagedserve:dp_replica_{name}{{replica={i}}}"] for i in range(2)]


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (from /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def _wait_for(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    s = DPServer(tiny_llama, tmp_path_factory.mktemp("dp") / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(model=str(tiny_llama), chat_template=TEMPLATE, threads=1, **ENGINE)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


@pytest.mark.compat("n_best_of", "dp")
def test_dp_answers_equal_one_engine(server, offline):
    client = server.openai()
    prompts = ["Hello world", "The quick brown fox", "Once upon a time", "1 2 3 4"]
    # Each prompt of a batch is routed on its own: both replicas answer part of it.
    resp = client.completions.create(model="tiny", prompt=prompts, max_tokens=12, temperature=0)
    ref = offline.generate(prompts, greedy(max_tokens=12), use_tqdm=False)
    assert [c.text for c in resp.choices] == [r.outputs[0].text for r in ref]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="tiny", prompt=prompts[2], max_tokens=12, temperature=0, stream=True)
    )
    assert streamed == ref[2].outputs[0].text
    # n > 1 and stop strings run inside the replica as in one engine.
    two = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=12, temperature=0, n=2)
    assert [c.text for c in two.choices] == [ref[0].outputs[0].text] * 2
    stop = ref[1].outputs[0].text[4:6]
    cut = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=12, temperature=0, stop=[stop])
    assert (
        cut.choices[0].text
        == offline.generate([prompts[1]], greedy(max_tokens=12, stop=[stop]), use_tqdm=False)[0].outputs[0].text
    )
    assert cut.choices[0].finish_reason == "stop"
    chat_ref = offline.chat(CONVERSATION, greedy(max_tokens=10), use_tqdm=False)[0].outputs[0].text
    chat = client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=10, temperature=0)
    assert chat.choices[0].message.content == chat_ref
    chunks = client.chat.completions.create(
        model="tiny", messages=CONVERSATION, max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_ref


@pytest.mark.compat("pooling", "dp")
@pytest.mark.compat("beam_search", "dp")
def test_embeddings_beam_search_and_cache_salt_reach_the_replicas(server, offline):
    """Requests the router once refused: /v1/embeddings, use_beam_search, cache_salt."""
    texts = ["Hello world", "The quick brown fox jumps"]
    r = httpx.post(server.url + "/v1/embeddings", timeout=60, json={"model": "tiny", "input": texts})
    assert r.status_code == 200, r.text
    got = [d["embedding"] for d in r.json()["data"]]
    want = [o.outputs.embedding for o in offline.embed(texts)]
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(list(w), abs=1e-4)
    from pagedserve.beam_search import BeamSearchParams

    body = {"model": "tiny", "prompt": texts[0], "max_tokens": 5, "n": 3, "use_beam_search": True}
    r = httpx.post(server.url + "/v1/completions", timeout=60, json=body)
    assert r.status_code == 200, r.text
    ref = offline.beam_search([texts[0]], BeamSearchParams(beam_width=3, max_tokens=5))[0]
    assert [c["text"] for c in r.json()["choices"]] == [s.text for s in ref.sequences]
    salted = {"model": "tiny", "prompt": texts[1], "max_tokens": 6, "temperature": 0, "cache_salt": "user-1"}
    r = httpx.post(server.url + "/v1/completions", timeout=60, json=salted)
    assert r.status_code == 200, r.text
    plain = offline.generate([texts[1]], greedy(max_tokens=6), use_tqdm=False)[0].outputs[0].text
    assert r.json()["choices"][0]["text"] == plain


def test_bad_input_is_refused_by_the_router(server):
    r = httpx.post(
        server.url + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": [5] * 1100, "max_tokens": 4}
    )
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
    r = httpx.post(
        server.url + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": [5, 10**6], "max_tokens": 4}
    )
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]


def test_requests_are_spread_over_both_replicas(server):
    before = server.per_replica("requests_routed_total")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 250) for _ in range(20)] for _ in range(6)]
    client = server.openai()
    threads = [
        threading.Thread(
            target=client.completions.create, kwargs=dict(model="tiny", prompt=p, max_tokens=24, temperature=0)
        )
        for p in prompts
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    after = server.per_replica("requests_routed_total")
    deltas = [a - b for a, b in zip(after, before)]
    assert sum(deltas) == 6 and min(deltas) >= 2, deltas
    m = server.metrics()
    assert m["pagedserve:dp_replica_up{replica=0}"] == m["pagedserve:dp_replica_up{replica=1}"] == 1
    assert "pagedserve:dp_replica_kv_cache_usage_perc{replica=1}" in m
    assert "pagedserve:dp_replica_num_requests_waiting{replica=0}" in m


def test_same_long_prefix_goes_to_the_same_replica(server):
    rng = random.Random(2)
    shared = [rng.randrange(3, 250) for _ in range(64)]  # four full blocks of 16
    before_routed = server.per_replica("requests_routed_total")
    before_hits = server.per_replica("prefix_cache_hits_total")
    client = server.openai()
    for i in range(4):
        client.completions.create(model="tiny", prompt=shared + [10 + i] * 5, max_tokens=2, temperature=0)
    routed = [a - b for a, b in zip(server.per_replica("requests_routed_total"), before_routed)]
    hits = [a - b for a, b in zip(server.per_replica("prefix_cache_hits_total"), before_hits)]
    assert sorted(routed) == [0, 4], routed
    home = routed.index(4)
    assert hits[home] >= 3 * 64 and hits[1 - home] == 0, hits


def test_closed_stream_is_aborted_in_its_replica(server):
    m = server.metrics()
    generated = m["pagedserve:generation_tokens_total"]
    body = {
        "model": "tiny",
        "prompt": list(range(3, 40)),
        "max_tokens": 900,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    _wait_for(lambda: server.metrics()["pagedserve:num_requests_running"] == 0, timeout=30)
    assert server.metrics()["pagedserve:generation_tokens_total"] - generated < 900


def test_killed_replica_fails_its_requests_and_the_other_serves(server, offline):
    rng = random.Random(3)
    shared = [rng.randrange(3, 250) for _ in range(48)]
    before = server.per_replica("requests_routed_total")
    whole: dict = {}

    def non_streamed() -> None:
        whole["response"] = httpx.post(
            server.url + "/v1/completions",
            timeout=120,
            json={"model": "tiny", "prompt": shared + [7], "max_tokens": 900, "ignore_eos": True, "temperature": 0},
        )

    waiter = threading.Thread(target=non_streamed)
    waiter.start()
    _wait_for(lambda: sum(server.per_replica("requests_routed_total")) == sum(before) + 1)
    body = {
        "model": "tiny",
        "prompt": shared + [9],
        "max_tokens": 900,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        next(lines)
        # Both went to one replica (same prefix): kill it under them.
        routed = [a - b for a, b in zip(server.per_replica("requests_routed_total"), before)]
        assert sorted(routed) == [0, 2], routed
        victim = routed.index(2)
        pid = server.health()["detail"][victim]["pid"]
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        rest = [line for line in lines if line]
    errors = [json.loads(line[6:])["error"] for line in rest if line.startswith('data: {"error"')]
    assert errors and f"data-parallel replica {victim}" in errors[0]["message"], rest[-3:]
    assert "exited with code -9" in errors[0]["message"] and rest[-1] == "data: [DONE]"
    waiter.join(60)
    response = whole["response"]
    assert response.status_code == 500 and "exited with code -9" in response.json()["error"]["message"]
    assert time.monotonic() - start < 30
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 200
    assert health.json()["status"] == "degraded" and health.json()["replicas_alive"] == 1
    assert server.metrics()[f"pagedserve:dp_replica_up{{replica={victim}}}"] == 0
    # New requests (the same prefix included) go to the survivor and are right.
    client = server.openai()
    prompts = [shared + [7], [5, 6, 7], "Hello world"]
    for p in prompts:
        resp = client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0)
        assert resp.choices[0].text == offline.generate([p], greedy(max_tokens=6), use_tqdm=False)[0].outputs[0].text
    routed = [a - b for a, b in zip(server.per_replica("requests_routed_total"), before)]
    assert routed[1 - victim] == 3


def test_sigterm_stops_every_replica(server):
    children = _descendants(server.proc.pid)
    assert len(children) >= 1  # the surviving replica (plus multiprocessing's helper)
    assert server.stop() == 0, server.log()[-3000:]
    _wait_for(lambda: all(_gone(pid) for pid in children), timeout=30)
    assert "data-parallel replicas stopped" in server.log()
