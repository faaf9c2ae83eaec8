"""The shortcuts of the decode step's Python glue give what the longer paths gave: the
native wrappers' cheaper checks (partial overlaps still go to the reference), the 2-D
packed linears, ``qkv_split``'s views and the sampled hidden rows of a step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedserve.executor.step_rows import sampling_hidden
from pagedserve.kernels import reference
from pagedserve.models.layers import AttentionShape, qkv_split


@pytest.mark.parametrize("shift", [1, 300, 575, 576, 577, 2000])
def test_fused_add_rms_norm_partial_overlap(cpu_kernels, shift):
    """x and residual as views of one buffer ``shift`` elements apart: overlapping ones
    (shift < 576 * rows) must give the reference's result, disjoint ones too."""
    gen = torch.Generator().manual_seed(shift)
    buf = torch.randn(4 * 576 + 2000, generator=gen)
    weight = torch.randn(576, generator=gen)
    x_ref, res_ref = buf[:2304].view(4, 576).clone(), buf[shift : shift + 2304].view(4, 576).clone()
    exp_out, exp_res = reference.fused_add_rms_norm(x_ref, res_ref, weight, 1e-5)
    before = buf.clone()
    got_out, got_res = cpu_kernels.fused_add_rms_norm(
        buf[:2304].view(4, 576), buf[shift : shift + 2304].view(4, 576), weight, 1e-5
    )
    torch.testing.assert_close(got_out, exp_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got_res, exp_res, atol=2e-5, rtol=2e-5)
    if shift < 2304:  # overlapping: the reference's new tensors, the buffer untouched
        assert torch.equal(buf, before)


def test_norms_take_weights_of_another_dtype(cpu_kernels):
    gen = torch.Generator().manual_seed(3)
    x, res = torch.randn(3, 576, generator=gen).bfloat16(), torch.randn(3, 576, generator=gen).bfloat16()
    weight = torch.randn(576, generator=gen)  # float32 weight, bf16 rows
    exp = reference.rms_norm(x, weight.bfloat16(), 1e-6)
    assert torch.equal(cpu_kernels.rms_norm(x, weight, 1e-6), cpu_kernels.rms_norm(x, weight.bfloat16(), 1e-6))
    torch.testing.assert_close(cpu_kernels.rms_norm(x, weight, 1e-6), exp, atol=2e-2, rtol=1.6e-2)
    a = cpu_kernels.fused_add_rms_norm(x.clone(), res.clone(), weight, 1e-6)
    b = cpu_kernels.fused_add_rms_norm(x.clone(), res.clone(), weight.bfloat16(), 1e-6)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_packed_linears_two_dimensional_rows(cpu_kernels):
    if not cpu_kernels.has_packed_linear:
        pytest.skip("no packed bf16 linear kernel in this build")
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(64, 96, generator=gen).bfloat16()
    packed = cpu_kernels.pack_linear_weight(w)
    x = torch.randn(3, 96, generator=gen).bfloat16()
    y = cpu_kernels.packed_linear(x, packed)
    assert y.shape == (3, 64) and torch.equal(y, cpu_kernels.packed_linear(x.unsqueeze(0), packed)[0])
    torch.testing.assert_close(y, reference.linear(x, w), atol=2e-2, rtol=1.6e-2)
    g = cpu_kernels.packed_linear_silu_and_mul(x, packed)
    assert g.shape == (3, 32) and torch.equal(g, cpu_kernels.packed_linear_silu_and_mul(x.unsqueeze(0), packed)[0])


@pytest.mark.parametrize("rows", [0, 1, 5])
def test_qkv_split_views(rows):
    """The same views (shapes, data pointers, strides of every dimension longer than
    one) as splitting the columns and viewing each part, on contiguous and strided rows."""
    shape = AttentionShape(num_heads=9, num_kv_heads=3, head_dim=64, scale=0.125)
    for qkv in (torch.randn(rows, 960), torch.randn(rows, 970)[:, 5:965]):
        old = [
            part.view(rows, -1, 64) if rows else part.reshape(rows, part.shape[1] // 64, 64)
            for part in qkv.split([576, 192, 192], dim=-1)
        ]
        for a, b in zip(old, qkv_split(qkv, shape)):
            assert a.shape == b.shape
            if rows:
                assert a.data_ptr() == b.data_ptr()
                assert [s for s, n in zip(a.stride(), a.shape) if n > 1] == [
                    s for s, n in zip(b.stride(), b.shape) if n > 1
                ]


def _scheduled(*num_new: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(num_new_tokens=n) for n in num_new]


def test_sampling_hidden_rows():
    hidden = torch.randn(7, 8)
    # Pure decode, every request samples: the hidden states themselves.
    same = hidden[:3]
    assert sampling_hidden(same, torch.tensor([0, 1, 2]), [0, 1, 2], _scheduled(1, 1, 1), lambda t: t) is same
    # A prefill chunk among them: the last token of each request.
    idx = torch.tensor([3, 4, 6])
    got = sampling_hidden(hidden, idx, [0, 1, 2], _scheduled(4, 1, 2), lambda t: t)
    assert torch.equal(got, hidden[[3, 4, 6]])
    # Only some requests sample (a chunk that does not reach its prompt's end).
    got = sampling_hidden(hidden, idx, [0, 2], _scheduled(4, 1, 2), lambda t: t)
    assert torch.equal(got, hidden[[3, 6]])
    moved = []
    sampling_hidden(hidden, idx, [1], _scheduled(4, 1, 2), lambda t: moved.append(t) or t)
    assert moved and moved[0].tolist() == [4]
