"""One tiny-model server for the whole fuzz suite (helpers in fuzz_helpers.py)."""

from __future__ import annotations

import pytest
from fuzz_helpers import FUZZ_ARGS, SEED, SEED_ENV, check_server_still_serves
from live_server import LiveServer


@pytest.fixture(scope="session")
def fuzz_server(tiny_llama, tmp_path_factory):
    with LiveServer(str(tiny_llama), FUZZ_ARGS, tmp_path_factory.mktemp("fuzz") / "server.log") as server:
        yield server
        check_server_still_serves(server)
        log = server.log()
        assert "Traceback" not in log and "unhandled error" not in log, log[-5000:]


def _seed_line() -> str:
    return f"fuzz seed: {SEED} (replay this run with {SEED_ENV}={SEED})"


def pytest_report_header(config) -> str:
    return _seed_line()


def pytest_terminal_summary(terminalreporter) -> None:
    # Also at the end: -q drops the header, and a failure is read from the bottom.
    terminalreporter.write_line(_seed_line())
