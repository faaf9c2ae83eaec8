"""Chaos across processes: SIGTERM while streams run, a tensor-parallel worker killed
mid-step, a data-parallel replica killed mid-stream.  Every request still open is
answered or ends with an error event, nothing hangs, and the server process ends the
way docs/serving.md says (0 after SIGTERM, 1 after an engine failure)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from live_server import TINY_ARGS, LiveServer, kv_cache_usage

pytestmark = pytest.mark.timeout(600)

LONG = {"model": "tiny", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
# Streams that must still be running when the chaos strikes get a long context, so that
# none can finish on its own first, however fast the machine decodes (1,000 tokens of the
# tiny model can all be done before a loaded machine delivers a stream's first event).
LONG_CONTEXT, MANY = 32768, 30000


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class _Stream(threading.Thread):
    """Reads one streamed completion in a thread; `first` is set at its first event."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int = LONG["max_tokens"]) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.first = threading.Event()
        self.lines: list[str] = []
        self.failure: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            body = {**LONG, "prompt": self.prompt, "stream": True, "max_tokens": self.max_tokens}
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.first.set()
        except BaseException as e:  # noqa: BLE001 - examined by the test
            self.failure = e
        finally:
            self.first.set()

    def errors(self) -> list[dict]:
        return [json.loads(line[6:])["error"] for line in self.lines if line.startswith('data: {"error"')]


