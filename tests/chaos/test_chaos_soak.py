"""Soak: many requests through two `pagedserve serve` processes of the tiny model, one
with a LoRA adapter and one with n-gram speculation (the two cannot share an engine),
mixing plain and streamed greedy requests, n>1 sampling, structured outputs (regex and
choice), LoRA, clients that hang up mid-stream and clients that give up before the
answer.  Afterwards: every completed greedy answer equals the answer the same prompt
got alone (the speculative server's equal the plain server's), every structured answer
matches its constraint, no KV block is left in use, the servers still answer, and each
server's RSS grew by at most RSS_GROWTH_MB after warm-up.

The CI version sends 300 requests; the `slow` one 10,000 (docs/serving.md,
"Guarantees", has the measured figures).  The seed is printed; set
PAGEDSERVE_SOAK_SEED to replay one."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from pathlib import Path

import httpx
import pytest
from chaos_helpers import read_stream, run
from live_server import TINY_ARGS, LiveServer, kv_cache_usage

pytestmark = pytest.mark.timeout(3600)

#: RSS growth allowed after warm-up (MiB), per server, by soak size.  Measured
#: (docs/serving.md, "Guarantees"): 2.7 / 1.2 MiB (LoRA / speculative server) over 300
#: requests; 57.0 / 29.8 MiB over 10,000, which is about 6 KiB a request on the LoRA
#: server and not yet explained (a slow leak or allocator growth).
RSS_GROWTH_MB = {300: 32, 10_000: 96}
CONCURRENCY = 24
REGEX = "[ab]{2,5}c"
CHOICES = ["alpha", "beta", "gamma"]


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _prompts(rng: random.Random) -> list[list[int]]:
    # Repeated phrases give n-gram speculation something to propose.
    out = []
    for _ in range(16):
        phrase = [rng.randrange(3, 250) for _ in range(rng.randrange(2, 5))]
        out.append(phrase * rng.randrange(1, 4) + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 20))])
    return out


def _make_adapter(model_path: Path, out: Path) -> Path:
    import sys

    import transformers

    sys.path.insert(0, str(Path(__file__).parents[1] / "lora"))
    from peft_adapters import make_adapter

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_path))
    return make_adapter(hf, out, seed=3, r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"), std=0.1)


@pytest.fixture(scope="module")
def servers(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("soak")
    lora = _make_adapter(tiny_llama, tmp / "lora")
    plain = LiveServer(
        str(tiny_llama),
        [*TINY_ARGS, "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"soak-lora={lora}"],
        tmp / "plain.log",
    )
    try:
        ngram = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
        spec = LiveServer(str(tiny_llama), [*TINY_ARGS, "--speculative-config", ngram], tmp / "spec.log")
    except BaseException:
        plain.stop()
        raise
    try:
        yield plain, spec
    finally:
        spec.stop()
        plain.stop()


def _max_tokens(i: int) -> int:
    return 6 + i % 11


async def _post(client: httpx.AsyncClient, body: dict) -> dict:
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def _solo(url: str, prompts: list[list[int]], model: str) -> list[str]:
    """Each prompt's greedy text, sent alone."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        out = []
        for i, p in enumerate(prompts):
            body = {"model": model, "prompt": p, "max_tokens": _max_tokens(i), "temperature": 0, "ignore_eos": True}
            out.append((await _post(c, body))["choices"][0]["text"])
        return out


KINDS = ["greedy", "stream", "lora", "spec", "spec-stream", "n2", "regex", "choice", "cut", "give-up"]
WEIGHTS = [20, 15, 15, 12, 8, 8, 8, 4, 5, 5]


