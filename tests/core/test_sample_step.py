"""The step's tail (pagedserve.executor.sample_step) without a model or processes: which
rows a batch reads, the head output a last pipeline stage sends laid out exactly as rank 0
receives it, the grammar mask applied before the greedy argmax and the sampler, and the
sampler's per-row errors taken once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedserve.executor.sample_step import HeadOutput, finish_step, plan_step, run_head
from pagedserve.executor.sampler import Sampler
from pagedserve.kernels import reference
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import ScheduledRequest

VOCAB, HIDDEN = 70, 8
OPS = SimpleNamespace(apply_token_bitmask=reference.apply_token_bitmask, argmax=reference.argmax)


def _request(rid: str, prompt: int, computed: int = 0, pooling: str | None = None, **params) -> Request:
    r = Request(rid, list(range(1, prompt + 1)), SamplingParams(**{"temperature": 0.0, **params}), pooling=pooling)
    r.num_computed_tokens = computed
    return r


def _scheduled(*chunks: tuple[Request, int]) -> list[ScheduledRequest]:
    return [ScheduledRequest(r, n, r.num_computed_tokens + n >= r.num_prompt_tokens) for r, n in chunks]


def _last_rows(scheduled) -> torch.Tensor:
    return torch.cumsum(torch.tensor([s.num_new_tokens for s in scheduled]), 0) - 1


class _Model:
    """compute_logits: a fixed random projection (float32 unless asked otherwise)."""

    def __init__(self) -> None:
        self.w = torch.randn(HIDDEN, VOCAB, generator=torch.Generator().manual_seed(0))

    def compute_logits(self, h: torch.Tensor, float32: bool = True) -> torch.Tensor:
        return h.float() @ self.w


def test_plan_reads_only_the_rows_the_batch_needs():
    decode = _request("d", 4, computed=4)
    decode.all_token_ids = [1, 2, 3, 4, 9]
    prefill = _request("p", 6, prompt_logprobs=2)
    mean = _request("m", 5, pooling="mean")
    last = _request("l", 9, computed=4, pooling="last")
    sched = _scheduled((decode, 1), (prefill, 6), (mean, 5), (last, 3))
    plan = plan_step(sched, _last_rows(sched), VOCAB)
    assert plan.requests == [decode, prefill]  # pooling requests never sample
    assert plan.rows.sample.tolist() == [0, 6] and plan.rows.num_sample == 2
    # Positions 0..4 of p's chunk (rows 1..5) score prompt tokens 2..6.
    assert plan.rows.prompt.rows.tolist() == [1, 2, 3, 4, 5]
    assert plan.rows.prompt.targets.tolist() == [2, 3, 4, 5, 6]
    assert [(s.request_id, s.first, s.num_rows, s.count) for s in plan.rows.pool] == [("m", 7, 5, 5)]
    assert plan.grammar is None
    # A pure decode step reads every row as it is: no gather.
    sched = _scheduled((decode, 1))
    assert plan_step(sched, _last_rows(sched), VOCAB).rows.sample is None


def test_head_output_travels_in_the_layout_rank_0_receives():
    r1, r2 = _request("a", 5, prompt_logprobs=3), _request("e", 4, pooling="mean")
    sched = _scheduled((r1, 5), (r2, 4))
    plan = plan_step(sched, _last_rows(sched), VOCAB)
    hidden = torch.randn(9, HIDDEN)
    sent = run_head(_Model(), hidden, plan.rows, lambda t: t).widened().tensors()
    received = HeadOutput.empty(plan.rows, VOCAB, HIDDEN, torch.device("cpu")).tensors()
    assert [(t.shape, t.dtype) for t in sent] == [(t.shape, t.dtype) for t in received]
    assert len(sent) == 6  # logits, 4 prompt-score tensors, pooled vectors
    for src, dst in zip(sent, received):
        dst.copy_(src)
    # Rank 0 finishes the received copy exactly as the sender's own output.
    head = HeadOutput.empty(plan.rows, VOCAB, HIDDEN, torch.device("cpu"))
    for src, dst in zip(sent, head.tensors()):
        dst.copy_(src)
    got = finish_step(Sampler(), OPS, plan, head)
    want = finish_step(Sampler(), OPS, plan, run_head(_Model(), hidden, plan.rows, lambda t: t))
    assert (got.sampled, got.logprobs, got.prompt_logprobs) == (want.sampled, want.logprobs, want.prompt_logprobs)
    assert torch.equal(got.pooled["e"].vector, want.pooled["e"].vector)
    assert [p[0] for p in got.prompt_logprobs["a"]] == [1, 2, 3, 4]
    torch.testing.assert_close(got.pooled["e"].vector, hidden[5:9].sum(dim=0))


class _OnlyToken:
    """A grammar state that allows one token."""

    constraining = True

    def __init__(self, token: int) -> None:
        self.token = token

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].zero_()
        bitmask[row, self.token // 32] = 1 << (self.token % 32)


@pytest.mark.parametrize(
    "params", [{}, {"logprobs": 2}, {"temperature": 1.0, "seed": 5}], ids=["argmax", "sampler", "random"]
)
def test_grammar_mask_applies_before_every_sampling_path(params):
    free, bound = _request("f", 3, **params), _request("b", 3, **params)
    bound.structured = _OnlyToken(37)
    sched = _scheduled((free, 3), (bound, 3))
    plan = plan_step(sched, _last_rows(sched), VOCAB)
    assert plan.grammar.rows == [1]
    logits = torch.zeros(2, VOCAB)
    logits[:, 11] = 50.0  # what an unconstrained row picks
    out = finish_step(Sampler(), OPS, plan, HeadOutput(logits, None, torch.empty(0, HIDDEN)))
    assert out.sampled == {"f": 11, "b": 37}


def test_sampler_row_errors_are_taken_once():
    sampler = Sampler()
    bad, good = _request("x", 2, logprobs=12), _request("y", 2, logprobs=1)
    logits = torch.randn(2, 10)  # fewer tokens than x asks logprobs for
    out = sampler(logits, [bad, good])
    assert out.token_ids[1] == int(logits[1].argmax())
    assert out.token_ids[0] == 0 and out.logprobs[0] is None
    errors = sampler.take_row_errors()
    assert list(errors) == ["x"] and "exceeds the vocabulary size" in errors["x"]
    assert sampler.take_row_errors() == {}
