"""benchmarks/engine_runner.py --rounds: the hand-off between the parent and a waiting engine."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path

# Loaded by path: putting benchmarks/ on sys.path would let its scripts shadow packages.
_spec = importlib.util.spec_from_file_location(
    "bench_engine_runner", Path(__file__).resolve().parents[2] / "benchmarks" / "engine_runner.py"
)
engine_runner = importlib.util.module_from_spec(_spec)
sys.modules["bench_engine_runner"] = engine_runner
_spec.loader.exec_module(engine_runner)


def _wait(path: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.005)


def test_rounds_run_each_workload_only_when_told(tmp_path):
    rounds = engine_runner._Rounds(["w0", "w1", "w2"], str(tmp_path))
    # Indexing never waits (the engines read the first request before the rounds).
    assert rounds[0] == "w0" and len(rounds) == 3
    ran: list[tuple[str, float]] = []

    def child():
        for w in rounds:
            ran.append((w, time.monotonic()))
            time.sleep(0.05)  # the run

    t = threading.Thread(target=child, daemon=True)
    t.start()
    _wait(tmp_path / "ready")
    time.sleep(0.1)
    assert ran == [], "a round ran before its go"
    for r in range(3):
        go = time.monotonic()
        (tmp_path / f"go-{r}").touch()
        _wait(tmp_path / f"done-{r}")
        assert [w for w, _ in ran] == [f"w{i}" for i in range(r + 1)]
        assert ran[-1][1] >= go
        # done-r marks the end of the run, not its start.
        assert time.monotonic() - ran[-1][1] >= 0.05
        assert not (tmp_path / f"done-{r + 1}").exists()
    t.join(5)
    assert not t.is_alive()
