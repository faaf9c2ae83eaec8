"""GPTQ and AWQ 4-bit checkpoints in their Hugging Face formats (layouts in
kernels/quant_reference.py): packed int32 qweight/qzeros, fp16 group scales, GPTQ's g_idx.

Weights stay packed (half a byte per value plus group metadata).  On every device the
weight is unpacked a tile of output channels at a time into the activation dtype and
multiplied densely, which bounds the temporary to one tile (a fused Triton kernel for
GPUs is future work, see docs/quantization.md).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from pagedserve.kernels import quant_reference as ref
from pagedserve.quantization.base import LINEAR_SUFFIXES, QuantizationMethod, QuantizedWeight

__all__ = ["GPTQWeight", "AWQWeight", "GPTQMethod", "AWQMethod"]

#: Output channels dequantized at once for small batches (multiple of 8: one packed
#: int32 column), which bounds the temporary float weight to one tile.
TILE_N = 512


def _pack_int4_cols(q: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 ``[R, C]`` in [0, 15] -> int32 ``[R, C/8]``, the inverse of
    ``quant_reference.unpack_int4_cols`` (``order[i]``: the column nibble i holds)."""
    q = q.to(torch.int64).view(q.shape[0], -1, 8)
    if order is not None:
        q = q[:, :, list(order)]
    words = (q << torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _select_out(packed: torch.Tensor, rows: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """Output channels ``rows`` of an int32 ``[R, out/8]`` tensor packed along them (an
    index of ``out`` or more selects a zero channel); NotImplementedError unless whole
    words come out."""
    if len(rows) % 8:
        raise NotImplementedError(f"{len(rows)} output channels are not whole packed int32 words")
    q = ref.unpack_int4_cols(packed, order)
    q = torch.cat([q, q.new_zeros(q.shape[0], 1)], 1).index_select(1, rows.clamp(max=q.shape[1]))
    return _pack_int4_cols(q, order)


def _zero_col(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(t.shape[0], 1)], 1)


class _Int4Weight(QuantizedWeight):
    """Common part: scales fp16 ``[G, out]``; qzeros int32 ``[G, out/8]``."""

    def __init__(self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> None:
        self.qweight, self.qzeros, self.scales = qweight, qzeros, scales
        self.out_features = scales.shape[1]

    def _dequant_cols(self, n0: int, n1: int) -> torch.Tensor:
        """float32 ``[n1 - n0, in]`` for output channels n0..n1 (multiples of 8)."""
        raise NotImplementedError

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        tile = TILE_N if x.shape[0] <= 64 else self.out_features
        outs = [
            x @ self._dequant_cols(n0, min(n0 + tile, self.out_features)).to(x.dtype).t()
            for n0 in range(0, self.out_features, tile)
        ]
        y = torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
        return y if bias is None else y + bias.to(y.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._dequant_cols(0, self.out_features).to(dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qweight, self.qzeros, self.scales, getattr(self, "g_idx", None)) if t is not None]


class GPTQWeight(_Int4Weight):
    """qweight int32 ``[in/8, out]``, g_idx int32 ``[in]`` (act order or ``k // group_size``)."""

    def __init__(self, qweight, qzeros, scales, g_idx) -> None:
        super().__init__(qweight, qzeros, scales)
        self.g_idx = g_idx.int()
        self.in_features = qweight.shape[0] * 8

    def _dequant_cols(self, n0: int, n1: int) -> torch.Tensor:
        return ref.gptq_dequantize(
            self.qweight[:, n0:n1], self.qzeros[:, n0 // 8 : n1 // 8], self.scales[:, n0:n1], self.g_idx
        )

    def to(self, device: torch.device) -> GPTQWeight:
        if self.qweight.device == device:
            return self
        return GPTQWeight(*(t.to(device) for t in (self.qweight, self.qzeros, self.scales, self.g_idx)))

    def select_rows(self, rows: torch.Tensor) -> GPTQWeight:
        # Output channels are qweight's and scales' columns; qzeros packs 8 of them a word.
        idx = rows.clamp(max=self.out_features)
        return GPTQWeight(
            _zero_col(self.qweight).index_select(1, idx),
            _select_out(self.qzeros, rows, None),
            _zero_col(self.scales).index_select(1, idx),  # a zero scale: a zero channel
            self.g_idx,
        )

    def select_columns(self, start: int, stop: int) -> GPTQWeight | None:
        # Inputs are packed 8 a word along qweight's rows; g_idx keeps naming each input's
        # group (act order too), so every group's scales and zeros stay.
        if start % 8 or stop % 8:
            return None
        return GPTQWeight(self.qweight[start // 8 : stop // 8], self.qzeros, self.scales, self.g_idx[start:stop])

    @classmethod
    def concat(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        if any(not torch.equal(p.g_idx, parts[0].g_idx) for p in parts):
            # Fused projections share an input, hence GPTQ's act order; refuse odd files loudly.
            raise ValueError("GPTQ weights fused into one matmul (q/k/v, gate/up) have different g_idx")
        return cls(
            torch.cat([p.qweight for p in parts], 1),
            torch.cat([p.qzeros for p in parts], 1),
            torch.cat([p.scales for p in parts], 1),
            parts[0].g_idx,
        )


class AWQWeight(_Int4Weight):
    """qweight int32 ``[in, out/8]`` (AWQ pack order), group_size rows per scale group."""

    def __init__(self, qweight, qzeros, scales, group_size: int) -> None:
        super().__init__(qweight, qzeros, scales)
        self.group_size = group_size
        self.in_features = qweight.shape[0]

    def _dequant_cols(self, n0: int, n1: int) -> torch.Tensor:
        return ref.awq_dequantize(
            self.qweight[:, n0 // 8 : n1 // 8],
            self.qzeros[:, n0 // 8 : n1 // 8],
            self.scales[:, n0:n1],
            self.group_size,
        )

    def to(self, device: torch.device) -> AWQWeight:
        if self.qweight.device == device:
            return self
        return AWQWeight(*(t.to(device) for t in (self.qweight, self.qzeros, self.scales)), self.group_size)

    def select_rows(self, rows: torch.Tensor) -> AWQWeight:
        # Output channels are packed 8 a word (AWQ order) in qweight and qzeros.
        return AWQWeight(
            _select_out(self.qweight, rows, ref.AWQ_ORDER),
            _select_out(self.qzeros, rows, ref.AWQ_ORDER),
            _zero_col(self.scales).index_select(1, rows.clamp(max=self.out_features)),
            self.group_size,
        )

    def select_columns(self, start: int, stop: int) -> AWQWeight | None:
        # Input rows in whole groups of group_size: their scales and zeros come along.
        g = self.group_size
        if start % g or stop % g:
            return None
        groups = slice(start // g, stop // g)
        return AWQWeight(self.qweight[start:stop], self.qzeros[groups], self.scales[groups], g)

    @classmethod
    def concat(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        return cls(
            torch.cat([p.qweight for p in parts], 1),
            torch.cat([p.qzeros for p in parts], 1),
            torch.cat([p.scales for p in parts], 1),
            parts[0].group_size,
        )


class _Int4Method(QuantizationMethod):
    parts: tuple[str, ...] = ()

    def __init__(self, ops, dtype, config=None) -> None:
        super().__init__(ops, dtype, config)
        if int(self.config.get("bits", 4)) != 4:
            raise ValueError(f"{self.name}: only 4-bit checkpoints are supported, got bits={self.config.get('bits')}")
        self.group_size = int(self.config.get("group_size", 128))

    def build(self, parts: dict[str, torch.Tensor], in_features: int) -> QuantizedWeight:
        raise NotImplementedError

    def weights(self, source) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        modules = {s[: -len(".weight")] for s in LINEAR_SUFFIXES}
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in source.plain_weights():
            prefix, _, leaf = name.rpartition(".")
            if prefix.rpartition(".")[2] in modules and leaf in self.parts:
                got = pending.setdefault(prefix, {})
                got[leaf] = t
                if len(got) == len(self.parts):
                    yield prefix + ".weight", self.build(pending.pop(prefix), 0)
            else:
                yield name, t
        if pending:
            prefix, got = next(iter(pending.items()))
            raise ValueError(f"{self.name} checkpoint: {prefix} lacks {sorted(set(self.parts) - set(got))}")


class GPTQMethod(_Int4Method):
    name = "gptq"
    description = "GPTQ 4-bit (packed int32, group scales, act-order g_idx)"
    parts = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, ops, dtype, config=None) -> None:
        super().__init__(ops, dtype, config)
        fmt = self.config.get("checkpoint_format", "gptq")
        if fmt != "gptq":
            raise ValueError(f"gptq: checkpoint_format {fmt!r} is not supported (supported: 'gptq')")

    def build(self, p: dict[str, torch.Tensor], in_features: int) -> QuantizedWeight:
        return GPTQWeight(p["qweight"], p["qzeros"], p["scales"], p["g_idx"])


class AWQMethod(_Int4Method):
    name = "awq"
    description = "AWQ 4-bit GEMM format (packed int32 in AWQ order, group scales and zeros)"
    parts = ("qweight", "qzeros", "scales")

    def __init__(self, ops, dtype, config=None) -> None:
        super().__init__(ops, dtype, config)
        version = str(self.config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq: version {version!r} is not supported (supported: 'gemm')")
        if not self.config.get("zero_point", True):
            raise ValueError("awq: checkpoints without zero points are not supported")

    def build(self, p: dict[str, torch.Tensor], in_features: int) -> QuantizedWeight:
        return AWQWeight(p["qweight"], p["qzeros"], p["scales"], self.group_size)
