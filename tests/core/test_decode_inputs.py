"""prepare_inputs' decode-only path builds exactly the tensors of its general path."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from pagedserve.executor import input_batch
from pagedserve.executor.input_batch import prepare_inputs


def _step(rng: random.Random, num_new: list[int], spec: bool = False) -> tuple[SimpleNamespace, dict]:
    scheduled, blocks = [], {}
    for i, n in enumerate(num_new):
        length = rng.randrange(1, 300)
        ids = [rng.randrange(50_000) for _ in range(length)]
        computed = length - n + (1 if spec else 0)  # spec: the last token is a draft
        rid = f"r{i}"
        req = SimpleNamespace(request_id=rid, num_computed_tokens=computed, all_token_ids=ids)
        scheduled.append(SimpleNamespace(request=req, num_new_tokens=n, spec_token_ids=[7] * n))
        count = -(-(computed + n) // 16) + rng.randrange(3)
        blocks[rid] = rng.sample(range(10_000), count)
    return SimpleNamespace(scheduled=scheduled), blocks


def _general(monkeypatch, *args):
    with monkeypatch.context() as m:
        m.setattr(input_batch, "_decode_inputs", lambda *a: None)
        return prepare_inputs(*args)


def _assert_same(a, b) -> None:
    assert a.request_ids == b.request_ids
    for x, y in [(a.input_ids, b.input_ids), (a.logits_indices, b.logits_indices)] + [
        (getattr(a.meta, f), getattr(b.meta, f))
        for f in ("positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc")
    ]:
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


@pytest.mark.parametrize("batch", [1, 2, 4, 37, 64])
def test_decode_step_matches_the_general_path(monkeypatch, batch):
    rng = random.Random(batch)
    for _ in range(5):
        out, blocks = _step(rng, [1] * batch)
        fast = prepare_inputs(out, blocks, 16, torch.device("cpu"))
        _assert_same(fast, _general(monkeypatch, out, blocks, 16, torch.device("cpu")))


def test_other_steps_take_the_general_path(monkeypatch):
    """A prefill chunk, a draft token to verify: the decode path declines them."""
    rng = random.Random(0)
    for num_new, spec in (([1, 5, 1], False), ([1, 1], True)):
        out, blocks = _step(rng, num_new, spec)
        assert input_batch._decode_inputs(out.scheduled, blocks, 16, torch.device("cpu")) is None
        _assert_same(
            prepare_inputs(out, blocks, 16, torch.device("cpu")),
            _general(monkeypatch, out, blocks, 16, torch.device("cpu")),
        )
