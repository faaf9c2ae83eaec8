"""A hybrid family through the OpenAI-compatible server: ``pagedserve serve`` on a tiny
random Qwen3.5 checkpoint (Gated DeltaNet and gated attention; LFM2 and Jamba too, slow) with prefix caching on
(state checkpoints every 2 blocks of 4 tokens) and 8-token chunks returns transformers'
greedy logprobs for concurrent token-id prompts of different lengths, the second time
from cached prefixes."""

from __future__ import annotations

import math
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_models_hybrid_vs_hf import _prompts, build_checkpoint, hf_reference

#: Qwen3.5 runs in CI; LFM2 (short convolutions) and Jamba (Mamba 1, MoE) are slow.
CASES = [
    "qwen3_5-deltanet-gated-attn",
    pytest.param("lfm2-shortconv-bias-attn", marks=pytest.mark.slow),
    pytest.param("jamba-mamba1-moe-attn", marks=pytest.mark.slow),
]
MAX_NEW = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(ckpt, port: int, log, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", str(ckpt), "--port", str(port)]
    args += ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--threads", "1", "--served-model-name", "tiny"]
    return subprocess.Popen([*args, *extra], stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("case", CASES)
def test_hybrid_server_completions_match_transformers(tmp_path, case):
    model = build_checkpoint(tmp_path / "ckpt", case)
    prompts = _prompts(3)[:3]
    check_server_matches(tmp_path / "ckpt", prompts, [hf_reference(model, p, MAX_NEW) for p in prompts], tmp_path)


def check_server_matches(ckpt, prompts: list[list[int]], expected, tmp_path) -> None:
    """``pagedserve serve`` on ``ckpt`` (prefix caching, state checkpoints every 2 blocks
    of 4 tokens, 8-token chunks): concurrent completions of ``prompts``, twice (the second
    round from cached prefixes), give ``expected``'s logprobs."""
    port = _free_port()
    log = open(tmp_path / "server.log", "wb")
    proc = _serve(
        ckpt,
        port,
        log,
        "--state-checkpoint-interval",
        "2",
        "--max-num-batched-tokens",
        "8",
        "--block-size",
        "4",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text(errors="replace")[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.25)

        def complete(prompt: list[int]) -> list[float]:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0.0}
            body |= {"ignore_eos": True, "logprobs": 0}
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["logprobs"]["token_logprobs"]

        for _ in range(2):  # the second round hits the prefixes (and checkpoints) of the first
            with ThreadPoolExecutor(len(prompts)) as pool:  # batched together in the server's steps
                results = list(pool.map(complete, prompts))
            for got, (_, logprobs) in zip(results, expected):
                assert len(got) == len(logprobs)
                for a, b in zip(got, logprobs):
                    assert math.isclose(a, b, abs_tol=2e-4)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
