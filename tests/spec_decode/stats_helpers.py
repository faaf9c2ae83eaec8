"""Chi-square tests (no scipy: the p-value is torch's regularized upper incomplete gamma)."""

from __future__ import annotations

from collections import Counter

import torch


def chi2_pvalue(stat: float, df: int) -> float:
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


def goodness_of_fit(samples: list[int], probs: torch.Tensor) -> float:
    """p-value of ``samples`` being drawn from ``probs`` (cells of expected count < 5 pooled)."""
    n = len(samples)
    counts = Counter(samples)
    assert all(probs[t] > 0 for t in counts), "sampled a token of probability zero"
    expected = (probs.double() * n).tolist()
    big = [i for i, e in enumerate(expected) if e >= 5]
    small = [i for i, e in enumerate(expected) if 0 < e < 5]
    cells = [(counts.get(i, 0), expected[i]) for i in big]
    if small:
        cells.append((sum(counts.get(i, 0) for i in small), sum(expected[i] for i in small)))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return chi2_pvalue(stat, len(cells) - 1)


def two_sample(a: list, b: list) -> float:
    """p-value of ``a`` and ``b`` coming from one distribution (2 x k contingency table)."""
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    stat, cells = 0.0, 0
    rare_a = rare_b = 0
    for key in set(ca) | set(cb):
        oa, ob = ca.get(key, 0), cb.get(key, 0)
        if oa + ob < 10:  # pool rare outcomes so expected counts stay >= 5
            rare_a, rare_b = rare_a + oa, rare_b + ob
            continue
        stat += _cell(oa, ob, na, nb)
        cells += 1
    if rare_a + rare_b:
        stat += _cell(rare_a, rare_b, na, nb)
        cells += 1
    return chi2_pvalue(stat, max(cells - 1, 1))


def _cell(oa: int, ob: int, na: int, nb: int) -> float:
    tot = oa + ob
    ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
    return (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
