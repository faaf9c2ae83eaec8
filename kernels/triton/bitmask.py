"""Triton kernel of ``apply_token_bitmask`` (structured outputs).

Same contract as :func:`pagedserve.kernels.reference.apply_token_bitmask`: in place,
only the rows named by ``indices``; columns past the bitmask are disallowed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton._common import FLOAT_DTYPES, check_same_device, check_tensor

__all__ = ["apply_token_bitmask"]

_BLOCK = 1024


@triton.jit
def _bitmask_kernel(
    logits_ptr, bitmask_ptr, indices_ptr, vocab, words, stride_row, HAS_INDICES: tl.constexpr, BLOCK: tl.constexpr
):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = i
    if HAS_INDICES:
        row = tl.load(indices_ptr + i)
    in_vocab = cols < vocab
    word_idx = cols // 32
    word = tl.load(bitmask_ptr + i * words + word_idx, mask=in_vocab & (word_idx < words), other=0)
    allowed = ((word >> (cols % 32)) & 1) != 0
    ptrs = logits_ptr + row.to(tl.int64) * stride_row + cols
    tl.store(
        ptrs, tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty), mask=in_vocab & ~allowed
    )


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> torch.Tensor:
    """logits [rows, vocab] float (in place); bitmask int32 [n, words]; indices int64 [n] or None."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor("bitmask", bitmask, ndim=2, dtypes=(torch.int32,), contiguous=True)
    check_same_device(logits=logits, bitmask=bitmask)
    n = bitmask.shape[0]
    if indices is None:
        if n != logits.shape[0]:
            raise ValueError(f"bitmask has {n} rows but logits {logits.shape[0]}; pass indices")
        idx = bitmask  # unused when HAS_INDICES is false
    else:
        idx = check_tensor("indices", indices, ndim=1, dtypes=(torch.int64, torch.int32), contiguous=True)
        check_same_device(logits=logits, indices=idx)
        if idx.numel() != n:
            raise ValueError(f"indices has {idx.numel()} entries for {n} bitmask rows")
    if n == 0:
        return logits
    vocab = logits.shape[1]
    grid = (n, triton.cdiv(vocab, _BLOCK))
    _bitmask_kernel[grid](
        logits, bitmask, idx, vocab, bitmask.shape[1], logits.stride(0), HAS_INDICES=indices is not None, BLOCK=_BLOCK
    )
    return logits
