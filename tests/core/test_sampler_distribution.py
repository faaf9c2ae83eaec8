"""The sampler's output distribution against the analytically computed one.

Each case draws many tokens from fixed random logits through ``Sampler.__call__`` and
compares the counts with the distribution computed here, independently of the product,
from vLLM's definitions (float64, plain Python):

- temperature divides the logits;
- min-p (applied first, an argmax-invariant step) drops tokens whose probability is
  below ``min_p`` times the largest probability;
- top-k keeps the k largest logits;
- top-p keeps the smallest set of most probable tokens whose mass, in the distribution
  left by the steps before, reaches ``top_p``;
- logit_bias, min_tokens, then the penalties edit the logits before all of that (the
  penalties: see test_sampler_penalties.py).

Tokens with probability zero must never be drawn (an exact check); the others are
compared by a chi-square test.  Every draw is seeded, so the test is deterministic; the
critical value is that of a 1e-6 level, so a correct sampler passes with a wide margin
whatever the seed, while a token too many or too few, or a wrong temperature, fails it.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.executor.sampler import Sampler
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams

VOCAB = 10
DRAWS = 15_000
#: Fixed logits with distinct values (no ties, so top-k and top-p are unambiguous).
LOGITS = [1.9, -0.4, 0.7, 2.6, -1.3, 0.1, 1.2, -2.2, 0.45, 1.55]
EOS = 3  # the most likely token: min_tokens has a visible effect


# -- the reference, from the definitions ---------------------------------------------------
def _softmax(z: list[float]) -> list[float]:
    m = max(z)
    e = [math.exp(v - m) if v != -math.inf else 0.0 for v in z]
    s = sum(e)
    return [v / s for v in e]


def reference_probs(
    logits: list[float], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> list[float]:
    z = [v / temperature for v in logits]
    if min_p > 0:
        p = _softmax(z)
        z = [v if p[i] >= min_p * max(p) else -math.inf for i, v in enumerate(z)]
    if top_k > 0:
        kth = sorted(z, reverse=True)[min(top_k, len(z)) - 1]
        z = [v if v >= kth else -math.inf for v in z]
    p = _softmax(z)
    if top_p < 1.0:
        order = sorted(range(len(p)), key=lambda i: -p[i])
        before, keep = 0.0, set()
        for i in order:
            # A cut this close to top_p would depend on rounding: the case is badly chosen.
            assert before == 0.0 or abs(before - top_p) > 1e-4, "top_p too close to a cumulative mass"
            if before >= top_p:
                break
            keep.add(i)
            before += p[i]
        p = [v if i in keep else 0.0 for i, v in enumerate(p)]
        s = sum(p)
        p = [v / s for v in p]
    return p


# -- the test statistic -----------------------------------------------------------------------
def chi2_critical(df: int, z: float = 4.753) -> float:
    """The chi-square quantile of ``df`` degrees of freedom at the normal quantile ``z``
    (4.753: a 1e-6 upper tail), by the Wilson-Hilferty approximation (scipy is not a
    test dependency)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def assert_distribution(counts: list[int], expected: list[float]) -> None:
    """Zero-probability tokens never drawn; the rest pass a chi-square test (bins with an
    expected count under 5 pooled)."""
    n = sum(counts)
    never = [t for t, p in enumerate(expected) if p == 0.0 and counts[t]]
    assert not never, f"tokens {never} have probability 0 but were drawn {[counts[t] for t in never]} times"
    bins: list[tuple[float, float]] = []
    small_obs = small_exp = 0.0
    for c, p in zip(counts, expected):
        if p == 0.0:
            continue
        if n * p < 5:
            small_obs, small_exp = small_obs + c, small_exp + n * p
        else:
            bins.append((c, n * p))
    if small_exp:
        bins.append((small_obs, small_exp))
    if len(bins) < 2:
        assert len(bins) == 1 and bins[0][0] == n
        return
    stat = sum((o - e) ** 2 / e for o, e in bins)
    crit = chi2_critical(len(bins) - 1)
    observed = [round(c / n, 4) for c in counts]
    assert stat < crit, (
        f"chi2 {stat:.1f} >= {crit:.1f}: observed {observed}, expected {[round(p, 4) for p in expected]}"
    )


