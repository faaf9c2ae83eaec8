"""Rank 0's keepalive command (pagedserve.distributed.worker.Keepalive) with a recording
broadcast in place of the process group: sent while idle, never inside a driver turn,
never after stop, and a failed send ends the thread with its error kept."""

from __future__ import annotations

import threading
import time

from pagedserve.distributed.worker import KEEPALIVE, Keepalive


class Recorder:
    def __init__(self, fail_after: int | None = None) -> None:
        self.sent: list[tuple[float, object]] = []
        self.fail_after = fail_after
        self.lock = threading.Lock()

    def __call__(self, obj) -> None:
        with self.lock:
            if self.fail_after is not None and len(self.sent) >= self.fail_after:
                raise RuntimeError("peer gone")
            self.sent.append((time.monotonic(), obj))


def _wait(cond, seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_idle_sends_the_command_about_every_interval():
    rec = Recorder()
    k = Keepalive(rec, timeout_s=0.4)  # interval 0.1 s
    try:
        assert k.interval == 0.1
        assert _wait(lambda: len(rec.sent) >= 4)
        assert all(obj == (KEEPALIVE,) for _, obj in rec.sent)
        gaps = [b[0] - a[0] for a, b in zip(rec.sent, rec.sent[1:])]
        assert min(gaps) >= 0.1 - 1e-3  # never more often than the interval
    finally:
        k.stop()


def test_nothing_is_sent_inside_a_turn_or_right_after_it():
    rec = Recorder()
    k = Keepalive(rec, timeout_s=0.4)
    try:
        with k.turn():
            held = len(rec.sent)
            time.sleep(0.5)  # five intervals with the turn held
            assert len(rec.sent) == held
        ended = time.monotonic()
        assert _wait(lambda: len(rec.sent) > held)
        assert rec.sent[held][0] - ended >= 0.1 - 1e-3  # a full interval after the turn
    finally:
        k.stop()


def test_stop_ends_the_commands_and_waits_for_one_in_flight():
    rec = Recorder()
    k = Keepalive(rec, timeout_s=0.2)
    assert _wait(lambda: len(rec.sent) >= 1)
    k.stop()
    count = len(rec.sent)
    time.sleep(0.3)
    assert len(rec.sent) == count
    assert not k._thread.is_alive() or _wait(lambda: not k._thread.is_alive())


def test_a_failed_send_ends_the_thread_and_keeps_the_error():
    rec = Recorder(fail_after=2)
    k = Keepalive(rec, timeout_s=0.2)
    assert _wait(lambda: k.error is not None)
    assert isinstance(k.error, RuntimeError) and "peer gone" in str(k.error)
    assert _wait(lambda: not k._thread.is_alive())
    assert k.sent == 2
    k.stop()
