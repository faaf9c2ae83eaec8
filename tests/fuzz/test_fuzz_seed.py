"""The fuzz runs' seed: a run is reproduced by its seed and differs from a run with
another one (no server needed)."""

from __future__ import annotations

import fuzz_helpers
from hypothesis import given
from hypothesis import strategies as st


def _examples(monkeypatch, seed: int) -> list:
    monkeypatch.setattr(fuzz_helpers, "SEED", seed)
    seen: list = []

    @fuzz_helpers.fuzz_settings(30)
    @given(st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=4))
    def run(body):
        seen.append(body)

    run()
    return seen


def test_the_same_seed_replays_the_same_examples(monkeypatch):
    assert _examples(monkeypatch, 1234) == _examples(monkeypatch, 1234)


def test_another_seed_draws_other_examples(monkeypatch):
    assert _examples(monkeypatch, 1234) != _examples(monkeypatch, 99)


def test_the_seed_comes_from_the_environment_or_is_fresh():
    assert fuzz_helpers.run_seed({"PAGEDSERVE_FUZZ_SEED": "77"}) == 77
    fresh = {fuzz_helpers.run_seed({}) for _ in range(5)}
    assert len(fresh) > 1
