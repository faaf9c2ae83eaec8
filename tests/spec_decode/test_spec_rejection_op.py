"""The ``rejection_sample`` op against the exact target distribution, and every
registered implementation against the reference bit for bit."""

from __future__ import annotations

import pytest
import torch
from native_build import require_native
from stats_helpers import goodness_of_fit

from pagedserve.kernels import spec_reference
from pagedserve.kernels.cpu import spec_native
from pagedserve.platforms import select_platform

V, K = 7, 3


def _impl(name: str):
    if name == "reference":
        return spec_reference.rejection_sample
    module = require_native(spec_native.load_spec_kernels, spec_native.spec_build_spec, "the spec-decoding CPU kernel")
    return module.rejection_sample


def _dists(gen: torch.Generator, rows: int, zeros: bool = True) -> torch.Tensor:
    p = torch.rand(rows, V, generator=gen) ** 3
    if zeros:
        p[:, 0] = 0.0  # a token the target never emits
    return p / p.sum(-1, keepdim=True)


def _run(op, p: torch.Tensor, q: torch.Tensor | None, draft_ids: torch.Tensor, gen: torch.Generator):
    """Rows of drafts ``draft_ids`` [n, K] under target rows ``p`` [K+1, V] and draft rows ``q`` [K, V]."""
    n = draft_ids.shape[0]
    num = torch.full((n,), K, dtype=torch.int64)
    target = p.expand(n, K + 1, V).contiguous()
    dp = None if q is None else q.expand(n, K, V).contiguous()
    return op(draft_ids, num, dp, target, torch.rand(n, K, generator=gen), torch.rand(n, K + 1, generator=gen))


@pytest.mark.parametrize("impl", ["reference", "native"])
@pytest.mark.parametrize("with_q", [False, True])
def test_outputs_follow_the_target_distribution(with_q, impl):
    """The op's output is a sample of the target, whatever the drafts: the first token
    ~ p_0; where the first draft was accepted, the second ~ p_1; and so on (the target
    here ignores the prefix, so these are its exact conditionals)."""
    gen = torch.Generator().manual_seed(0)
    n = 6000
    p = _dists(gen, K + 1)
    if with_q:
        # Drafts sampled from a draft distribution q near p (as a draft model's is), which
        # also proposes the token p never emits.
        q = 0.6 * p[:K] + 0.4 * _dists(gen, K, zeros=False)
        draft_ids = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen) for j in range(K)], 1)
    else:
        # Deterministic drafts (n-gram): likely ones, and one of target probability zero.
        q = None
        draft_ids = torch.tensor([int(p[0].argmax()), int(p[1].argmax()), 0]).repeat(n, 1)
    out = _run(_impl(impl), p, q, draft_ids, gen)
    reached = torch.ones(n, dtype=torch.bool)
    for j in range(K + 1):
        assert reached.sum() > 300
        assert goodness_of_fit(out[reached, j].tolist(), p[j]) > 1e-3, j
        if j == K:
            break
        reached &= out[:, j] == draft_ids[:, j]
        if not with_q and j == 2:
            # Draft 3 has target probability 0: never accepted, no bonus token drawn.
            assert not bool(reached.any()) and bool((out[:, 3] == -1).all())
            break


def test_output_layout():
    gen = torch.Generator().manual_seed(1)
    p = _dists(gen, K + 1)
    draft_ids = torch.tensor([1, 2, 3]).repeat(50, 1)
    out = _run(spec_reference.rejection_sample, p, None, draft_ids, gen)
    for row in out.tolist():
        n = sum(t >= 0 for t in row)
        assert 1 <= n <= 4 and all(t == -1 for t in row[n:])
        assert row[: n - 1] == [1, 2, 3][: n - 1]


def _random_case(gen: torch.Generator, B: int, vocab: int, with_q: bool):
    num = torch.randint(0, K + 1, (B,), generator=gen)
    target = torch.rand(B, K + 1, vocab, generator=gen) ** 4
    target[target < 0.05] = 0.0
    target[:, :, 0] += 1e-3  # every row keeps some mass
    target /= target.sum(-1, keepdim=True)
    q = torch.rand(B, K, vocab, generator=gen) ** 2 if with_q else None
    if q is not None:
        q /= q.sum(-1, keepdim=True)
    draft_ids = torch.randint(0, vocab, (B, K), generator=gen)
    # Some drafts equal to the target's mode, so acceptances happen too.
    mode = target[:, :K].argmax(-1)
    pick = torch.rand(B, K, generator=gen) < 0.5
    draft_ids = torch.where(pick, mode, draft_ids)
    return (draft_ids, num, q, target, torch.rand(B, K, generator=gen), torch.rand(B, K + 1, generator=gen))


@pytest.mark.parametrize("with_q", [False, True])
def test_native_and_registered_op_equal_reference(with_q):
    """Bit for bit on random inputs (poisoned output never read: the kernel allocates it)."""
    native = _impl("native")
    _, ops = select_platform("cpu")
    assert ops.source("rejection_sample") == spec_native.SOURCE
    gen = torch.Generator().manual_seed(2)
    for vocab in (5, 300, 49152):
        args = _random_case(gen, 9, vocab, with_q)
        want = spec_reference.rejection_sample(*args)
        assert torch.equal(native(*args), want), vocab
        assert torch.equal(ops.rejection_sample(*args), want), vocab


def test_native_refuses_bad_shapes():
    native = _impl("native")
    gen = torch.Generator().manual_seed(4)
    args = list(_random_case(gen, 3, 11, False))
    args[1] = torch.tensor([0, 5, 1])  # more drafts than K
    with pytest.raises(RuntimeError, match="num_draft_tokens"):
        native(*args)
    args = list(_random_case(gen, 3, 11, False))
    args[3] = args[3][:, :K]  # target rows missing the bonus position
    with pytest.raises(RuntimeError, match="target_probs"):
        native(*args)