# -- drawing through the sampler --------------------------------------------------------------
def _request(rid: str = "r", prompt: list[int] | None = None, eos: int | None = None, **params) -> Request:
    return Request(
        rid,
        list(prompt if prompt is not None else [0]),
        SamplingParams(max_tokens=64, **params),
        eos_token_ids=frozenset({eos} if eos is not None else ()),
    )


def draw(requests: list[Request], logits: list[float] = LOGITS, seed: int = 0) -> list[int]:
    """One token per request from the same logits row, in one batch; counts per token."""
    torch.manual_seed(seed)  # unseeded rows draw from torch's global generator
    batch = torch.tensor([logits], dtype=torch.float32).expand(len(requests), -1).contiguous()
    tokens = Sampler()(batch, requests).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=len(logits)).tolist()


CASES = {
    "plain": {},
    "temperature_low": {"temperature": 0.45},
    "temperature_high": {"temperature": 2.3},
    "top_k": {"top_k": 3},
    "top_k_1": {"top_k": 1},
    "top_k_over_vocab": {"top_k": VOCAB + 5},
    "top_p": {"top_p": 0.8},
    "top_p_small": {"top_p": 0.2},
    "min_p": {"min_p": 0.12},
    "temperature_top_k": {"temperature": 1.6, "top_k": 4},
    "temperature_top_p": {"temperature": 0.7, "top_p": 0.85},
    "top_k_top_p": {"top_k": 5, "top_p": 0.9},
    "top_k_min_p": {"top_k": 6, "min_p": 0.08},
    # min-p first: top-p measures its mass in what min-p left (differs from top-p on the
    # full distribution for these values).
    "min_p_top_p": {"min_p": 0.15, "top_p": 0.82},
    "all": {"temperature": 1.3, "top_k": 6, "top_p": 0.92, "min_p": 0.05},
}


@pytest.mark.parametrize("name", list(CASES))
def test_distribution_matches_the_definition(name: str):
    params = CASES[name]
    request = _request(**params)
    counts = draw([request] * DRAWS)
    assert_distribution(counts, reference_probs(LOGITS, **params))


def test_min_p_then_top_p_case_discriminates_the_order():
    """The min_p_top_p case is only useful if top-p on the full distribution keeps a
    different set than top-p after min-p."""
    after = reference_probs(LOGITS, min_p=0.15, top_p=0.82)
    full = reference_probs(LOGITS, top_p=0.82)
    min_only = reference_probs(LOGITS, min_p=0.15)
    joint_other_order = [p > 0 and m > 0 for p, m in zip(full, min_only)]
    assert [p > 0 for p in after] != joint_other_order


def test_seeded_requests_each_with_own_seed_follow_the_distribution():
    """One draw per request, each from its own seeded generator."""
    params = {"temperature": 0.9, "top_k": 7}
    requests = [_request(f"s{i}", seed=1000 + i, **params) for i in range(DRAWS)]
    assert_distribution(draw(requests), reference_probs(LOGITS, **params))


def test_one_seeded_request_over_many_steps_follows_the_distribution():
    """Successive draws of one seeded request (its generator advancing step to step)."""
    sampler, request = Sampler(), _request("one", seed=7, top_p=0.9)
    row = torch.tensor([LOGITS])
    tokens = [sampler(row, [request]).token_ids[0] for _ in range(3000)]
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).tolist()
    assert_distribution(counts, reference_probs(LOGITS, top_p=0.9))


