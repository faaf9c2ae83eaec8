"""The Mamba 2 mixer shared by Granite 4 and Nemotron-H: a model class mixes it in and
sets its shapes (``d_inner``, ``conv_dim``, ``heads``, ``head_dim``, ``groups``,
``d_state``, ``chunk``, ``dt_limit``, ``mamba_eps``, ``state``: a StateLayout); a layer
holds ``in_proj``, ``conv``, ``conv_bias``, ``dt_bias``, ``A``, ``D``, ``out_norm`` and
``out_proj`` (see GraniteHybridLayer)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pagedserve.models.layers import linear
from pagedserve.models.recurrent import chunk_info, run_segmented

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = ["Mamba2Mixer"]


class Mamba2Mixer:
    """The ``_mamba`` forward of a Mamba 2 layer: h [n, hidden] -> [n, hidden], with the
    step's state checkpoint work (``models.recurrent.run_segmented``)."""

    def _mamba(
        self, ops, layer, h: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """The mixer with its state-checkpoint work: projections, step sizes and the gated
        output norm once over the step's tokens, the convolution and SSD scan
        (:meth:`_mamba_scan`) in segments where checkpoints are due."""
        n = h.shape[0]
        z, xbc, dt = linear(ops, h, layer.in_proj).split([self.d_inner, self.conv_dim, self.heads], dim=-1)
        step = F.softplus(dt.float() + layer.dt_bias)
        if self.dt_limit != (0.0, math.inf):
            step = step.clamp(*self.dt_limit)
        (y,) = run_segmented(
            lambda xs, m, st: (self._mamba_scan(ops, layer, *xs, st, m),), (xbc, step), kv_cache, meta, self.state
        )
        size = self.d_inner // self.groups
        y = ops.rms_norm_gated(y.reshape(n, self.d_inner), z, layer.out_norm, self.mamba_eps, False, size)
        return linear(ops, y, layer.out_proj)

    def _mamba_scan(
        self,
        ops,
        layer,
        xbc: torch.Tensor,
        step: torch.Tensor,
        states: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The convolution and SSD scan over ``states`` (the rows' convolution windows and
        SSM states, updated in place): y [n, heads, head_dim]."""
        n = xbc.shape[0]
        has_state, decode = chunk_info(meta)
        conv_state, state = states
        if decode:
            xbc = ops.causal_conv1d_update(xbc, layer.conv, layer.conv_bias, conv_state, "silu")
        else:
            xbc = ops.causal_conv1d(
                xbc, layer.conv, layer.conv_bias, conv_state, meta.query_start_loc, has_state, "silu"
            )
        gn = self.groups * self.d_state
        xs, B, C = xbc.split([self.d_inner, gn, gn], dim=-1)
        xs = xs.reshape(n, self.heads, self.head_dim)
        B, C = B.reshape(n, self.groups, self.d_state), C.reshape(n, self.groups, self.d_state)
        if decode:
            y = ops.mamba2_ssd_step(xs, step, layer.A, B, C, layer.D, state)
        else:
            y = ops.mamba2_ssd(xs, step, layer.A, B, C, layer.D, state, meta.query_start_loc, self.chunk)
        return y
