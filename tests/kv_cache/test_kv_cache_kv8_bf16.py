"""bf16 queries over 8-bit KV caches in the native CPU kernel (every runnable instruction
set; with AVX512-BF16 and VBMI the K rows, and fp8 V rows, are converted to bf16 once
per span by table lookup and run the bf16 kernel's VDPBF16PS q.k and paired P.V; int8 V
rows are read in place with VPDPWSSD (VNNI); row scales join the scores and the
probabilities).

Every byte of every 8-bit format must come out exact (one key, probability 1, so the
output is the value row; infinities stay infinite, NaN stays NaN); random batches of
each cache kind (int8 rows, fp8 rows with their scales, unscaled fp8) at every head size
the kernel has, GQA groups of 3 and 4, decodes, prefill tiles, an odd number of keys,
split contexts merged across threads, windows over NaN-scaled blocks and soft caps match
the reference on the dequantized float32 cache, also with query outlier channels that
make logits in the hundreds.  Fresh random inputs, outputs poisoned with NaN, blocks no
sequence owns given NaN scales (or NaN values).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_cpu_kernels import assert_close
from tests.kv_cache.kv8_inputs import KIND_IDS, KINDS, dequantized, expected_attention, gen_for, kv8_batch

pytestmark = pytest.mark.timeout(600)

# (q_len, seq_len): decodes (odd and even key counts, one key), a whole prompt, prefix
# continuations, block edges.
SEQS = [(1, 37), (23, 23), (20, 150), (1, 300), (16, 64), (1, 1), (5, 48), (1, 64), (1, 129)]


# ---- exact conversion -------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_every_byte_reads_exactly_with_a_bf16_query(every_isa, kind):
    """One key per sequence: the output is its value row times probability 1, so each of
    the 256 byte patterns must come out as its exact value (a bf16 holds every one);
    row-scaled rows carry scale 1.0 and 2^-3 (exact products)."""
    _, kv, scaled = kind
    d = 64
    values = torch.arange(256, dtype=torch.uint8).view(1, 1, 4, d)
    want = values.view(kv).float() if kv != torch.int8 else values.view(torch.int8).float()
    want = want.view(1, 4, d)
    row_scale = 0.125 if scaled else 1.0
    if scaled:
        scale_bytes = torch.tensor([row_scale]).view(torch.uint8).expand(1, 1, 4, 4)
        values = torch.cat([values, scale_bytes], dim=-1)
        want = want * row_scale
    vc = values.contiguous().view(kv)
    kc = torch.zeros_like(values).view(kv)
    if scaled:
        kc.view(torch.uint8)[..., d:] = torch.tensor([1.0]).view(torch.uint8)
    query = torch.randn(1, 4, d, generator=gen_for("bytes", kind[0])).bfloat16()
    args = (query, kc, vc, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32))  # fmt: skip
    for isa, kernels in every_isa.items():
        out = torch.full_like(query, 7.0)
        kernels.paged_attention(*args, 0.125, out)
        assert torch.equal(out.isnan(), want.isnan()), isa
        assert torch.equal(out.float().nan_to_num(), want.nan_to_num()), isa


# ---- attention --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
def test_bf16_query_matches_the_reference(every_isa, kind, head_size):
    heads = (9, 3) if head_size <= 128 else (8, 2)
    gen = gen_for("attn", kind[0], head_size)
    args = kv8_batch(SEQS, heads, head_size, kind, gen)
    expected = expected_attention(args)
    for isa, kernels in every_isa.items():
        out = torch.full_like(args[0], float("nan"))
        assert kernels.paged_attention(*args, head_size**-0.5, out) is out
        assert_close(out, expected, torch.bfloat16, f"{isa} {kind[0]} d={head_size}")


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_split_contexts_merge_across_threads(every_isa, kind):
    """Two long decodes on two threads: their key ranges are split and merged."""
    gen = gen_for("split", kind[0])
    args = kv8_batch([(1, 1500), (1, 777)], (9, 3), 64, kind, gen)
    expected = expected_attention(args)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for isa, kernels in every_isa.items():
            out = torch.full_like(args[0], float("nan"))
            kernels.paged_attention(*args, 0.125, out)
            assert_close(out, expected, torch.bfloat16, f"{isa} {kind[0]} split")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize(
    "extra",
    [{"sliding_window": 7}, {"sliding_window": 33, "soft_cap": 4.0}, {"soft_cap": 2.5}],
    ids=["w7", "w33-cap", "cap"],
)
def test_window_soft_cap_and_slid_out_blocks(every_isa, kind, extra):
    """Slid-out table entries point at a NaN block, which must never be read."""
    gen = gen_for("window", kind[0], repr(extra))
    q, kc, vc, tables, seq_lens, qsl = kv8_batch(SEQS, (9, 3), 64, kind, gen)
    nan_block = int(dequantized(kc, 64).flatten(1).isnan().all(1).nonzero()[0])
    window = extra.get("sliding_window")
    if window is not None:
        for i, ctx in enumerate(seq_lens.tolist()):
            q_len = int(qsl[i + 1] - qsl[i])
            first = max(0, ctx - q_len - window + 1) // 16
            tables[i, :first] = nan_block
    args = (q, kc, vc, tables, seq_lens, qsl)
    expected = expected_attention(args, **extra)
    assert not expected.isnan().any()
    for isa, kernels in every_isa.items():
        out = torch.full_like(q, float("nan"))
        kernels.paged_attention(*args, 64**-0.5, out, **extra)
        assert_close(out, expected, torch.bfloat16, f"{isa} {kind[0]} {extra}")


def test_block_size_32_and_token_major_rows(every_isa):
    """Spans of two 32-key blocks, and rows that are not contiguous per head."""
    kind = KINDS[0]
    gen = gen_for("bs32")
    q, kc, vc, tables, seq_lens, qsl = kv8_batch(SEQS, (9, 3), 64, kind, gen, block_size=32)
    args = (q, kc, vc, tables, seq_lens, qsl)
    expected = expected_attention(args)
    token_major = (q, kc.contiguous(), vc.contiguous(), tables, seq_lens, qsl)
    for isa, kernels in every_isa.items():
        for a, what in ((args, "head-major"), (token_major, "token-major")):
            out = torch.full_like(q, float("nan"))
            kernels.paged_attention(*a, 0.125, out)
            assert_close(out, expected, torch.bfloat16, f"{isa} {what}")


@pytest.mark.parametrize("kind", KINDS[:2], ids=KIND_IDS[:2])
@pytest.mark.parametrize("mult", [50.0, 500.0])
def test_query_with_an_outlier_channel(every_isa, kind, mult):
    """A query channel 50 or 500 times the others (a model's massive activations) makes
    logits in the hundreds, where an approximate q.k (say a query quantized to int16 by
    its largest element, 2^-15 of it) moves near-tied keys' probabilities by percents."""
    gen = gen_for("q-outlier", kind[0], mult)
    q, kc, vc, tables, seq_lens, qsl = kv8_batch(SEQS, (9, 3), 64, kind, gen)
    q = q.float()
    q[:, :, 5] *= mult
    q[:, ::2, 17] *= -0.6 * mult
    args = (q.bfloat16(), kc, vc, tables, seq_lens, qsl)
    expected = expected_attention(args)
    for isa, kernels in every_isa.items():
        out = torch.full_like(args[0], float("nan"))
        kernels.paged_attention(*args, 0.125, out)
        assert_close(out, expected, torch.bfloat16, f"{isa} {kind[0]} outlier query x{mult}")