def test_a_seed_gives_the_same_tokens_whatever_shares_the_batch():
    def run(batch_others: int, seed_global: int) -> list[int]:
        torch.manual_seed(seed_global)
        sampler = Sampler()
        me = _request("me", seed=42, temperature=1.2)
        others = [_request(f"o{i}", temperature=1.0) for i in range(batch_others)]
        out = []
        for _ in range(50):
            batch = [*others[: batch_others // 2], me, *others[batch_others // 2 :]]
            logits = torch.tensor([LOGITS]).expand(len(batch), -1).contiguous()
            out.append(sampler(logits, batch).token_ids[batch_others // 2])
        return out

    alone = run(0, 1)
    assert run(5, 2) == alone and run(17, 3) == alone
    assert len(set(alone)) > 2  # it really samples
    other_seed = Sampler()
    row = torch.tensor([LOGITS])
    r2 = _request("me", seed=43, temperature=1.2)
    assert [other_seed(row, [r2]).token_ids[0] for _ in range(50)] != alone


def test_logit_bias_shifts_the_distribution():
    bias = {1: 3.0, 3: -2.5, 7: 2.0}
    request = _request(logit_bias=bias, temperature=1.1)
    biased = [v + bias.get(i, 0.0) for i, v in enumerate(LOGITS)]
    assert_distribution(draw([request] * DRAWS), reference_probs(biased, temperature=1.1))


def test_logit_bias_is_clamped_to_100():
    """OpenAI's limit: a bias of +1000 is +100, which makes the token (almost) certain."""
    request = _request(logit_bias={5: 1000.0})
    counts = draw([request] * 2000)
    assert counts[5] == 2000


def test_min_tokens_bans_eos_until_reached_then_not():
    params = {"min_tokens": 3, "temperature": 1.0}
    early = _request(eos=EOS, **params)
    banned = [v if i != EOS else -math.inf for i, v in enumerate(LOGITS)]
    assert_distribution(draw([early] * DRAWS), reference_probs(banned))
    boundary = _request(eos=EOS, **params)
    boundary.append_token(0)
    boundary.append_token(1)  # 2 of 3: still banned
    assert_distribution(draw([boundary] * 3000, seed=2), reference_probs(banned))
    late = _request(eos=EOS, **params)
    for t in (0, 1, 2):
        late.append_token(t)
    assert_distribution(draw([late] * DRAWS, seed=1), reference_probs(LOGITS))


def test_min_tokens_bans_stop_token_ids_and_respects_ignore_eos():
    request = _request(eos=EOS, min_tokens=2, stop_token_ids=[6], ignore_eos=True)
    banned = [v if i != 6 else -math.inf for i, v in enumerate(LOGITS)]
    assert_distribution(draw([request] * DRAWS), reference_probs(banned))


def test_penalised_distribution_is_softmax_of_the_penalised_logits():
    """Penalties, then temperature and top-k, through the whole sampler."""
    params = {"repetition_penalty": 1.7, "frequency_penalty": 0.4, "presence_penalty": 0.3, "temperature": 0.8}
    request = _request(prompt=[3, 8], **params)
    for t in (0, 0, 9, 3):
        request.append_token(t)
    out = {0: 2, 9: 1, 3: 1}
    seen = {3, 8, 0, 9}
    expect = []
    for i, v in enumerate(LOGITS):
        if i in seen:
            v = v / 1.7 if v > 0 else v * 1.7
        v -= 0.4 * out.get(i, 0) + (0.3 if i in out else 0.0)
        expect.append(v)
    counts = draw([request] * 6000)  # penalties run row by row: fewer draws
    assert_distribution(counts, reference_probs(expect, temperature=0.8))


def test_logit_bias_comes_before_the_repetition_penalty():
    """vLLM applies logit_bias, then the penalties: a seen token with a positive logit
    after its bias is divided (bias included)."""
    request = _request(prompt=[2], logit_bias={2: 1.5}, repetition_penalty=2.0)
    expect = list(LOGITS)
    expect[2] = (LOGITS[2] + 1.5) / 2.0
    assert_distribution(draw([request] * 6000), reference_probs(expect))


def test_greedy_takes_the_argmax_of_the_processed_logits():
    sampler = Sampler()
    row = torch.tensor([LOGITS])
    assert sampler(row, [_request(temperature=0.0)]).token_ids == [EOS]
    # Repetition penalty 3 on token 3 (2.6 -> 0.867) leaves token 0 (1.9) on top.
    penalised = _request(prompt=[3], temperature=0.0, repetition_penalty=3.0)
    assert sampler(row, [penalised]).token_ids == [0]
    banned = _request(eos=EOS, temperature=0.0, min_tokens=1)
    assert sampler(row, [banned]).token_ids == [0]
    biased = _request(temperature=0.0, logit_bias={7: 5.0})
    assert sampler(row, [biased]).token_ids == [7]


def test_the_statistic_rejects_a_slightly_wrong_distribution():
    """The test's own power: draws at temperature 1.1 fail against temperature 1.0, and
    one token too many for top-p fails the exact check."""
    counts = draw([_request(temperature=1.1)] * DRAWS)
    with pytest.raises(AssertionError, match="chi2"):
        assert_distribution(counts, reference_probs(LOGITS))
    counts = draw([_request(top_p=0.9)] * DRAWS)
    with pytest.raises(AssertionError, match="probability 0"):
        assert_distribution(counts, reference_probs(LOGITS, top_p=0.75))
