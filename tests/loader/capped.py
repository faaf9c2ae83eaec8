"""Running loader code in a child process under an address-space cap and a timeout.

A corrupt checkpoint must never crash the process, hang or allocate without bound; run in
the test process, such a failure would take the test run down with it (or the machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

__all__ = ["run_capped"]

_PRELUDE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))
sys.path.insert(0, {here!r})
"""


def run_capped(code: str, cap_bytes: int = 6 * 2**30, timeout: float = 120.0) -> tuple[int, list[dict], str]:
    """Run ``code`` in a fresh interpreter with RLIMIT_AS = ``cap_bytes``.

    The code reports by printing JSON objects, one per line, prefixed with ``@@``.
    Returns (exit code, the reported objects, stderr); a timeout is exit code -9.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    script = _PRELUDE.format(cap=cap_bytes, here=here) + textwrap.dedent(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return -9, _reports(out), "timeout"
    return proc.returncode, _reports(proc.stdout), proc.stderr


def _reports(stdout: str) -> list[dict]:
    return [json.loads(line[2:]) for line in stdout.splitlines() if line.startswith("@@")]
