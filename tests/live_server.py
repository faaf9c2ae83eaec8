"""A `pagedserve serve` subprocess on a free 127.0.0.1 port, for the fuzz and chaos suites.

with LiveServer(model, ["--dtype", "float32"], tmp_path / "log") as server:
    httpx.get(server.url + "/health")
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

__all__ = ["LiveServer", "TINY_ARGS", "kv_cache_usage"]

# Float32 so greedy answers match the offline LLM; one thread: on a shared machine OpenMP
# teams of several threads wait on each other at every barrier.
TINY_ARGS = ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--threads", "1", "--served-model-name", "tiny"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, model: str | None, args: list[str], log_path: Path, startup_s: float = 300.0) -> None:
        self.log_path = log_path
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "pagedserve.entrypoints.cli",
            "serve",
            *([model] if model else []),
            "--port",
            str(self.port),
            *args,
        ]
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
            )
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server did not become healthy; its log:\n{self.log()[-5000:]}")

    def __enter__(self) -> LiveServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def kv_cache_usage(url: str) -> float:
    """`pagedserve:kv_cache_usage_perc` from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pagedserve:kv_cache_usage_perc":
                return s.value
    raise AssertionError("no pagedserve:kv_cache_usage_perc in /metrics")
