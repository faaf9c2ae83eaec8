"""Fixtures for the server tests: `pagedserve serve` subprocesses on free 127.0.0.1 ports.

Every server runs a tiny random checkpoint (from tests/conftest.py) in float32 so greedy
answers can be compared with the offline `LLM` on the same files; one module uses the
real default model.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

# Engine settings shared by the servers and the offline references they are compared with.
TINY_ENGINE = {"dtype": "float32", "kv_cache_memory": "64MiB"}
# One model thread: on a machine shared with other work, OpenMP teams of several threads
# wait on each other at every barrier and steps get many times slower.
TINY_SERVER_ARGS = ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--threads", "1"]
# --chat-template of `tiny_server`: unlike the checkpoint's own template, so a test can
# tell which one rendered a prompt.
CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
STARTUP_TIMEOUT_S = 300.0  # model load on a busy machine, plus a kernel build on a fresh one


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One `pagedserve serve` subprocess; its output goes to `log_path`."""

    def __init__(
        self,
        model: str | None,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
    ) -> None:
        self.model = model
        self.args = args
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.api_key = api_key
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self._terminated_at: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        for _ in range(3):  # the free port may be taken between probing and binding
            self.port = free_port()
            cmd = [
                sys.executable,
                "-m",
                "pagedserve.entrypoints.cli",
                "serve",
                *([self.model] if self.model else []),
                "--port",
                str(self.port),
                *self.args,
            ]
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
            self._terminated_at = None
            if self._wait_ready():
                return self
            if "address already in use" not in self.log().lower():
                break
        self.stop()
        raise RuntimeError(f"server did not become healthy; its log:\n{self.log()[-5000:]}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        return False

    def terminate(self) -> None:
        """SIGTERM (once) without waiting; ``stop`` waits for the exit."""
        if self.proc is not None and self._terminated_at is None and self.proc.poll() is None:
            self.proc.terminate()
            self._terminated_at = time.monotonic()

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL if it does not exit within ``timeout`` of the SIGTERM;
        returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(max(0.0, self._terminated_at + timeout - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(
            base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0, timeout=120, **kwargs
        )

    def async_openai(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0, timeout=180, **kwargs
        )

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as {name{labels}: value}, parsed by prometheus_client."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine"))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out


def _starter(tmp_path_factory, started: list[ServerProcess]) -> Callable[..., ServerProcess]:
    def start(
        model: str | None, args: list[str], env: dict[str, str] | None = None, api_key: str | None = None
    ) -> ServerProcess:
        log = tmp_path_factory.mktemp("server") / "server.log"
        server = ServerProcess(model, args, log, env, api_key)
        started.append(server)
        return server.start()

    return start


def _stop_all(servers: list[ServerProcess]) -> None:
    """SIGTERM every server first, then wait for each: they shut down side by side."""
    for server in servers:
        server.terminate()
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def _ending_servers() -> Iterator[list[ServerProcess]]:
    """Servers told to stop at the end of their module, waited for at the end of the session."""
    ending: list[ServerProcess] = []
    yield ending
    _stop_all(ending)


@pytest.fixture(scope="session")
def session_server_factory(tmp_path_factory) -> Iterator[Callable[..., ServerProcess]]:
    """Start servers that live for the whole session (``tiny_server``)."""
    started: list[ServerProcess] = []
    yield _starter(tmp_path_factory, started)
    _stop_all(started)


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory, _ending_servers) -> Iterator[Callable[..., ServerProcess]]:
    """Start servers on demand.  When the module that started them ends, each one still
    running is sent SIGTERM (so that it frees its memory while later modules run) and
    waited for at the end of the session (its shutdown overlaps later tests)."""
    started: list[ServerProcess] = []
    yield _starter(tmp_path_factory, started)
    for server in started:
        server.terminate()
    _ending_servers.extend(started)


@pytest.fixture(scope="session")
def tiny_server_args() -> list[str]:
    """Engine flags of every tiny-model server (they match `TINY_ENGINE`)."""
    return list(TINY_SERVER_ARGS)


@pytest.fixture(scope="session")
def chat_template() -> str:
    return CHAT_TEMPLATE


@pytest.fixture(scope="session")
def tiny_server(session_server_factory, tiny_llama, tmp_path_factory) -> ServerProcess:
    """The main test server: the tiny Llama under the names "tiny" and "tiny-alias", a
    1 MiB body limit and CHAT_TEMPLATE from a file."""
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    return session_server_factory(
        str(tiny_llama),
        [
            *TINY_SERVER_ARGS,
            "--served-model-name",
            "tiny",
            "tiny-alias",
            "--max-body-size",
            "1MiB",
            "--chat-template",
            str(template),
        ],
    )


@pytest.fixture(scope="session")
def offline_tiny(tiny_llama):
    """The offline API on the same checkpoint, settings and chat template as `tiny_server`."""
    from pagedserve import LLM

    return LLM(model=str(tiny_llama), chat_template=CHAT_TEMPLATE, **TINY_ENGINE)


@pytest.fixture
def http(tiny_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny_server.url, timeout=120) as client:
        yield client
