"""New families through the OpenAI-compatible server: ``pagedserve serve`` on a tiny
random checkpoint returns, for token-id prompts at temperature 0, as many tokens as
asked whose logprobs are those of transformers' greedy tokens (a different token would
need transformers' top logprob to the fourth decimal), with chunked prefill and prefix
caching on.  Token ids themselves are compared through ``LLM`` in test_models_vs_hf."""

from __future__ import annotations

import math
import socket
import subprocess
import sys
import time

import httpx
import pytest
from test_models_vs_hf import _prompts, build_checkpoint, hf_reference

CASES = [
    "gemma2-window-softcap",
    "qwen3moe-qknorm",
    "deepseekv2-lite-mla",
    "gptoss-sinks-window-moe",
    "deepseekv3-groups-yarn",
    "olmo3-window-per-type-rope",
]
MAX_NEW = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case", CASES)
def test_server_completions_match_transformers(case, tmp_path):
    model = build_checkpoint(tmp_path / "ckpt", case)
    prompts = _prompts(3)[1:4]
    expected = [hf_reference(model, p, MAX_NEW) for p in prompts]
    port = _free_port()
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagedserve.entrypoints.cli",
            "serve",
            str(tmp_path / "ckpt"),
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "16MiB",
            "--threads",
            "1",
            "--max-num-batched-tokens",
            "8",
            "--block-size",
            "4",
            "--served-model-name",
            "tiny",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
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
        for prompt, (_, logprobs) in zip(prompts, expected):
            body = {
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": MAX_NEW,
                "temperature": 0.0,
                "ignore_eos": True,
                "logprobs": 0,
            }
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            got = r.json()["choices"][0]["logprobs"]["token_logprobs"]
            assert len(got) == len(logprobs)
            for a, b in zip(got, logprobs):
                assert math.isclose(a, b, abs_tol=2e-4)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