async def _one(kind: str, i: int, p: list[int], plain: httpx.AsyncClient, spec: httpx.AsyncClient, seed: int) -> dict:
    greedy = {"model": "tiny", "prompt": p, "max_tokens": _max_tokens(i), "temperature": 0, "ignore_eos": True}
    if kind == "greedy":
        return {"text": (await _post(plain, greedy))["choices"][0]["text"]}
    if kind == "lora":
        return {"text": (await _post(plain, {**greedy, "model": "soak-lora"}))["choices"][0]["text"]}
    if kind == "spec":
        return {"text": (await _post(spec, greedy))["choices"][0]["text"]}
    if kind in ("stream", "spec-stream"):
        out = await read_stream(spec if kind == "spec-stream" else plain, greedy)
        assert out["status"] == 200 and out["done"] and not out["errors"], out
        return {"text": out["text"]}
    if kind == "n2":
        body = {**greedy, "n": 2, "temperature": 1.0, "seed": seed, "max_tokens": 8}
        choices = (await _post(plain, body))["choices"]
        assert sorted(c["index"] for c in choices) == [0, 1] and all(c["finish_reason"] == "length" for c in choices)
        return {}
    if kind == "regex":
        body = {**greedy, "max_tokens": 16, "ignore_eos": False, "guided_regex": REGEX}
        text = (await _post(plain, body))["choices"][0]["text"]
        assert re.fullmatch(REGEX, text), text
        return {}
    if kind == "choice":
        body = {**greedy, "max_tokens": 16, "ignore_eos": False, "guided_choice": CHOICES}
        text = (await _post(plain, body))["choices"][0]["text"]
        assert text in CHOICES, text
        return {}
    if kind == "cut":
        out = await read_stream(plain if i % 2 else spec, {**greedy, "max_tokens": 40}, stop_after=2)
        assert out["status"] == 200 and not out["errors"], out
        return {}
    if kind == "give-up":
        client = plain if i % 2 else spec
        try:  # the client stops waiting long before the answer; the server must clean up
            await client.post("/v1/completions", json={**greedy, "max_tokens": 60}, timeout=0.05)
        except httpx.TimeoutException:
            pass
        return {}
    raise AssertionError(kind)


async def _quiet(server: LiveServer, timeout: float = 60) -> None:
    """Wait until no KV block is in use (every request, aborted ones included, freed)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (usage := kv_cache_usage(server.url)) > 0:
        assert asyncio.get_running_loop().time() < deadline, f"KV blocks still in use: {usage}"
        await asyncio.sleep(0.2)


async def _soak(servers, n: int, seed: int) -> dict:
    plain_srv, spec_srv = servers
    rng = random.Random(seed)
    prompts = _prompts(rng)
    base = await _solo(plain_srv.url, prompts, "tiny")
    with_lora = await _solo(plain_srv.url, prompts, "soak-lora")
    assert base != with_lora, "the adapter should change some answers"
    plan = [(rng.choices(KINDS, WEIGHTS)[0], rng.randrange(len(prompts))) for _ in range(n)]
    warm = max(50, n // 10)
    started = time.monotonic()
    rss: dict[str, list[float]] = {"plain": [], "spec": []}
    counts: dict[str, int] = {}
    sem = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY * 2)
    async with (
        httpx.AsyncClient(base_url=plain_srv.url, timeout=120, limits=limits) as plain,
        httpx.AsyncClient(base_url=spec_srv.url, timeout=120, limits=limits) as spec,
    ):

        async def task(j: int) -> None:
            kind, i = plan[j]
            async with sem:
                got = await _one(kind, i, prompts[i], plain, spec, seed + j)
            counts[kind] = counts.get(kind, 0) + 1
            if "text" in got:
                expected = with_lora[i] if kind == "lora" else base[i]
                assert got["text"] == expected, (kind, i, got["text"], expected)

        for part in (range(warm), range(warm, n)):
            await asyncio.gather(*(task(j) for j in part))
            for srv in servers:
                await _quiet(srv)
            rss["plain"].append(_rss_mb(plain_srv.proc.pid))
            rss["spec"].append(_rss_mb(spec_srv.proc.pid))
        # Both still serve, and answer as before.
        body = {"model": "tiny", "prompt": prompts[0], "max_tokens": _max_tokens(0), "temperature": 0}
        for client in (plain, spec):
            assert (await _post(client, {**body, "ignore_eos": True}))["choices"][0]["text"] == base[0]
    return {"counts": counts, "rss_mb": rss, "seconds": round(time.monotonic() - started, 1)}


@pytest.mark.parametrize("n", [300, pytest.param(10_000, marks=pytest.mark.slow)])
def test_soak_mixed_requests_leak_nothing_and_answer_as_alone(servers, n):
    seed = int(os.environ.get("PAGEDSERVE_SOAK_SEED") or random.SystemRandom().randrange(2**31))
    print(f"soak seed {seed} (PAGEDSERVE_SOAK_SEED={seed} replays it)")
    out = run(_soak(servers, n, seed), timeout=3000)
    print(f"soak {n}: {out}")
    assert set(out["counts"]) == set(KINDS), out["counts"]
    for name, (warm, end) in out["rss_mb"].items():
        assert end - warm <= RSS_GROWTH_MB[n], f"{name} server RSS grew {end - warm:.1f} MiB after warm-up: {out}"
    for srv in servers:
        assert srv.proc.poll() is None
        assert "Traceback" not in srv.log(), srv.log()[-4000:]
