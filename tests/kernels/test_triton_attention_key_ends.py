"""``key_ends`` (spans attending both ways, Gemma 3's images) in the Triton paged-attention
kernel against kernels/reference.py (under TRITON_INTERPRET=1 without a GPU): single
pass and split-KV, with a window whose slid-out entries point at a NaN block, prefill
chunks and decodes."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from pagedserve.kernels import reference  # noqa: E402
from pagedserve.kernels.triton import attention  # noqa: E402
from pagedserve.testing.attention_window_cases import point_slid_out_at_nan_block, random_key_ends  # noqa: E402
from tests.kernels.test_triton_attention_sinks import _batch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("num_splits, window", [(1, None), (3, 6)], ids=["single-pass", "split-window"])
def test_key_ends_match_reference(num_splits, window):
    gen = torch.Generator().manual_seed(num_splits * 10 + (window or 0))
    q, kc, vc, tables, seq_lens, qsl = _batch(gen, 6, 2, 32, 4, [(1, 1), (40, 12), (29, 29), (21, 1)])
    ends = random_key_ends(gen, seq_lens, qsl, 2)
    extra = {"sliding_window": window} if window else {}
    want = reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, 32**-0.5, key_ends=ends, **extra)
    assert (want - reference.paged_attention(q, kc, vc, tables, seq_lens, qsl, 32**-0.5, **extra)).abs().max() > 1e-3
    if window:
        kc, vc, tables, _ = point_slid_out_at_nan_block(kc, vc, tables, seq_lens, qsl, window)
    out = torch.full(q.shape, float("nan"), device=DEVICE)
    args = (t.to(DEVICE) for t in (q, kc, vc, tables, seq_lens, qsl))
    got = attention.paged_attention_fixed_splits(*args, 32**-0.5, num_splits, out, key_ends=ends.to(DEVICE), **extra)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=1e-4)
