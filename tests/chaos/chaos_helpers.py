"""Chaos suite helpers: the tiny model served in this process (so a test can inject
faults with monkeypatch), SSE stream reading, and offline greedy references."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import uvicorn

from pagedserve import LLM, SamplingParams
from pagedserve.async_engine import AsyncLLMEngine
from pagedserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.engine import LLMEngine
from pagedserve.entrypoints.openai import ServerSettings, build_app
from pagedserve.entrypoints.openai.shutdown import CUT_MARGIN_S, GracefulServer

ENGINE = {"dtype": "float32", "kv_cache_memory": "32MiB", "max_num_seqs": 256}


class InProcessServer:
    """build_app over a fresh AsyncLLMEngine, served by uvicorn in a thread of this process."""

    def __init__(self, model: str, grace_s: float = 5.0) -> None:
        self.engine = LLMEngine(
            EngineConfig(
                model=ModelConfig(model=model, dtype=ENGINE["dtype"]),
                cache=CacheConfig(kv_cache_memory=ENGINE["kv_cache_memory"]),
                scheduler=SchedulerConfig(max_num_seqs=ENGINE["max_num_seqs"]),
            )
        )
        self.async_engine = AsyncLLMEngine(self.engine)
        self.app = build_app(self.async_engine, ServerSettings(["tiny"]))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            timeout_graceful_shutdown=grace_s + CUT_MARGIN_S,
        )
        self.server = GracefulServer(config, self.app.state.drain, grace_s)
        self.thread = threading.Thread(target=self.server.run, name="chaos-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "in-process server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive(), "in-process server did not stop"

    def assert_no_leak(self, timeout: float = 30.0) -> None:
        """Every request gone from the engine and every KV block back in the pool."""
        deadline = time.monotonic() + timeout
        while self.engine.has_unfinished_requests() or self.engine.kv.usage() > 0:
            assert time.monotonic() < deadline, (
                f"leak: {self.engine.get_num_unfinished_requests()} requests, KV usage {self.engine.kv.usage():.3f}"
            )
            time.sleep(0.05)
        self.engine.kv.pool.check_invariants()


def solo_texts(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """Each prompt's greedy text, generated alone."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].text for p in prompts]


async def read_stream(client: httpx.AsyncClient, body: dict, stop_after: int | None = None) -> dict:
    """POST a streamed completion and read its events.

    Returns {"status", "text", "finish_reason", "errors": [error objects], "done": saw [DONE],
    "cut": True when this client hung up after `stop_after` events}.
    """
    out = {"status": None, "text": "", "finish_reason": None, "errors": [], "done": False, "cut": False}
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["errors"].append(json.loads(await r.aread())["error"])
            return out
        events = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                out["done"] = True
                break
            event = json.loads(data)
            if "error" in event:
                out["errors"].append(event["error"])
                continue
            for c in event["choices"]:
                out["text"] += c["text"]
                out["finish_reason"] = c["finish_reason"] or out["finish_reason"]
            events += 1
            if stop_after is not None and events >= stop_after:
                out["cut"] = True
                break  # leaving the block closes the connection mid-stream
    return out


def run(coro, timeout: float = 300):
    return asyncio.run(asyncio.wait_for(coro, timeout))
