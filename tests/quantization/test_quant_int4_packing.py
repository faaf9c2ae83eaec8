"""The tests' own GPTQ/AWQ packers (test_quant_support.py) against the formats'
definitions, by known answers worked out by hand, and the product's unpacking against
those packers.

The int4 formats, as their packers write them:
- GPTQ (AutoGPTQ): qweight int32 ``[K/8, N]``, input row 8i+j in bits 4j..4j+3 of row
  i; qzeros int32 ``[G, N/8]``, column 8c+j in bits 4j.. (sequential), storing zero - 1.
- AWQ (AutoAWQ GEMM): qweight int32 ``[K, N/8]`` and qzeros ``[G, N/8]``; nibble i of
  each int32 holds column ``order_map[i]`` of its 8, order_map = [0, 2, 4, 6, 1, 3, 5, 7].
"""

from __future__ import annotations

import torch
from test_quant_support import AUTOAWQ_ORDER_MAP, pack_cols, pack_rows

from pagedserve.kernels import quant_reference as ref


def _int32(v: int) -> int:
    return v - (1 << 32) if v >= 1 << 31 else v


def _pack_scalar(values: list[int], order: list[int]) -> int:
    """One int32 from 8 nibbles, one at a time: nibble i <- values[order[i]]."""
    word = 0
    for i in range(8):
        word |= (values[order[i]] & 0xF) << (4 * i)
    return _int32(word)


def test_gptq_qweight_known_answer():
    # Column 0 holds rows 0..7 = 0..7; column 1 rows 0..7 = 15, 14, ..., 8.
    q = torch.tensor([[r, 15 - r] for r in range(8)])
    packed = pack_rows(q)
    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    assert packed[0, 0].item() == 0x76543210
    assert packed[0, 1].item() == _int32(0x89ABCDEF)


def test_awq_known_answer():
    # Columns 0..7 hold 0..7: nibble i holds column order_map[i] -> 0x75316420.
    q = torch.arange(8).reshape(1, 8)
    assert pack_cols(q, AUTOAWQ_ORDER_MAP)[0, 0].item() == 0x75316420
    assert pack_cols(q)[0, 0].item() == 0x76543210  # GPTQ's sequential qzeros order


def test_vectorised_packers_match_a_scalar_packer():
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (16, 24), generator=gen)
    awq = pack_cols(q, AUTOAWQ_ORDER_MAP)
    rows = pack_rows(q)
    for r in range(16):
        for c in range(3):
            cols = q[r, 8 * c : 8 * c + 8].tolist()
            assert awq[r, c].item() == _pack_scalar(cols, list(AUTOAWQ_ORDER_MAP))
    for i in range(2):
        for c in range(24):
            assert rows[i, c].item() == _pack_scalar(q[8 * i : 8 * i + 8, c].tolist(), list(range(8)))


def test_product_awq_dequantize_reads_the_autoawq_layout():
    """q[k, n] = (k + n) % 16, zeros 3 (one group), scales 0.5: (q - 3) * 0.5 in [N, K]."""
    k_dim, n_dim = 4, 16
    q = torch.tensor([[(k + n) % 16 for n in range(n_dim)] for k in range(k_dim)])
    zeros = torch.full((1, n_dim), 3)
    scales = torch.full((1, n_dim), 0.5, dtype=torch.float16)
    w = ref.awq_dequantize(pack_cols(q, AUTOAWQ_ORDER_MAP), pack_cols(zeros, AUTOAWQ_ORDER_MAP), scales, k_dim)
    expect = torch.tensor([[((k + n) % 16 - 3) * 0.5 for k in range(k_dim)] for n in range(n_dim)])
    assert torch.equal(w, expect)


def test_product_gptq_dequantize_reads_the_gptq_layout():
    """Two groups by g_idx; stored zeros are zero - 1."""
    k_dim, n_dim = 16, 8
    q = torch.tensor([[(3 * k + n) % 16 for n in range(n_dim)] for k in range(k_dim)])
    g_idx = torch.tensor([k % 2 for k in range(k_dim)], dtype=torch.int32)
    zeros = torch.tensor([[1 + n for n in range(n_dim)], [8] * n_dim])
    scales = torch.tensor([[0.25] * n_dim, [2.0] * n_dim], dtype=torch.float16)
    w = ref.gptq_dequantize(pack_rows(q), pack_cols(zeros - 1), scales, g_idx)
    expect = torch.tensor(
        [
            [((3 * k + n) % 16 - (1 + n if k % 2 == 0 else 8)) * (0.25 if k % 2 == 0 else 2.0) for k in range(k_dim)]
            for n in range(n_dim)
        ]
    )
    assert torch.equal(w, expect)