def _hang_up_mid_upload(port: int) -> None:
    """A client that announces 1000 bytes of body, sends 20 and closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "hello", '
        )
        time.sleep(0.3)  # the server is now inside the body read
    time.sleep(0.3)


def test_sigterm_mid_stream_ends_every_stream_with_an_error_event(tiny_checkpoint_factory, tmp_path):
    model = tiny_checkpoint_factory(max_position_embeddings=LONG_CONTEXT)
    server = LiveServer(str(model), [*TINY_ARGS, "--timeout-graceful-shutdown", "0.5"], tmp_path / "log")
    try:
        streams = [_Stream(server.url, [5 + i, 6, 7], MANY) for i in range(3)]
        whole: dict = {}
        waiter = threading.Thread(
            target=lambda: whole.setdefault(
                "r",
                httpx.post(
                    server.url + "/v1/completions", json={**LONG, "prompt": [9, 9], "max_tokens": MANY}, timeout=120
                ),
            )
        )
        waiter.start()
        for s in streams:
            assert s.first.wait(60) and s.failure is None
        _hang_up_mid_upload(server.port)
        time.sleep(0.2)
        server.terminate()
        assert server.wait(60) == 0, server.log()[-3000:]
        waiter.join(30)
        for s in streams:
            s.join(30)
            assert not s.is_alive() and s.failure is None, s.failure
            assert s.lines[-1] == "data: [DONE]", s.lines[-3:]
            errors = s.errors()
            assert len(errors) == 1 and errors[0]["code"] == "server_shutdown", s.lines[-3:]
            assert s.lines[-2].startswith('data: {"error"')
        r = whole["r"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutdown"
        log = server.log()
        assert "Traceback" not in log and "CancelledError" not in log and "ERROR" not in log, log[-4000:]
        assert log.count("cut at shutdown") == 3
        assert log.count("disconnected while sending POST /v1/completions") == 1
    finally:
        server.stop()


def test_killed_tensor_parallel_worker_fails_every_request_and_the_server_exits(tiny_checkpoint_factory, tmp_path):
    model = tiny_checkpoint_factory(arch="llama", num_heads=4, num_kv_heads=2, max_position_embeddings=LONG_CONTEXT)
    args = [*TINY_ARGS, "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]
    server = LiveServer(str(model), args, tmp_path / "log")
    try:
        streams = [_Stream(server.url, [5 + i, 6, 7], MANY) for i in range(3)]
        for s in streams:
            assert s.first.wait(120) and s.failure is None
        workers = [p for p in _children(server.proc.pid) if "spawn_main" in _cmdline(p)]
        assert len(workers) == 1, [(p, _cmdline(p)) for p in _children(server.proc.pid)]
        start = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        for s in streams:
            s.join(60)
            assert not s.is_alive()
            assert s.lines[-1] == "data: [DONE]", s.lines[-3:]
            errors = s.errors()
            assert len(errors) == 1 and "worker rank 1" in errors[0]["message"], s.lines[-3:]
        assert server.wait(60) == 1, server.log()[-3000:]
        assert time.monotonic() - start < 60
        assert "the engine failed" in server.log()
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.url + "/health", timeout=5)
    finally:
        server.stop()


def test_stopped_tensor_parallel_worker_fails_every_request_after_the_timeout(tiny_checkpoint_factory, tmp_path):
    # SIGSTOP: the worker neither exits nor answers.  The collective in flight waits for
    # --distributed-timeout-s, then every request gets an error and the server exits 1.
    model = tiny_checkpoint_factory(arch="llama", num_heads=4, num_kv_heads=2, max_position_embeddings=LONG_CONTEXT)
    timeout_s = 45
    args = [
        *TINY_ARGS,
        "--tensor-parallel-size",
        "2",
        "--distributed-executor-backend",
        "mp",
        "--distributed-timeout-s",
        str(timeout_s),
    ]
    server = LiveServer(str(model), args, tmp_path / "log")
    workers: list[int] = []
    try:
        streams = [_Stream(server.url, [5 + i, 6, 7], MANY) for i in range(3)]
        for s in streams:
            assert s.first.wait(120) and s.failure is None
        workers = [p for p in _children(server.proc.pid) if "spawn_main" in _cmdline(p)]
        assert len(workers) == 1, [(p, _cmdline(p)) for p in _children(server.proc.pid)]
        start = time.monotonic()
        os.kill(workers[0], signal.SIGSTOP)
        for s in streams:
            s.join(timeout_s + 60)
            assert not s.is_alive() and s.failure is None, s.failure
            assert s.lines[-1] == "data: [DONE]", s.lines[-3:]
            errors = s.errors()
            assert len(errors) == 1 and "distributed executor failed during step" in errors[0]["message"], s.lines[-3:]
        assert server.wait(60) == 1, server.log()[-3000:]
        took = time.monotonic() - start
        assert took < timeout_s + 40, took
        assert "the engine failed" in server.log()
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.url + "/health", timeout=5)
        # The stopped worker did not outlive its server.
        deadline = time.monotonic() + 30
        while Path(f"/proc/{workers[0]}").exists() and "Z" not in _state(workers[0]):
            assert time.monotonic() < deadline, f"worker {workers[0]} still alive: {_state(workers[0])}"
            time.sleep(0.2)
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        server.stop()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0]
    except (OSError, IndexError):
        return ""


@pytest.mark.slow
def test_killed_data_parallel_replicas_fail_only_their_streams_then_the_server_exits(tiny_llama, tmp_path):
    args = [*TINY_ARGS, "--data-parallel-size", "2", "--threads", "2"]
    server = LiveServer(str(tiny_llama), args, tmp_path / "log")
    try:
        streams = [_Stream(server.url, [11 + i, 12, 13, 14]) for i in range(6)]
        for s in streams:
            assert s.first.wait(120) and s.failure is None
        detail = httpx.get(server.url + "/health", timeout=10).json()["detail"]
        os.kill(detail[0]["pid"], signal.SIGKILL)
        for s in streams:
            s.join(300)
            assert not s.is_alive() and s.failure is None
            assert s.lines[-1] == "data: [DONE]", s.lines[-3:]
        failed = [s for s in streams if s.errors()]
        finished = [s for s in streams if not s.errors()]
        assert failed and finished, "the load should have been spread over both replicas"
        assert all("data-parallel replica 0" in s.errors()[0]["message"] for s in failed)
        assert all('"finish_reason":"length"' in s.lines[-2] for s in finished)
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        r = httpx.post(server.url + "/v1/completions", json={**LONG, "prompt": [5], "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        assert kv_cache_usage(server.url) == 0.0
        # The last replica gone: nothing can serve, so the server exits non-zero.
        os.kill(detail[1]["pid"], signal.SIGKILL)
        assert server.wait(60) == 1, server.log()[-3000:]
        assert "every data-parallel replica has died" in server.log()
    finally:
        server.stop()
